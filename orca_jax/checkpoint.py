"""orbax checkpoints of converted weights: convert an HF directory or GGUF file once, then
start from the checkpoint without reading or converting the original again.

    OUT_DIR/
      orca_jax_checkpoint.json   marker: format version, ModelConfig, dtype, where it came from
      params/                    the Flax parameter tree, saved by orbax (StandardCheckpointer)
      tokenizer/                 the tokenizer, saved by transformers' save_pretrained

`LLM(model=OUT_DIR)` recognises the marker (`orca_jax.models.loader.load_model`) and the runner
restores the parameters straight into their target shardings: with tensor parallelism each
device (each process, multi-host) reads only its own slices from storage. The checkpoint holds
the model's own KV heads; a mesh that replicates them (see `parallel.kv_head_repeats`) restores
K/V projections whole and repeats them on device. A checkpoint converted at one tensor-parallel
size restores at any other.

The same format holds the model cache's entries (`orca_jax.model_cache`: converted GGUF files,
saved uncompressed because restoring then takes half the time).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from orca_jax import parallel
from orca_jax.config import ModelConfig

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MARKER = "orca_jax_checkpoint.json"
PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"
_KV_PROJECTIONS = ("layers/attn/k_proj/", "layers/attn/v_proj/")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be used (missing parts, corrupt, wrong version)."""


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / MARKER).exists()


# ---- writing ----------------------------------------------------------------------------------
def convert(model: str | None, out_dir: str | Path, dtype: str = "float32", tensor_parallel_size: int = 1) -> dict:
    """Load and convert `model` (HF directory, .gguf, hub id, None for the default) and save it
    as an orbax checkpoint in `out_dir`, sharded over `tensor_parallel_size` devices when > 1
    (so a model too large for one device never sits whole on one). Returns timings in seconds."""
    from orca_jax.models.loader import load_model

    if tensor_parallel_size < 1:
        raise CheckpointError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"output directory {out_dir} exists and is not empty")
    start = time.perf_counter()
    loaded = load_model(model)
    if is_checkpoint(Path(loaded.source)):
        raise CheckpointError(f"{loaded.source} is already an orca_jax checkpoint")
    params = _to_devices(loaded.params, jnp.dtype(dtype), loaded.config, tensor_parallel_size)
    loaded.params = None
    convert_s = time.perf_counter() - start
    save_checkpoint(out_dir, params, loaded.tokenizer, loaded.config, dtype, loaded.source,
                    tensor_parallel_size=tensor_parallel_size)
    total_s = time.perf_counter() - start
    logger.info("converted %s -> %s in %.1f s (saving %.1f s)", loaded.source, out_dir, total_s, total_s - convert_s)
    return {"convert_s": convert_s, "total_s": total_s}


def save_checkpoint(out_dir: str | Path, params: dict, tokenizer, config: ModelConfig, dtype: str, source: str, *,
                    tensor_parallel_size: int = 1, compress: bool = True, extra: dict | None = None) -> None:
    """Write a checkpoint directory from converted parameters (numpy or jax arrays, already in
    `dtype`). `compress`: zstd-compress the arrays (a third smaller for float32, but restoring
    takes about twice as long: the model cache turns it off). `extra`: more marker fields."""
    import orbax.checkpoint as ocp

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # StandardCheckpointer is this handler with compression on; the handler lets it be turned off.
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=compress)) as checkpointer:
        checkpointer.save((out_dir / PARAMS_DIR).absolute(), args=ocp.args.PyTreeSave(params))
    tokenizer.save_pretrained(str(out_dir / TOKENIZER_DIR))
    # The marker last: a directory without it was never finished and is not taken for one.
    (out_dir / MARKER).write_text(json.dumps({
        **(extra or {}),
        "format_version": FORMAT_VERSION,
        "model_config": dataclasses.asdict(config),
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel_size,
        "source": source,
    }, indent=2))


def place_host_params(params: dict, dtype, mesh: Mesh | None = None, kv_head_repeats: int = 1) -> dict:
    """Host (numpy) parameters -> jax.Arrays in `dtype`, placed as the runner places converted
    weights: on the default device (uncommitted), or sharded over `mesh` with K/V heads repeated
    `kv_head_repeats` times."""
    if mesh is None:
        return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    params = parallel.replicate_kv_heads(params, kv_head_repeats)
    return parallel.place_params(params, parallel.param_shardings(params, mesh), dtype)


def _to_devices(params: dict, dtype, config: ModelConfig, tensor_parallel_size: int) -> dict:
    if tensor_parallel_size == 1:
        return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    parallel.kv_head_repeats(config, tensor_parallel_size)  # refuse a size the model cannot run at
    mesh = parallel.make_mesh(tensor_parallel_size)
    return parallel.place_params(params, parallel.param_shardings(params, mesh), dtype)


