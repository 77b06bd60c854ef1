"""The 8-bit KV cache (orca_jax/kernels/kv_quant.py): its storage format, `write_kv` into it,
and every attention implementation reading it.

Round trip, for one row x [H] with amax = max|x|, stored scale s = bf16(amax / QMAX) and
y = x / s (the quotient the quantizer rounds). bfloat16 rounds to nearest with a relative
error of at most 2^-9, so s >= (amax / QMAX)(1 - 2^-9) and |y| <= QMAX / (1 - 2^-9).
  int8 (QMAX 127): |y| < 127.25; rounding to nearest moves y by at most 1/2 and clipping a
    rounded 128 back to 127 by at most 0.75 - 0.5 less than that, so |x - q s| <= s / 2.
  fp8 e4m3 (QMAX 448, 3 mantissa bits): a normal y rounds with relative error <= 2^-4, a
    subnormal one (|y| < 2^-6, spacing 2^-9) with absolute error <= 2^-10; clipping
    |y| <= 448.9 to 448 is a relative change below 2^-9. So |x - q s| <= 2^-4 |x| + 2^-10 s.
Both bounds get a slack of 2^-20 s for the float32 rounding of x / s. Dequantizing is exact
(8 significant bits of value times 8 of scale fit in float32's 24), so the jnp and numpy
dequantizers agree bit for bit.

Attention on an 8-bit cache: every implementation, on ragged mixes (decodes, a prefill, a
chunked prefill over a cached prefix; GQA; sliding window and soft cap; every unowned cache
row poisoned with a NaN scale, float8 values NaN too), against the float64 oracle of the
*dequantized* cache. That comparison is of kernel arithmetic only, so the float32 tolerance
of the float tests holds: rtol 1e-5, atol 1e-5 (bfloat16 queries: 2e-2, P is rounded to
bfloat16 before P @ V). Against the oracle on the float K/V before quantization the error is
quantization error, bounded per case (`quantization_error_bound`, proven there): measured
4.2e-2 for int8 (queries scaled by 3) and 9.1e-2 for fp8, against bounds of 0.72 and 1.04
(the bound takes the worst query-key pair and the largest V everywhere).

Cases are few and small: each (implementation, cache dtype) compiles once (about 7 s on two
cores), and outputs are computed once per session and shared by the two comparisons.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from orca_jax.kernels import kv_quant, ragged_paged_attention, write_kv
from orca_jax.kernels import ragged_paged_attention_tpu as tpu
from orca_jax.kernels.testing import all_padding_metadata, assert_matches_oracle, make_case, oracle_attention

STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}
SLACK = 2.0**-20  # times the scale: float32 rounding of x / s


def sample_rows(seed: int, head_dim: int) -> np.ndarray:
    """float32 rows [R, head_dim] of many kinds: normal at magnitudes 1e-6 .. 1e4, one outlier,
    constant, one-hot, all negative, tiny (near float32's normal limit) and zero."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal((7, 4, head_dim)) * (10.0 ** np.arange(-6, 8, 2))[:, None, None]
    outlier = rng.standard_normal((4, head_dim))
    outlier[:, 3] = 300.0
    special = np.stack([np.full(head_dim, 0.75), np.eye(head_dim)[5] * -2.5, -np.abs(rng.standard_normal(head_dim)),
                        rng.standard_normal(head_dim) * 1e-30, np.zeros(head_dim)])
    return np.concatenate([normal.reshape(-1, head_dim), outlier, special]).astype(np.float32)


def stored_scale(stored: np.ndarray) -> np.ndarray:
    """float64 of each row's scale, read from its bytes with numpy (independent of kv_quant)."""
    head_dim = stored.shape[-1] - 2
    raw = np.ascontiguousarray(stored[..., head_dim:]).view(np.uint8).view("<u2")[..., 0]
    return raw.view(ml_dtypes.bfloat16).astype(np.float64)


# --------------------------------------------------------------------------------------------
# The storage format
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", STORAGE)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_round_trip_bound(name, head_dim):
    x = sample_rows(1, head_dim)
    stored = np.asarray(kv_quant.quantize_rows(jnp.asarray(x), STORAGE[name]))
    assert stored.shape == (x.shape[0], head_dim + 2) and stored.dtype == STORAGE[name]
    scale = stored_scale(stored)[:, None]
    error = np.abs(kv_quant.dequantize_rows_np(stored) - x.astype(np.float64))
    if name == "int8":
        bound = scale * (0.5 + SLACK)
    else:
        bound = 2.0**-4 * np.abs(x) + scale * (2.0**-10 + SLACK)
    assert np.all(error <= bound), np.max(error - bound)
    print(f"{name} d{head_dim}: max error / scale {np.max(error / np.where(scale > 0, scale, 1)):.3f}")


@pytest.mark.parametrize("name", STORAGE)
def test_scale_bytes_are_the_bfloat16_of_amax_over_qmax(name):
    """Bytes [head_dim:] are bf16(amax / QMAX) in the byte order of lax.bitcast_convert_type
    (low byte first), reinterpreted as the storage dtype; split_rows reads the same scale."""
    x = sample_rows(2, 64)
    stored = kv_quant.quantize_rows(jnp.asarray(x), STORAGE[name])
    amax = np.max(np.abs(x), axis=-1)
    expected = (amax / np.float32(QMAX[name])).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(stored[:, 64:]).view(np.uint8),
                                  np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(expected), jnp.uint8)))
    np.testing.assert_array_equal(expected.view(np.uint16), np.asarray(stored[:, 64:]).view("<u2")[:, 0])
    values, scale = kv_quant.split_rows(stored)
    np.testing.assert_array_equal(np.asarray(scale), expected.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(stored[:, :64]).astype(np.float32))


