"""Checking an attention implementation against the contract of DESIGN.md section 4.

A float64 oracle written as plain loops (one sequence, one query token, one head at a time)
and a builder of ragged batches as the engine makes them, with every cache slot that no
sequence owns set to NaN, so that an implementation that reads padding shows it. Used by the
kernel tests and by benchmarks/kernel_bench.py to check a kernel on the GPU before timing it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


# --------------------------------------------------------------------------------------------
# float64 oracle: plain loops, one sequence and one query token at a time.
# --------------------------------------------------------------------------------------------

def oracle_attention(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, *, sm_scale,
                     sliding_window=None, soft_cap=None):
    q = np.asarray(q, np.float64)
    kv_pages = np.asarray(kv_pages, np.float64)
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
                w = np.exp(scores - scores.max())
                w /= w.sum()
                out[start + i, h] = w @ values[visible, kvh]
    return out


# --------------------------------------------------------------------------------------------
# Ragged batch construction.
# --------------------------------------------------------------------------------------------

@dataclass
class Case:
    q: np.ndarray
    kv_pages: np.ndarray
    kv_lens: np.ndarray
    page_table: np.ndarray
    cu_q_lens: np.ndarray
    num_seqs: np.ndarray
    num_real_tokens: int

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """The six array arguments of the attention contract, in order."""
        return self.q, self.kv_pages, self.kv_lens, self.page_table, self.cu_q_lens, self.num_seqs


def make_case(seed, seqs, *, num_q_heads, num_kv_heads, head_dim, page_size, pad_seqs=2,
              pad_tokens=3, extra_pages=3, max_pages_per_seq=None, dtype=np.float32, q_scale=1.0):
    """seqs: [(q_len, kv_len)]; kv_len includes this step's q_len tokens."""
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
    cu_q_lens = np.full(S + 1, total, np.int32)
    cu_q_lens[: len(seqs) + 1] = np.concatenate([[0], np.cumsum([q for q, _ in seqs])])
    q = rng.standard_normal((T, num_q_heads, head_dim)) * q_scale  # padding tokens get finite q
    return Case(q.astype(dtype), kv_pages.astype(dtype), kv_lens, page_table, cu_q_lens,
                np.array([len(seqs)], np.int32), total)


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


def assert_matches_oracle(out, case: Case, *, sm_scale, sliding_window=None, soft_cap=None,
                          tol: float) -> float:
    """Assert that an implementation's output `out` for `case` matches the float64 oracle
    within `tol` (relative and absolute), is finite, and is zero on padding tokens. Returns
    the largest absolute error over real tokens."""
    assert out.shape == case.q.shape and out.dtype == case.q.dtype, (out.shape, out.dtype)
    out = np.asarray(out).astype(np.float64)
    # The oracle reads the inputs exactly as the kernel got them (already rounded to dtype).
    expected = oracle_attention(
        np.asarray(case.q).astype(np.float64), np.asarray(case.kv_pages).astype(np.float64),
        case.kv_lens, case.page_table, case.cu_q_lens, case.num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap)
    n = case.num_real_tokens
    assert np.all(np.isfinite(out)), "NaN/inf in the output: padding was read"
    np.testing.assert_allclose(out[:n], expected[:n], rtol=tol, atol=tol)
    np.testing.assert_array_equal(out[n:], 0.0)  # padding tokens: zeros
    return float(np.max(np.abs(out[:n] - expected[:n]), initial=0.0))
