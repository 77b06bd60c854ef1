"""A tree of arrays as a directory of .npy files, read back memory-mapped.

    DIR/
      index.json            {"leaves": {"layers/attn/q_proj/kernel": {"dtype": ..., "shape": [...]}, ...}}
      layers/attn/q_proj/kernel.npy   one file per leaf (nested dicts become folders)

The model cache keeps its converted weights so (`orca_jax.loading.model_cache`): `load_tree` maps the
files instead of reading them, and an .npy file's data starts 64-byte aligned, so on CPU
`jax.device_put` of a mapped leaf is zero-copy. A warm start then neither reads nor copies
514 MB of weights: the pages come from the operating system's file cache as the first step
touches them (measured on 2 cores: 0.01 s, against 0.7-2.4 s for orbax's uncompressed restore
plus ~0.6 s to import orbax; docs/benchmarks.md, start-up).

dtypes numpy lacks (bfloat16, float8: ml_dtypes) are stored as unsigned integers of their width
and viewed back by the index's dtype name, which costs nothing. A damaged file (truncated, a
header that disagrees with the index) raises ValueError when loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

INDEX_FILE = "index.json"
_SEPARATOR = "/"


def save_tree(directory: str | Path, tree: dict) -> None:
    """Write every leaf of a nested dict of arrays (numpy, or anything np.asarray takes)."""
    directory = Path(directory)
    leaves = {}
    for name, value in _flatten(tree):
        array = np.ascontiguousarray(value)
        path = directory / f"{name}.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, _storable(array), allow_pickle=False)
        leaves[name] = {"dtype": array.dtype.name, "shape": list(array.shape)}
    # Last: a directory without its index was never finished.
    (directory / INDEX_FILE).write_text(json.dumps({"leaves": leaves}, indent=1))


def load_tree(directory: str | Path) -> dict:
    """The tree, each leaf a read-only memory map of its file in the index's dtype and shape."""
    directory = Path(directory)
    try:
        leaves = json.loads((directory / INDEX_FILE).read_text())["leaves"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{directory / INDEX_FILE} is missing or damaged: {exc}") from exc
    tree: dict = {}
    for name, spec in leaves.items():
        array = _load_leaf(directory / f"{name}.npy", spec)
        *parents, leaf = name.split(_SEPARATOR)
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = array
    return tree


def _load_leaf(path: Path, spec: dict) -> np.ndarray:
    try:
        # An empty array has no data to map (numpy refuses); it is read instead.
        mode = "r" if np.prod(spec["shape"]) else None
        stored = np.load(path, mmap_mode=mode, allow_pickle=False)
        dtype = np.dtype(spec["dtype"])  # ml_dtypes names resolve once jax (ml_dtypes) is imported
        array = stored if stored.dtype == dtype else stored.view(dtype)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"cannot map {path}: {type(exc).__name__}: {exc}") from exc
    if list(array.shape) != list(spec["shape"]):
        raise ValueError(f"{path} holds shape {array.shape}, the index says {spec['shape']}")
    return array


def _storable(array: np.ndarray) -> np.ndarray:
    """numpy's own dtypes as they are; ml_dtypes ones as unsigned integers of their width (an
    .npy header cannot name them)."""
    return array if array.dtype.isbuiltin == 1 else array.view(np.dtype(f"u{array.dtype.itemsize}"))


def _flatten(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if _SEPARATOR in key or not key:
            raise ValueError(f"tree key {key!r} cannot be a file name")
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, name + _SEPARATOR)
        else:
            yield name, value