@pytest.mark.parametrize("name", STORAGE)
def test_values_follow_the_contract_exactly(name):
    """quantize_rows against the contract written in numpy: q = x / s against the stored s,
    int8 rounded to nearest (ties to even) and clipped to 127, float8 clipped to 448 and cast."""
    x = sample_rows(3, 64)
    stored = np.asarray(kv_quant.quantize_rows(jnp.asarray(x), STORAGE[name]))
    scale = stored_scale(stored).astype(np.float32)[:, None]
    y = x / np.where(scale > 0, scale, np.float32(1))
    if name == "int8":
        expected = np.clip(np.rint(y), -127, 127).astype(np.int8)
    else:
        expected = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(stored[:, :64].view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("name", STORAGE)
def test_zero_rows_have_scale_zero_and_no_nan(name):
    stored = kv_quant.quantize_rows(jnp.zeros((3, 2, 64)), STORAGE[name])
    np.testing.assert_array_equal(np.asarray(stored).view(np.uint8), 0)
    np.testing.assert_array_equal(np.asarray(kv_quant.dequantize_rows(stored)), 0.0)


@pytest.mark.parametrize("name", STORAGE)
def test_dequantizers_agree_bit_for_bit(name):
    stored = kv_quant.quantize_rows(jnp.asarray(sample_rows(4, 128)), STORAGE[name])
    np.testing.assert_array_equal(np.asarray(kv_quant.dequantize_rows(stored)).astype(np.float64),
                                  kv_quant.dequantize_rows_np(np.asarray(stored)))


def test_bit_decoders_are_exact():
    """The integer-only decoders (what the Triton kernel uses) against ml_dtypes: every
    bfloat16 pattern (NaN stays NaN), every finite float8_e4m3fn pattern."""
    bits = np.arange(1 << 16, dtype=np.uint32)
    low, high = (bits & 0xFF).astype(np.uint8).view(np.int8), (bits >> 8).astype(np.uint8).view(np.int8)
    decoded = np.asarray(jax.jit(kv_quant.bf16_bytes_to_f32)(low, high))
    np.testing.assert_array_equal(decoded.view(np.uint32), bits << 16)

    byte = np.arange(256, dtype=np.uint8)
    expected = byte.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = ~np.isnan(expected)
    decoded = np.asarray(jax.jit(kv_quant.e4m3_bits_to_f32)(byte.view(np.int8)))
    np.testing.assert_array_equal(decoded[finite].view(np.uint32), expected[finite].view(np.uint32))  # signed zeros too


@pytest.mark.parametrize("name", STORAGE)
def test_poisoned_rows_read_as_nan(name):
    stored = np.asarray(kv_quant.quantize_rows(jnp.ones((4, 3, 64)), STORAGE[name]))
    where = np.zeros((4, 3), bool)
    where[1, 2] = where[3, 0] = True
    poisoned = kv_quant.poison_rows(stored, where)
    np.testing.assert_array_equal(poisoned[where][:, 64:].view("<u2")[:, 0], kv_quant.BF16_NAN_BITS)
    clean = kv_quant.dequantize_rows_np(stored)
    for dequantize in (kv_quant.dequantize_rows_np, lambda a: np.asarray(kv_quant.dequantize_rows(jnp.asarray(a)))):
        values = dequantize(poisoned)
        assert np.all(np.isnan(values[where]))
        np.testing.assert_array_equal(values[~where], clean[~where])
    np.testing.assert_array_equal(stored.view(np.uint8), np.asarray(kv_quant.quantize_rows(
        jnp.ones((4, 3, 64)), STORAGE[name])).view(np.uint8))  # the input is left alone


def test_row_widths_and_pool_capacity():
    """head_dim + 2 bytes per row: 128 / 66 = 1.94x bfloat16's tokens at head_dim 64, 256 / 130
    = 1.97x at 128; float caches keep head_dim."""
    from orca_jax.config import ModelConfig
    from orca_jax.core.kv_cache import create_kv_cache, kv_bytes_per_page

    assert kv_quant.KV_CACHE_DTYPES == {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn}
    for dtype in kv_quant.KV_CACHE_DTYPES.values():
        assert kv_quant.is_quantized(dtype)
        assert kv_quant.cache_head_dim(64, dtype) == 66
        assert kv_quant.values_head_dim(jax.ShapeDtypeStruct((2, 8, 4, 130), dtype)) == 128
    for dtype in (jnp.float32, jnp.bfloat16):
        assert not kv_quant.is_quantized(dtype) and kv_quant.cache_head_dim(64, dtype) == 64
        assert kv_quant.values_head_dim(jax.ShapeDtypeStruct((2, 8, 4, 64), dtype)) == 64

    for head_dim, ratio in ((64, 1.94), (128, 1.97)):
        model = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=head_dim, max_position_embeddings=4096)
        int8_page = kv_bytes_per_page(model, 8, jnp.int8)
        assert int8_page == 2 * 8 * 2 * 2 * (head_dim + 2)
        assert round(kv_bytes_per_page(model, 8, jnp.bfloat16) / int8_page, 2) == ratio
        assert kv_bytes_per_page(model, 8, jnp.float8_e4m3fn) == int8_page
    cache = create_kv_cache(model, num_pages=3, page_size=8, dtype=jnp.float8_e4m3fn)
    assert cache.shape == (2, 3, 8, 4, 130) and cache.nbytes == 3 * int8_page
    np.testing.assert_array_equal(np.asarray(kv_quant.dequantize_rows(cache)), 0.0)  # zeros: empty rows


