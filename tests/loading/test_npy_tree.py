"""npy_tree: a nested dict of arrays saved one .npy per leaf and read back memory-mapped, every
dtype bit for bit (ml_dtypes ones too), placed on the CPU without a copy; damage is a ValueError."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.loading import npy_tree


def _tree():
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((64, 16)).astype(np.float32),
        "layers": {"attn": {"kernel": rng.standard_normal((2, 16, 8)).astype(jnp.bfloat16),
                            "kernel_qscale": rng.standard_normal((2, 1, 8)).astype(np.float16)},
                   "mlp": {"kernel": rng.integers(-128, 127, (2, 16, 32), dtype=np.int8),
                           "fp8": rng.standard_normal((2, 4)).astype(jnp.float8_e4m3fn)}},
        "empty": np.zeros((0, 3), np.float32),
        "transposed": rng.standard_normal((8, 4)).astype(np.float32).T,  # not contiguous
    }


def test_round_trip_is_bit_identical_and_mapped(tmp_path):
    tree = _tree()
    npy_tree.save_tree(tmp_path / "params", tree)
    back = npy_tree.load_tree(tmp_path / "params")
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for got, expected in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.tobytes() == np.ascontiguousarray(expected).tobytes()
    mapped = back["embed"]
    assert isinstance(mapped.base, np.memmap) or isinstance(mapped, np.memmap)
    assert not mapped.flags.writeable  # read-only: the file is never changed through it


def test_a_mapped_leaf_is_placed_on_the_cpu_without_a_copy(tmp_path):
    npy_tree.save_tree(tmp_path, _tree())
    back = npy_tree.load_tree(tmp_path)
    for leaf in (back["embed"], back["layers"]["attn"]["kernel"]):
        placed = jax.device_put(leaf)
        assert not placed.committed
        if jax.default_backend() == "cpu":
            assert placed.unsafe_buffer_pointer() == leaf.ctypes.data  # aligned data: zero-copy
        assert np.asarray(placed).tobytes() == leaf.tobytes()


def test_damage_is_a_value_error(tmp_path):
    npy_tree.save_tree(tmp_path, _tree())
    kernel = tmp_path / "layers" / "mlp" / "kernel.npy"
    kernel.write_bytes(kernel.read_bytes()[:-5])
    with pytest.raises(ValueError, match="kernel.npy"):
        npy_tree.load_tree(tmp_path)
    npy_tree.save_tree(tmp_path, _tree())
    index = json.loads((tmp_path / npy_tree.INDEX_FILE).read_text())
    index["leaves"]["embed"]["shape"] = [16, 64]
    (tmp_path / npy_tree.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="shape"):
        npy_tree.load_tree(tmp_path)
    (tmp_path / npy_tree.INDEX_FILE).unlink()
    with pytest.raises(ValueError, match="index.json"):
        npy_tree.load_tree(tmp_path)


def test_keys_that_are_not_file_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="file name"):
        npy_tree.save_tree(tmp_path, {"a/b": np.zeros(2)})
