"""Packed 4-bit weights (orca_jax/kernels/packed4.py): unpacking against a float64 reading of the
spec (exact: a 4-bit code times a power of two is representable in float32 and bfloat16),
packing as round-to-nearest on the block's grid, GGUF's Q4_0 read as the same two arrays
against the `gguf` package's own dequantization, and the grouped expert matmuls
(orca_jax/kernels/grouped_mlp.py) on packed weights against the same matmuls on the unpacked
floats (1e-5 absolute: the same float32 products, summed in another order) and against a
float64 reference with gpt-oss's biases and clamped SwiGLU (1e-4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.kernels import grouped_mlp, packed4
from orca_jax.kernels.packed4 import PackedWeight
from orca_jax.models.moe import clamped_swiglu

MXFP4 = packed4.FORMATS["mxfp4"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unpack_is_exact_against_the_spec(dtype, float64_mxfp4_dequantize):
    rng = np.random.default_rng(0)
    blocks = np.arange(256, dtype=np.uint8).reshape(4, 2, 32)  # every byte value, 2 blocks per row
    # Scales of 2 ** -37 .. 2 ** 32: trained weights' range. (At the format's ends, 2 ** -127 is
    # below float32's normal numbers, which XLA's CPU flushes to zero, and 6 * 2 ** 127 above its max.)
    scales = rng.integers(90, 160, size=(4, 2, 2)).astype(np.uint8)
    out = np.asarray(packed4.unpack(blocks, scales, MXFP4, dtype)).astype(np.float64)
    np.testing.assert_array_equal(out, float64_mxfp4_dequantize(blocks, scales))


def test_pack_rounds_to_the_nearest_code_of_the_block_scale():
    rng = np.random.default_rng(1)
    weights = (rng.standard_normal((3, 5, 64)) * np.exp2(rng.integers(-8, 8, size=(3, 5, 1)))).astype(np.float32)
    blocks, scales = packed4.pack_mxfp4(weights)
    assert blocks.shape == (3, 5, 32) and scales.shape == (3, 5, 2) and blocks.flags.c_contiguous
    out = np.asarray(packed4.unpack(blocks, scales, MXFP4)).reshape(3, 5, 2, 32)
    w = weights.reshape(3, 5, 2, 32).astype(np.float64)
    scale = np.exp2(scales.astype(np.float64) - 127)[..., None]
    grid = np.asarray(packed4.E2M1_VALUES) * scale[..., None]  # every value the block can hold
    nearest = np.abs(grid - w[..., None]).min(axis=-1)
    np.testing.assert_allclose(np.abs(out - w), nearest, rtol=0, atol=1e-12)
    # The scale puts each block's largest magnitude in [4, 8) codes: nothing clamps below 6.
    assert (np.abs(w).max(axis=-1) / scale[..., 0] >= 4).all()


def test_values_on_the_grid_pack_back_to_themselves():
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, size=(6, 16)).astype(np.uint8)
    blocks[:, 0] |= 0x70  # a 6 in each block, so its scale is the one chosen again
    scales = rng.integers(110, 140, size=(6, 1)).astype(np.uint8)
    weights = np.asarray(packed4.unpack(blocks, scales, MXFP4))
    again = np.asarray(packed4.unpack(*packed4.pack_mxfp4(weights), MXFP4))
    np.testing.assert_array_equal(again, weights)


def test_q4_0_reads_ggufs_blocks_as_the_gguf_package_does():
    """Q4_0 blocks (a float16 scale, then 16 bytes of codes) split into the two arrays and
    unpacked by the "q4_0" format equal gguf's own dequantization."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(3)
    rows, blocks_per_row = 4, 3
    scale = rng.standard_normal((rows, blocks_per_row)).astype(np.float16)
    codes = rng.integers(0, 256, size=(rows, blocks_per_row, 16)).astype(np.uint8)
    raw = np.concatenate([scale[..., None].view(np.uint8), codes], axis=-1)  # [rows, blocks, 18]
    expected = quants.dequantize(raw.reshape(rows, -1), GGMLQuantizationType.Q4_0)
    out = packed4.unpack(codes.reshape(rows, -1), scale, packed4.FORMATS["q4_0"])
    np.testing.assert_array_equal(np.asarray(out), expected.astype(np.float32))