@pytest.mark.parametrize("name", STORAGE)
def test_write_kv_puts_quantized_rows_at_the_slots_and_nothing_else(name):
    rng = np.random.default_rng(5)
    num_pages, ps, kvh, D = 6, 8, 2, 64
    n_real, n_pad = 13, 11  # more padding tokens than a page: they collide inside page 0
    T = n_real + n_pad
    # Arbitrary bytes everywhere (NaN patterns included for float8): untouched ones must stay.
    kv_pages = rng.integers(0, 256, (num_pages, ps, 2 * kvh, D + 2), dtype=np.uint8).view(STORAGE[name])
    k = (rng.standard_normal((T, kvh, D)) * rng.uniform(0.01, 10, (T, kvh, 1))).astype(np.float32)
    v = rng.standard_normal((T, kvh, D)).astype(np.float32)
    k[2, 1] = 0.0  # a zero row among them
    real_slots = rng.choice(np.arange(ps, num_pages * ps), size=n_real, replace=False)
    slot_mapping = np.concatenate([real_slots, np.arange(n_pad) % ps]).astype(np.int32)  # padding: page 0
    metadata = dataclasses.replace(all_padding_metadata(T, 1, ps), slot_mapping=slot_mapping)

    new = np.asarray(jax.jit(write_kv)(jnp.asarray(kv_pages), k, v, metadata))
    assert new.shape == kv_pages.shape and new.dtype == kv_pages.dtype

    k_rows = np.asarray(kv_quant.quantize_rows(jnp.asarray(k), STORAGE[name]))
    v_rows = np.asarray(kv_quant.quantize_rows(jnp.asarray(v), STORAGE[name]))
    expected = kv_pages.copy()
    for t, slot in enumerate(real_slots):
        page, offset = divmod(int(slot), ps)
        expected[page, offset, 0::2] = k_rows[t]
        expected[page, offset, 1::2] = v_rows[t]
    # Bytes compared (float8 NaN != NaN): every page but the padding sink exactly as expected.
    np.testing.assert_array_equal(new[1:].view(np.uint8), expected[1:].view(np.uint8))


