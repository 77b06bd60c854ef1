"""The 8-bit KV cache: int8 or float8_e4m3fn values with a bfloat16 scale per token per head.

Storage format (the contract every attention implementation, `write_kv` and the tests share).
The cache keeps its one-array layout `[..., page_size, 2 * num_kv_heads, head_dim + 2]` in
the storage dtype (`KV_CACHE_DTYPES`). Each (token slot, head slot) row holds

    [:head_dim]                 the quantized values q
    [head_dim:head_dim + 2]     that row's scale as a bfloat16, its two bytes in the order of
                                `lax.bitcast_convert_type(scale, uint8)` (little-endian: low
                                byte first), each byte reinterpreted as the storage dtype

and stands for `q * scale`. A row is quantized on its own: scale = max|x| / QMAX (127 for
int8, 448 for float8_e4m3fn, the largest finite values), rounded to bfloat16 *before* x is
divided by it, so the quotient is taken against the very scale that is stored; int8 rounds
to nearest and clips to [-127, 127], float8 clips to [-448, 448] and casts (rounding the scale
down can push |x / scale| a hair past QMAX). A zero row gets scale 0 and q 0: no division by
zero, no NaN.

Why one scale per token and head, kept inside the row:
  - Pages fill one token at a time during decode. A scale per page would be fixed by the
    page's first token, so a later, larger token would clip, or every write would have to
    requantize the whole page. A row's own scale is written once, with its token, by the
    same scatter, and never changes.
  - The cost is 2 bytes per head_dim values: a row of 64 values takes 66 bytes instead of
    bfloat16's 128, so the same memory holds 128 / 66 = 1.94x the tokens (1.97x at head_dim
    128, 130 bytes instead of 256).
  - With the scale bytes in the same row the cache stays one array of one dtype: it is donated
    as before, viewed per layer as before, sharded on its head-slot axis (axis 2 of a layer
    view) under tensor parallelism as before (a head's scales travel with its values), and
    page 0 stays the padding sink. No second array has to follow every one of those paths.

Kernels read the values and the scale separately (`split_rows`) so that they can apply the
scale after a matrix product, once per key, instead of to every value. Reading goes through
the bytes with integer operations only (`bf16_bytes_to_f32`, `e4m3_bits_to_f32`): Triton has
no shape-changing bitcast and, before sm_89, no float8 conversion; XLA:CPU handles float8
arrays by converting them to float16 operation by operation (a decode step of the CPU kernel
ran 15x slower that way than on int8).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# Names (as a config spells them) -> storage dtypes.
KV_CACHE_DTYPES = {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn}
# Bytes of each row's bfloat16 scale, stored after its values.
SCALE_BYTES = 2
# The largest magnitude a quantized value takes, per storage dtype.
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
# bfloat16 NaN, the scale of a poisoned (deliberately unreadable) row in tests.
BF16_NAN_BITS = 0x7FC0


def is_quantized(dtype) -> bool:
    """Whether a cache of this dtype is in the 8-bit format above."""
    return jnp.dtype(dtype) in _QMAX


def cache_head_dim(head_dim: int, dtype) -> int:
    """The cache's last axis for `head_dim` values per row in `dtype`."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def values_head_dim(kv_pages) -> int:
    """head_dim of the values a cache (any view whose last axis is the row) holds."""
    return kv_pages.shape[-1] - (SCALE_BYTES if is_quantized(kv_pages.dtype) else 0)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

# Jitted (here and below) so that eager callers, tests and the case builder, compile one program
# rather than one per operation; inside another jit it is inlined.
@functools.partial(jax.jit, static_argnames="dtype")
def quantize_rows(x: jax.Array, dtype) -> jax.Array:
    """float [..., H] -> storage [..., H + 2] in `dtype` (int8 or float8_e4m3fn)."""
    dtype = jnp.dtype(dtype)
    qmax = _QMAX[dtype]
    x = x.astype(jnp.float32)
    scale = (jnp.max(jnp.abs(x), axis=-1) / qmax).astype(jnp.bfloat16)
    divisor = scale.astype(jnp.float32)
    y = x / jnp.where(divisor > 0, divisor, 1.0)[..., None]  # a zero row stays zero
    if dtype == jnp.int8:
        q = jnp.clip(jnp.round(y), -qmax, qmax).astype(dtype)
    else:
        q = jnp.clip(y, -qmax, qmax).astype(dtype)
    scale_bytes = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(scale, jnp.uint8), dtype)
    return jnp.concatenate([q, scale_bytes], axis=-1)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------

def as_int8_bits(x: jax.Array) -> jax.Array:
    """Storage bytes as int8, whatever the storage dtype (a same-width bitcast: Triton has it)."""
    return x if x.dtype == jnp.int8 else jax.lax.bitcast_convert_type(x, jnp.int8)