# ---- reading ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Checkpoint:
    """An opened checkpoint directory: its metadata read and checked, parameters not yet read."""

    path: Path
    config: ModelConfig
    dtype: str
    marker: dict = dataclasses.field(default_factory=dict, repr=False)  # the whole marker file

    def restore(self, dtype=None, mesh: Mesh | None = None, kv_head_repeats: int = 1) -> dict:
        """The parameters as jax.Arrays in `dtype` (default: the saved one), on one device or
        sharded over `mesh` by `parallel.param_spec`."""
        import orbax.checkpoint as ocp

        dtype = jnp.dtype(dtype or self.dtype)
        params_dir = (self.path / PARAMS_DIR).absolute()
        start = time.perf_counter()
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                saved = checkpointer.metadata(params_dir)
                # orbax versions differ in how they wrap the tree of array metadata.
                saved = getattr(saved, "item_metadata", saved)
                saved = getattr(saved, "tree", saved)
                target = _restore_targets(saved, dtype, mesh, kv_head_repeats)
                params = checkpointer.restore(params_dir, target)
        except Exception as exc:  # orbax, tensorstore and OS errors alike: name the checkpoint
            raise CheckpointError(f"could not restore orbax checkpoint {params_dir}: {type(exc).__name__}: {exc}") from exc
        _check_shapes(params, self.config, self.path)
        if kv_head_repeats > 1:
            params = _repeat_kv_heads_on_device(params, mesh, kv_head_repeats)
        logger.info("restored %s in %.2f s", params_dir, time.perf_counter() - start)
        return params

    def restore_host(self, dtype=None) -> dict:
        """The parameters as numpy arrays in `dtype` (default: the saved one), on the host."""
        import orbax.checkpoint as ocp

        dtype = jnp.dtype(dtype or self.dtype)
        params_dir = (self.path / PARAMS_DIR).absolute()
        try:
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
                saved = checkpointer.metadata(params_dir)
                saved = getattr(saved, "item_metadata", saved)
                saved = getattr(saved, "tree", saved)
                restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype), saved)
                params = checkpointer.restore(params_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))
        except Exception as exc:  # orbax, tensorstore and OS errors alike: name the checkpoint
            raise CheckpointError(f"could not restore orbax checkpoint {params_dir}: {type(exc).__name__}: {exc}") from exc
        _check_shapes(params, self.config, self.path)
        return params


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read and check the marker of a checkpoint directory (the parameters stay on disk)."""
    path = Path(path)
    marker = path / MARKER
    try:
        meta = json.loads(marker.read_text())
        version = meta["format_version"]
        config = model_config_from_dict(meta["model_config"])
        dtype = meta["dtype"]
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not an orca_jax checkpoint (no {MARKER})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint marker {marker} is corrupt: {type(exc).__name__}: {exc}") from exc
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version}; this orca_jax reads {FORMAT_VERSION}")
    for part in (PARAMS_DIR, TOKENIZER_DIR):
        if not (path / part).is_dir():
            raise CheckpointError(f"checkpoint {path} is incomplete: {path / part} is missing")
    return Checkpoint(path, config, dtype, meta)


def load_tokenizer(checkpoint: Checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint.path / TOKENIZER_DIR))


def model_config_from_dict(fields: dict[str, Any]) -> ModelConfig:
    """ModelConfig from its JSON form (lists back to the tuples it holds)."""
    fields = dict(fields)
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = tuple(tuple(item) for item in fields["rope_scaling"])
    for name in ("rope_freq_factors", "eos_token_ids"):
        if fields.get(name) is not None:
            fields[name] = tuple(fields[name])
    return ModelConfig(**fields)


def _restore_targets(saved: dict, dtype, mesh: Mesh | None, kv_head_repeats: int) -> dict:
    """Abstract arrays (shape, dtype, sharding) for orbax to restore into."""
    one_device = SingleDeviceSharding(jax.local_devices()[0])
    size = mesh.shape[parallel.MODEL_AXIS] if mesh is not None else 1

    def target(path: str, leaf) -> jax.ShapeDtypeStruct:
        shape = tuple(leaf.shape)
        if mesh is None:
            sharding = one_device
        elif kv_head_repeats > 1 and path.startswith(_KV_PROJECTIONS):
            sharding = parallel.replicated(mesh)  # repeated on device, then sharded
        else:
            sharding = NamedSharding(mesh, parallel.param_spec(path, shape, size))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return {"params": parallel.map_with_path(target, saved["params"])}


def _check_shapes(params: dict, config: ModelConfig, path: Path) -> None:
    """The parameters fit the config in the marker (a mismatched params/ directory would
    otherwise fail deep inside the first step)."""
    tree = params["params"]
    expected = {
        "embed": (config.vocab_size, config.hidden_size),
        "layers/attn/q_proj/kernel": (config.num_layers, config.hidden_size, config.num_heads, config.head_dim),
        "layers/attn/k_proj/kernel": (config.num_layers, config.hidden_size, config.num_kv_heads, config.head_dim),
    }
    flat = parallel.tree_paths(tree)
    for name, shape in expected.items():
        if name not in flat or tuple(flat[name].shape) != shape:
            got = tuple(flat[name].shape) if name in flat else "missing"
            raise CheckpointError(f"checkpoint {path}: parameter {name} is {got}, the model config needs {shape}")


def _repeat_kv_heads_on_device(params: dict, mesh: Mesh, repeats: int) -> dict:
    """K/V projections restored whole -> heads repeated (as parallel.replicate_kv_heads does on
    the host) and sharded over the mesh, in one jitted call."""
    attn = params["params"]["layers"]["attn"]
    size = mesh.shape[parallel.MODEL_AXIS]
    for name in ("k_proj", "v_proj"):
        for kind, head_axis in (("kernel", 2), ("bias", 1)):
            if kind not in attn[name]:
                continue
            weight = attn[name][kind]
            shape = list(weight.shape)
            shape[head_axis] *= repeats
            spec = parallel.param_spec(f"layers/attn/{name}/{kind}", tuple(shape), size)
            attn[name][kind] = jax.jit(lambda w, axis=head_axis: jnp.repeat(w, repeats, axis=axis),
                                       out_shardings=NamedSharding(mesh, spec))(weight)
    return params