# --------------------------------------------------------------------------------------------
# Attention on an 8-bit cache
# --------------------------------------------------------------------------------------------

MIX = [(1, 70), (12, 12), (1, 1), (5, 45), (1, 33)]  # decodes, a prefill, a chunk over a prefix
# name: (cache dtype, query dtype, num_q_heads, num_kv_heads, page_size, sliding window, soft cap)
CASES = {
    "int8-gqa4-window-cap": ("int8", np.float32, 8, 2, 16, 24, 5.0),
    "fp8-gqa3": ("fp8", np.float32, 6, 2, 8, None, None),
    "int8-bf16q-gqa4": ("int8", jnp.bfloat16, 4, 1, 16, None, None),
}
IMPLS = ("reference", "cpu", "pallas_gpu")  # pallas_gpu: Pallas' interpreter off a GPU
TIGHT = {np.dtype(np.float32): 1e-5, np.dtype(jnp.bfloat16): 2e-2}
HEAD_DIM = 64
SM_SCALE = 1 / math.sqrt(HEAD_DIM)


@functools.lru_cache(maxsize=None)
def quantized_case(name: str):
    kv_name, q_dtype, num_q_heads, num_kv_heads, page_size, _, cap = CASES[name]
    return make_case(60, MIX, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM,
                     page_size=page_size, dtype=q_dtype, kv_dtype=STORAGE[kv_name], q_scale=3.0 if cap else 1.0)


@functools.lru_cache(maxsize=None)
def attention_output(impl: str, name: str) -> np.ndarray:
    case, (_, _, _, _, _, window, cap) = quantized_case(name), CASES[name]
    return np.asarray(ragged_paged_attention(case.q, case.kv_pages, case.metadata, sm_scale=SM_SCALE,
                                             sliding_window=window, soft_cap=cap, impl=impl))


