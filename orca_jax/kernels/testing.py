"""Checking an attention implementation against the attention contract.

The contract (`orca_jax.kernels.ragged_paged_attention`; docs/architecture.md, section
"Kernels"): queries of all scheduled tokens back to back, the paged cache with K at even and
V at odd head slots, and one AttentionMetadata; query token i of sequence s sits at cache
position `kv_lens[s] - q_len_s + i` and attends causally to positions up to its own (and,
with a sliding window W, to the last W of them); padding tokens get zeros.

Here: a float64 oracle of that contract written as plain loops (one sequence, one query
token, one head at a time) and a builder of ragged batches as the engine makes them, with
every cache slot that no sequence owns set to NaN (in an 8-bit cache, kv_quant: a NaN scale),
so that an implementation that reads padding shows it. Used by the kernel tests and by
benchmarks/kernel_bench.py to check a kernel on the GPU before timing it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from orca_jax.kernels import kv_quant
from orca_jax.kernels.metadata import AttentionMetadata


# --------------------------------------------------------------------------------------------
# float64 oracle: plain loops, one sequence and one query token at a time.
# --------------------------------------------------------------------------------------------

def cache_as_float64(kv_pages) -> np.ndarray:
    """The values a cache holds, in float64: an 8-bit cache dequantized (kv_quant), exactly."""
    kv_pages = np.asarray(kv_pages)
    if kv_quant.is_quantized(kv_pages.dtype):
        return kv_quant.dequantize_rows_np(kv_pages)
    return kv_pages.astype(np.float64)


def oracle_attention(q, kv_pages, metadata: AttentionMetadata, *, sm_scale, sliding_window=None,
                     soft_cap=None, sinks=None):
    """Attention by its definition, sequence by sequence, head by head, in float64.
    `sinks` [num_q_heads] (None: none): one more logit per head in each softmax's denominator,
    matched by no value (gpt-oss's attention sinks), neither scaled nor capped."""
    sliding_window = None if sliding_window is None else int(sliding_window)
    sinks = None if sinks is None else np.asarray(sinks, np.float64)
    kv_lens, page_table, cu_q_lens, num_seqs = (
        np.asarray(a) for a in (metadata.kv_lens, metadata.page_table, metadata.cu_q_lens, metadata.num_seqs))
    q = np.asarray(q, np.float64)
    kv_pages = cache_as_float64(kv_pages)
    T, num_q_heads, head_dim = q.shape
    _, page_size, two_kv_heads, _ = kv_pages.shape
    group = num_q_heads // (two_kv_heads // 2)
    out = np.zeros((T, num_q_heads, head_dim), np.float64)
    for s in range(int(num_seqs[0])):
        start, end = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        q_len, kv_len = end - start, int(kv_lens[s])
        # This sequence's cache, read position by position through its page table.
        keys = np.stack([kv_pages[page_table[s, p // page_size], p % page_size, 0::2] for p in range(kv_len)])
        values = np.stack([kv_pages[page_table[s, p // page_size], p % page_size, 1::2] for p in range(kv_len)])
        for i in range(q_len):
            query_pos = kv_len - q_len + i
            key_pos = np.arange(kv_len)
            visible = key_pos <= query_pos
            if sliding_window is not None:
                visible &= query_pos - key_pos < sliding_window
            for h in range(num_q_heads):
                kvh = h // group
                scores = keys[visible, kvh] @ q[start + i, h] * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                top = scores.max() if sinks is None else max(scores.max(), sinks[h])
                w = np.exp(scores - top)
                denominator = w.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
                w /= denominator
                out[start + i, h] = w @ values[visible, kvh]
    return out


# --------------------------------------------------------------------------------------------
# Ragged batch construction.
# --------------------------------------------------------------------------------------------

@dataclass
class Case:
    q: np.ndarray  # [T, num_q_heads, head_dim]
    kv_pages: np.ndarray  # [num_pages, page_size, 2 * num_kv_heads, head_dim (+ 2 if quantized)]
    metadata: AttentionMetadata  # numpy fields, as build_batch makes them
    num_real_tokens: int
    # A quantized case's cache before quantization (`dtype`, NaN where unowned); else None.
    kv_unquantized: np.ndarray | None = None


def ragged_metadata(seqs, page_table: np.ndarray, kv_lens: np.ndarray, *, page_size: int,
                    num_tokens: int) -> AttentionMetadata:
    """The metadata of sequences `seqs` [(q_len, kv_len)] scheduled back to back in a bucket
    of `num_tokens` tokens, as build_batch lays it out: each token's position and cache slot
    from its sequence's row of `page_table`; padding tokens at position 0, in page 0.
    `page_table` [S, max_pages] and `kv_lens` [S] hold every row, padding rows as the caller
    wants them; rows past len(seqs) are not read here."""
    S = page_table.shape[0]
    total = sum(q_len for q_len, _ in seqs)
    cu_q_lens = np.full(S + 1, total, np.int32)
    cu_q_lens[: len(seqs) + 1] = np.concatenate([[0], np.cumsum([q_len for q_len, _ in seqs])])
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.arange(num_tokens, dtype=np.int32) % page_size  # padding: page 0
    for s, (q_len, kv_len) in enumerate(seqs):
        tokens = slice(cu_q_lens[s], cu_q_lens[s + 1])
        pos = np.arange(kv_len - q_len, kv_len, dtype=np.int32)
        positions[tokens] = pos
        slot_mapping[tokens] = page_table[s, pos // page_size] * page_size + pos % page_size
    return AttentionMetadata(positions=positions, slot_mapping=slot_mapping, page_table=page_table,
                             kv_lens=kv_lens, cu_q_lens=cu_q_lens, num_seqs=np.array([len(seqs)], np.int32))


def make_case(seed, seqs, *, num_q_heads, num_kv_heads, head_dim, page_size, pad_seqs=2,
              pad_tokens=3, extra_pages=3, max_pages_per_seq=None, dtype=np.float32, q_scale=1.0,
              kv_dtype=None):
    """seqs: [(q_len, kv_len)]; kv_len includes this step's q_len tokens. q (and the cache,
    unless `kv_dtype` says otherwise) in `dtype`. `kv_dtype` int8 or float8_e4m3fn: the same
    draws, the cache quantized row by row (kv_quant), every unowned row poisoned (NaN scale)."""
    rng = np.random.default_rng(seed)
    S = len(seqs) + pad_seqs
    pages_needed = [-(-kv_len // page_size) for _, kv_len in seqs]
    max_pages = max_pages_per_seq or max(pages_needed + [1]) + 1
    num_pages = 1 + sum(pages_needed) + extra_pages
    free = list(rng.permutation(np.arange(1, num_pages)))
    unowned = free[sum(pages_needed):] + [0]  # never handed to a sequence

    kv_pages = np.full((num_pages, page_size, 2 * num_kv_heads, head_dim), np.nan, np.float64)
    # Padding rows: garbage lengths and page tables pointing at NaN pages.
    page_table = rng.choice(unowned, size=(S, max_pages)).astype(np.int32)
    kv_lens = rng.integers(1, max_pages * page_size + 1, size=S).astype(np.int32)
    for s, ((q_len, kv_len), n) in enumerate(zip(seqs, pages_needed)):
        assert 0 < q_len <= kv_len
        pages = [free.pop() for _ in range(n)]
        page_table[s, :n] = pages  # entries past n keep pointing at unowned (NaN) pages
        kv_lens[s] = kv_len
        for p in range(kv_len):
            kv_pages[pages[p // page_size], p % page_size] = rng.standard_normal((2 * num_kv_heads, head_dim))

    total = sum(q_len for q_len, _ in seqs)
    T = total + pad_tokens
    q = rng.standard_normal((T, num_q_heads, head_dim)) * q_scale  # padding tokens get finite q
    metadata = ragged_metadata(seqs, page_table, kv_lens, page_size=page_size, num_tokens=T)
    if kv_dtype is not None and kv_quant.is_quantized(kv_dtype):
        return Case(q.astype(dtype), quantized_cache(kv_pages.astype(dtype), kv_dtype), metadata, total,
                    kv_unquantized=kv_pages.astype(dtype))
    return Case(q.astype(dtype), kv_pages.astype(kv_dtype or dtype), metadata, total)


def quantized_cache(kv_pages: np.ndarray, kv_dtype) -> np.ndarray:
    """A float cache [..., head_dim] with NaN rows where nothing is written, as an 8-bit cache
    [..., head_dim + 2]: written rows quantized, NaN rows poisoned (NaN scale bytes)."""
    unowned = np.isnan(kv_pages).any(axis=-1)
    stored = np.asarray(kv_quant.quantize_rows(jnp.asarray(np.where(unowned[..., None], 0, kv_pages)), kv_dtype))
    return kv_quant.poison_rows(stored, unowned)


# (name, seqs) with seqs = [(q_len, kv_len), ...]
MIXES = {
    "decode": [(1, 37), (1, 1), (1, 128), (1, 129), (1, 300), (1, 16)],
    "prefill": [(23, 23), (1, 1), (64, 64), (130, 130)],
    "mixed": [(1, 200), (17, 17), (1, 9), (40, 40), (1, 64)],
    "chunked": [(16, 160), (5, 133), (1, 50), (32, 32), (7, 7 + 128)],
}


# The sweep every implementation is checked on:
# (gqa ratio, num_kv_heads, head_dim, page_size, mix, sliding window, soft cap)
CONFIGS = [
    (1, 2, 64, 16, "decode", None, None),
    (3, 2, 64, 8, "prefill", None, None),
    (4, 2, 128, 32, "mixed", None, None),
    (8, 1, 64, 16, "chunked", None, None),
    (1, 4, 128, 8, "mixed", 24, None),
    (4, 1, 64, 32, "chunked", 100, None),
    (3, 1, 128, 16, "decode", None, 5.0),
    (8, 1, 128, 8, "prefill", 7, 10.0),
    (4, 2, 64, 16, "mixed", 1, 3.0),
    (1, 1, 64, 32, "prefill", 1000, 30.0),
]


def all_padding_metadata(num_tokens: int, num_seq_slots: int, page_size: int) -> AttentionMetadata:
    """A warm-up batch's metadata: num_seqs = 0, every token padding (position 0, page 0)."""
    return AttentionMetadata(
        positions=np.zeros(num_tokens, np.int32),
        slot_mapping=np.arange(num_tokens, dtype=np.int32) % page_size,
        page_table=np.zeros((num_seq_slots, 2), np.int32), kv_lens=np.zeros(num_seq_slots, np.int32),
        cu_q_lens=np.zeros(num_seq_slots + 1, np.int32), num_seqs=np.zeros(1, np.int32))


def all_padding_inputs(num_tokens: int = 8, num_seq_slots: int = 4, num_heads: int = 4, head_dim: int = 64,
                       page_size: int = 16):
    """(q, kv_pages, metadata) of a warm-up batch: every token padding and every cache slot
    NaN (2 KV heads), so an implementation that reads any slot shows NaN."""
    q = np.random.default_rng(0).standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    kv_pages = np.full((3, page_size, 4, head_dim), np.nan, np.float32)
    return q, kv_pages, all_padding_metadata(num_tokens, num_seq_slots, page_size)


def build_batch_padding_case() -> Case:
    """Padding as build_batch writes it: rows past num_seqs have kv_len 0 and page 0 only,
    cu_q_lens repeats the total; page-table tails of real rows point at page 0 (NaN)."""
    case = make_case(3, [(1, 20), (12, 12), (4, 44)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                     page_size=8, pad_seqs=5, pad_tokens=9, max_pages_per_seq=8)
    page_table = case.metadata.page_table
    for s, n in enumerate([3, 2, 6]):
        page_table[s, n:] = 0
    page_table[3:] = 0
    case.metadata.kv_lens[3:] = 0
    return case


def random_mix(rng: np.random.Generator, num_seqs: int, *, max_q_len: int = 48, max_context: int = 200,
               decode_share: float = 0.5) -> list[tuple[int, int]]:
    """A random ragged step: [(q_len, kv_len)], about `decode_share` of them decodes, the rest
    prefill chunks, some continuing a cached prefix."""
    seqs = []
    for _ in range(num_seqs):
        q_len = 1 if rng.random() < decode_share else int(rng.integers(2, max_q_len + 1))
        cached = int(rng.integers(0, max_context)) if rng.random() < 0.7 else 0
        seqs.append((q_len, q_len + cached))
    return seqs


def assert_matches_oracle(out, case: Case, *, sm_scale, sliding_window=None, soft_cap=None, sinks=None,
                          tol: float) -> float:
    """Assert that an implementation's output `out` for `case` matches the float64 oracle
    within `tol` (relative and absolute), is finite, and is zero on padding tokens. Returns
    the largest absolute error over real tokens."""
    assert out.shape == case.q.shape and out.dtype == case.q.dtype, (out.shape, out.dtype)
    out = np.asarray(out).astype(np.float64)
    # The oracle reads the inputs exactly as the kernel got them (already rounded to dtype, an
    # 8-bit cache as the values it stands for).
    expected = oracle_attention(
        np.asarray(case.q).astype(np.float64), cache_as_float64(case.kv_pages), case.metadata,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    n = case.num_real_tokens
    assert np.all(np.isfinite(out)), "NaN/inf in the output: padding was read"
    np.testing.assert_allclose(out[:n], expected[:n], rtol=tol, atol=tol)
    np.testing.assert_array_equal(out[n:], 0.0)  # padding tokens: zeros
    return float(np.max(np.abs(out[:n] - expected[:n]), initial=0.0))