def test_unknown_format_and_misaligned_width_are_refused():
    with pytest.raises(ValueError, match="unknown packed 4-bit format 'nf4'"):
        packed4.packed_format("nf4")
    with pytest.raises(ValueError, match="blocks of 32 along the contraction; it has 48"):
        packed4.pack_mxfp4(np.zeros((2, 48), np.float32))


# ---- the grouped expert matmuls on packed weights ----------------------------------------------
D, F = 64, 32


def _packed_case(rng, group_sizes, num_rows):
    G = len(group_sizes)
    rows = rng.standard_normal((num_rows, D)).astype(np.float32)
    packed = {}
    for name, (k, n) in (("gate", (D, F)), ("up", (D, F)), ("down", (F, D))):
        weight = rng.standard_normal((G, n, k)).astype(np.float32) / np.sqrt(k)  # [G, out, in]
        packed[name] = PackedWeight(*(jnp.asarray(a) for a in packed4.pack_mxfp4(weight)), "mxfp4")
    floats = {name: np.asarray(w.stacked(jnp.float32)) for name, w in packed.items()}  # [G, in, out]
    biases = {name: (rng.standard_normal((G, F)) * 0.5).astype(np.float32) for name in ("gate_bias", "up_bias")}
    return rows, np.asarray(group_sizes, np.int32), packed, floats, biases


@pytest.mark.parametrize("impl", grouped_mlp.IMPLS)
@pytest.mark.parametrize("group_sizes, num_rows", [([3, 0, 17, 1, 9], 37), ([1] * 6, 6), ([0, 0, 0], 4)])
def test_packed_experts_equal_their_unpacked_floats(impl, group_sizes, num_rows):
    rows, sizes, packed, floats, biases = _packed_case(np.random.default_rng(len(group_sizes)), group_sizes, num_rows)
    glu = clamped_swiglu(7.0, 1.702)

    def run(gate, up, down):
        return jax.jit(lambda r, s, g, u, d, b: grouped_mlp.grouped_mlp(
            r, s, g, u, d, None, impl, gate_bias=b["gate_bias"], up_bias=b["up_bias"], glu=glu))(
            rows, sizes, gate, up, down, biases)

    out = np.asarray(run(packed["gate"], packed["up"], packed["down"]))
    np.testing.assert_allclose(out, np.asarray(run(floats["gate"], floats["up"], floats["down"])), atol=1e-5, rtol=0)
    np.testing.assert_allclose(out, _reference(rows, group_sizes, floats, biases), atol=1e-4, rtol=0)
    assert not out[sum(group_sizes):].any()


def _reference(rows, group_sizes, w, biases):
    """float64: each group's rows through its expert, gpt-oss's clamped SwiGLU, biases added."""
    out = np.zeros((rows.shape[0], D))
    start = 0
    for g, size in enumerate(group_sizes):
        x = rows[start:start + size].astype(np.float64)
        gate = np.minimum(x @ w["gate"][g] + biases["gate_bias"][g], 7.0)
        up = np.clip(x @ w["up"][g] + biases["up_bias"][g], -7.0, 7.0)
        h = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
        out[start:start + size] = h @ w["down"][g]
        start += size
    return out


def test_a_packed_weight_crosses_jit_as_a_pytree_with_its_format_static():
    weight = PackedWeight(jnp.zeros((2, 4, 16), jnp.uint8), jnp.full((2, 4, 1), 127, jnp.uint8), "mxfp4")
    leaves, treedef = jax.tree.flatten(weight)
    assert len(leaves) == 2 and jax.tree.unflatten(treedef, leaves).format == "mxfp4"
    assert jax.jit(lambda w: w.matrix(1, jnp.float32))(weight).shape == (32, 4)