def quantization_error_bound(case) -> float:
    """A bound on |attention(dequantized cache) - attention(float cache)| for this case.

    Each output is sum_j p_j v_j over the visible keys. With dequantized V' = V + dV and
    scores s' = s + ds, where |ds_j| <= D := max over queries and keys of sm_scale |q . dK|
    (the soft cap is 1-Lipschitz, so it does not enlarge D):
      |sum p'_j v'_j - sum p_j v_j| <= sum p'_j |dv_j| + |sum (p'_j - p_j) v_j|
                                     <= max|dV| + (e^(2D) - 1) max|V|,
    since each p'_j / p_j lies in [e^-2D, e^2D] (numerator and normaliser each move by at
    most e^D), so sum |p'_j - p_j| <= e^(2D) - 1. Maxima over every written row."""
    written = ~np.isnan(case.kv_unquantized).any(axis=-1)  # [pages, page_size, 2K]
    exact = np.where(written[..., None], case.kv_unquantized, 0).astype(np.float64)
    error = np.where(written[..., None], kv_quant.dequantize_rows_np(case.kv_pages), 0) - exact
    num_kv_heads = exact.shape[2] // 2
    q = np.asarray(case.q, np.float64).reshape(case.q.shape[0], num_kv_heads, -1, HEAD_DIM)
    dk = error[:, :, 0::2].reshape(-1, num_kv_heads, HEAD_DIM)
    d = SM_SCALE * np.max(np.abs(np.einsum("tkgd,skd->tkgs", q[:case.num_real_tokens], dk)))
    v, dv = exact[:, :, 1::2], error[:, :, 1::2]
    return float(np.max(np.abs(dv)) + math.expm1(2 * d) * np.max(np.abs(v)))


def runs(name: str) -> tuple[str, ...]:
    """Implementations a case runs on: float32 queries on all; bfloat16 queries only on the
    GPU kernel, the one whose arithmetic changes with them (it rounds P to bfloat16 for P @ V
    after the V scale is applied; the others compute in float32 whatever the query dtype)."""
    return IMPLS if CASES[name][1] == np.float32 else ("pallas_gpu",)


@pytest.mark.parametrize("impl,name", [(impl, name) for name in CASES for impl in runs(name)])
def test_matches_the_oracle_of_the_dequantized_cache(impl, name):
    case, (_, _, _, _, _, window, cap) = quantized_case(name), CASES[name]
    err = assert_matches_oracle(jnp.asarray(attention_output(impl, name)), case, sm_scale=SM_SCALE,
                                sliding_window=window, soft_cap=cap, tol=TIGHT[np.dtype(case.q.dtype)])
    print(f"{impl} {name}: max abs err {err:.2e}")


@pytest.mark.parametrize("name", [name for name in CASES if CASES[name][1] == np.float32])
def test_quantization_error_against_the_float_cache_is_bounded(name):
    """The same outputs against the oracle of the float K/V they were quantized from: within
    the proven bound (plus the tight tolerance of kernel arithmetic)."""
    case, (_, _, _, _, _, window, cap) = quantized_case(name), CASES[name]
    bound = quantization_error_bound(case) + TIGHT[np.dtype(case.q.dtype)]
    expected = oracle_attention(case.q, case.kv_unquantized, case.metadata, sm_scale=SM_SCALE,
                                sliding_window=window, soft_cap=cap)[:case.num_real_tokens]
    for impl in IMPLS:
        err = np.max(np.abs(attention_output(impl, name)[:case.num_real_tokens] - expected))
        assert err <= bound, (impl, err, bound)
        print(f"{impl} {name}: quantization error {err:.3e}, bound {bound:.3e}")


def test_tpu_kernel_hands_8bit_caches_to_the_reference():
    """jax's TPU kernel cannot read per-row scales: it says so for both storage dtypes, and the
    dispatcher runs the reference instead (the same numbers)."""
    for dtype in STORAGE.values():
        reason = tpu.unsupported_reason(8, 2, 128, jnp.bfloat16, dtype)
        assert reason is not None and "scale per token and head" in reason
    name = "fp8-gqa3"
    case = quantized_case(name)
    out = ragged_paged_attention(case.q, case.kv_pages, case.metadata, sm_scale=SM_SCALE, impl="pallas_tpu")
    np.testing.assert_array_equal(np.asarray(out), attention_output("reference", name))