def bf16_bytes_to_f32(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """float32 of the bfloat16 whose low and high bytes are `lo` and `hi` (int8 or uint8 bit
    patterns). bfloat16 is the top half of a float32, so its bits shifted up 16 are that float32."""
    lo32 = lo.astype(jnp.int32) & 0xFF  # int8's sign extension undone: the byte as 0..255
    hi32 = hi.astype(jnp.int32) & 0xFF
    return jax.lax.bitcast_convert_type((hi32 << 24) | (lo32 << 16), jnp.float32)


def e4m3_bits_to_f32(bits: jax.Array) -> jax.Array:
    """float32 of float8_e4m3fn bit patterns (int8 or uint8), with integer operations only:
    Triton has no float8 conversion before sm_89, and XLA:CPU converts float8 through float16
    op by op, many times slower than this. Exact for every finite value; the NaN pattern
    (0x7F/0xFF) reads as +-480, which quantization never writes (a poisoned row is NaN
    through its scale)."""
    bits = bits.astype(jnp.int32)
    magnitude = bits & 0x7F  # exponent (4 bits, bias 7) and mantissa (3 bits)
    # Normal: shift exponent and mantissa into float32's fields, rebias by 127 - 7 = 120.
    normal = jax.lax.bitcast_convert_type((magnitude << 20) + (120 << 23), jnp.float32)
    subnormal = magnitude.astype(jnp.float32) * 2.0**-9  # exponent 0: mantissa * 2^(1 - 7 - 3)
    value = jnp.where(magnitude < 8, subnormal, normal)
    return jnp.where((bits & 0x80) != 0, -value, value)


def split_row_bits(bits: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Quantized rows of storage dtype `dtype` seen as their bytes (int8; uint8 also for
    float8) [..., H + 2] -> (values float32 [..., H], scale float32 [...])."""
    head_dim = bits.shape[-1] - SCALE_BYTES
    values = bits[..., :head_dim]
    values = values.astype(jnp.float32) if jnp.dtype(dtype) == jnp.int8 else e4m3_bits_to_f32(values)
    return values, bf16_bytes_to_f32(bits[..., head_dim], bits[..., head_dim + 1])


@jax.jit
def split_rows(stored: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Quantized rows [..., H + 2] -> (values float32 [..., H], scale float32 [...]), so that
    a kernel can apply the scale after a dot product. Read through the bytes (no float8
    arithmetic, see `e4m3_bits_to_f32`)."""
    return split_row_bits(as_int8_bits(stored), stored.dtype)


def dequantize_row_bits(bits: jax.Array, dtype) -> jax.Array:
    """`dequantize_rows` of rows seen as their bytes (see `split_row_bits`)."""
    values, scale = split_row_bits(bits, dtype)
    return values * scale[..., None]


@jax.jit
def dequantize_rows(stored: jax.Array) -> jax.Array:
    """Quantized rows [..., H + 2] -> float32 [..., H] (exact: 8 significant bits of value
    times 8 of scale fit in float32's 24)."""
    return dequantize_row_bits(as_int8_bits(stored), stored.dtype)


# --------------------------------------------------------------------------------------------
# numpy, for the float64 oracle and the tests
# --------------------------------------------------------------------------------------------

def dequantize_rows_np(stored: np.ndarray) -> np.ndarray:
    """float64 [..., H] of quantized rows [..., H + 2] (numpy, with ml_dtypes' float8)."""
    stored = np.asarray(stored)
    head_dim = values_head_dim(stored)
    scale_bytes = np.ascontiguousarray(stored[..., head_dim:]).view(np.uint8)
    scale = scale_bytes.view("<u2").view(ml_dtypes.bfloat16)[..., 0].astype(np.float64)
    return stored[..., :head_dim].astype(np.float64) * scale[..., None]


def poison_rows(stored: np.ndarray, where: np.ndarray | None = None) -> np.ndarray:
    """A copy of quantized rows `stored` [..., H + 2] with the rows where `where` (bool, the
    shape of all but the last axis; None: every row) is True made unreadable: scale bytes
    bfloat16 NaN, and the values NaN too where the storage has one (float8); int8 values get
    -128, a byte quantization never writes. Tests fill unowned cache slots so."""
    poisoned = np.array(stored, copy=True)
    if where is None:
        where = np.ones(stored.shape[:-1], bool)
    head_dim = values_head_dim(stored)
    nan_bytes = np.array([BF16_NAN_BITS], "<u2").view(np.uint8).view(stored.dtype)  # [low, high]
    poisoned[where, :head_dim] = np.array(-128 if stored.dtype == np.int8 else np.nan).astype(stored.dtype)
    poisoned[where, head_dim:] = nan_bytes
    return poisoned
