"""Packed 4-bit weights: two 4-bit codes per byte, one scale per block of consecutive values
along the contraction axis, kept so on the device and unpacked only where a matmul reads them.

    blocks  uint8 [..., N, K / 2]            the codes of each output row's K values, two per byte
    scales  uint8 or float16 [..., N, K / B]  one scale per block of B values

    w[..., n, k] = codebook[code(n, k)] * scale(n, k // B)

A format (`FORMATS`) says what the codes mean, how a scale byte reads, and which two values
share a byte:

    "mxfp4"  OCP microscaling FP4, gpt-oss's experts: e2m1 codes (+-0, 0.5, 1, 1.5, 2, 3, 4, 6),
             blocks of 32, an e8m0 scale (the byte s means 2 ** (s - 127)); value 2i of a block
             in the low nibble of byte i, value 2i + 1 in the high one. As HF checkpoints
             store it (`*_blocks` [..., N, K / 32, 16], `*_scales` [..., N, K / 32]).
    "q4_0"   GGUF's Q4_0 as the same two arrays: codes i - 8, blocks of 32, a float16 scale;
             the low nibbles hold a block's first 16 values, the high nibbles its last 16.
             Here so that llama.cpp's 4-bit blocks can be read by the same matmuls; the GGUF
             loader does not use it yet (it expands Q4_0 to one int8 per value,
             orca_jax/kernels/quantization.py).

The rows are output channels and the packing runs along the contraction, so a matmul streams
K/2 bytes per output channel (a quarter of bfloat16's) and unpacks a block as it needs it
(`PackedWeight.matrix`). `pack` (numpy, at load time) rounds float weights to the nearest code
at a power-of-two scale per block, as the OCP spec rounds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127


@dataclass(frozen=True)
class Packed4Format:
    name: str
    block_size: int
    codebook: tuple[float, ...]  # the value of each of the 16 codes
    scale_kind: str  # "e8m0": the byte s is 2 ** (s - 127); "float16": the scale itself
    interleaved: bool  # True: byte i holds values 2i (low) and 2i + 1; False: i and i + B / 2

    def scale_values(self, scales) -> jax.Array:
        if self.scale_kind == "e8m0":
            # The byte is a float32's exponent field: 2 ** (s - 127) built bit-exact (exp2 on
            # XLA's CPU is an approximation), 0 read as zero (2 ** -127 is subnormal).
            return jax.lax.bitcast_convert_type(scales.astype(jnp.uint32) << 23, jnp.float32)
        return scales.astype(jnp.float32)


FORMATS = {
    "mxfp4": Packed4Format("mxfp4", 32, E2M1_VALUES, "e8m0", interleaved=True),
    "q4_0": Packed4Format("q4_0", 32, tuple(float(i - 8) for i in range(16)), "float16", interleaved=False),
}


def packed_format(name: str) -> Packed4Format:
    if name not in FORMATS:
        raise ValueError(f"unknown packed 4-bit format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def unpack(blocks, scales, fmt: Packed4Format, dtype=jnp.float32) -> jax.Array:
    """blocks u8[..., N, K/2], scales [..., N, K/B] -> the weights [..., N, K] in `dtype`. The
    product of a code and a power-of-two scale is exact in float32 and bfloat16, so the
    dtype changes nothing for MXFP4 but the bytes."""
    blocks = jnp.asarray(blocks)
    low, high = blocks & 0x0F, blocks >> 4
    *lead, num_bytes = blocks.shape
    B = fmt.block_size
    if fmt.interleaved:
        codes = jnp.stack([low, high], axis=-1).reshape(*lead, num_bytes // (B // 2), B)
    else:
        per_block = (*lead, num_bytes // (B // 2), B // 2)
        codes = jnp.concatenate([low.reshape(per_block), high.reshape(per_block)], axis=-1)
    values = jnp.asarray(fmt.codebook, jnp.float32)[codes.astype(jnp.int32)]
    weights = values * fmt.scale_values(jnp.asarray(scales))[..., None]
    return weights.reshape(*lead, num_bytes * 2).astype(dtype)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedWeight:
    """A stack of G packed matrices, each [N, K] (output channels by contraction), as the grouped
    expert matmuls take them in place of a float [G, K, N] stack."""

    blocks: jax.Array  # u8[G, N, K/2]
    scales: jax.Array  # [G, N, K/B]
    format: str = dataclasses.field(default="mxfp4", metadata=dict(static=True))

    @property
    def num_groups(self) -> int:
        return self.blocks.shape[0]

    def matrix(self, group, dtype) -> jax.Array:
        """Group `group`'s matrix, unpacked: [K, N] in `dtype`."""
        return unpack(self.blocks[group], self.scales[group], packed_format(self.format), dtype).T

    def stacked(self, dtype) -> jax.Array:
        """Every group's matrix, unpacked: [G, K, N] in `dtype`."""
        return jnp.swapaxes(unpack(self.blocks, self.scales, packed_format(self.format), dtype), -1, -2)


def pack_mxfp4(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float weights [..., N, K] (K a multiple of 32) -> (blocks u8[..., N, K/2], scales
    u8[..., N, K/32]) in MXFP4: each block's scale the power of two that brings its largest
    magnitude into e2m1's range (2 ** (floor(log2(max)) - 2), the OCP rule), each value the
    nearest code (beyond 6 clamped to 6)."""
    fmt = FORMATS["mxfp4"]
    *lead, K = weights.shape
    if K % fmt.block_size:
        raise ValueError(f"MXFP4 packs blocks of {fmt.block_size} along the contraction; it has {K} values")
    w = np.asarray(weights, np.float32).reshape(*lead, K // fmt.block_size, fmt.block_size)
    amax = np.abs(w).max(axis=-1)
    exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -E8M0_BIAS)
    exponent = np.clip(exponent, -E8M0_BIAS, E8M0_BIAS)
    scaled = np.abs(w) / np.exp2(exponent)[..., None]
    magnitudes = np.asarray(fmt.codebook[:8], np.float32)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    codes = np.searchsorted(midpoints, scaled, side="left").astype(np.uint8)  # 0..7; ties round down
    codes |= np.where(np.signbit(w), 8, 0).astype(np.uint8)
    codes = codes.reshape(*lead, K)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    # C order whatever the input's strides (numpy keeps a transposed input's layout, and
    # safetensors writes an array's memory as it lies).
    return np.ascontiguousarray(blocks), np.ascontiguousarray((exponent + E8M0_BIAS).astype(np.uint8))
