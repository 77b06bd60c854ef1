"""The reference ragged paged attention and `write_kv` against a float64 numpy oracle.

Every case builds a ragged batch by hand: sequences with (new query tokens, cached tokens),
pages handed out at random from 1..num_pages-1, padding sequence rows past `num_seqs` (with
garbage kv_lens and page tables pointing at unowned pages) and padding tokens past
`cu_q_lens[num_seqs]`. Every cache slot that no sequence owns (page 0, unused pages, the tail
of a partly filled page) holds NaN, so any read of padding turns a real row into NaN.

Tolerances (against the float64 oracle, computed from the inputs as the kernel sees them,
i.e. after rounding to the input dtype):
  float32 inputs   rtol 1e-5, atol 1e-5
  bfloat16 inputs  rtol 2e-2, atol 2e-2 (output is rounded to bfloat16: ~4e-3 relative)
  float16 inputs   rtol 5e-3, atol 5e-3 (output rounded to float16: ~5e-4 relative)
  float64 inputs   rtol 1e-12, atol 1e-12 (jax x64 enabled)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.kernels import ragged_paged_attention, write_kv
from orca_jax.kernels.testing import (CONFIGS, MIXES, all_padding_inputs, all_padding_metadata,
                                     assert_matches_oracle, build_batch_padding_case, make_case)

TOLERANCES = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3, "float64": 1e-12}


def run_and_compare(case, *, sm_scale, sliding_window=None, soft_cap=None, tol):
    out = ragged_paged_attention(
        case.q, case.kv_pages, case.metadata, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, impl="reference")
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    return assert_matches_oracle(out, case, sm_scale=sm_scale, sliding_window=sliding_window,
                                 soft_cap=soft_cap, tol=tol)


@pytest.mark.parametrize("seed,ratio,num_kv_heads,head_dim,page_size,mix,window,cap",
                         [(i, *c) for i, c in enumerate(CONFIGS)],
                         ids=[f"gqa{c[0]}-d{c[2]}-ps{c[3]}-{c[4]}-w{c[5]}-cap{c[6]}" for c in CONFIGS])
def test_float32_matches_oracle(seed, ratio, num_kv_heads, head_dim, page_size, mix, window, cap):
    case = make_case(100 + seed, MIXES[mix], num_q_heads=ratio * num_kv_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                     q_scale=3.0 if cap else 1.0)
    err = run_and_compare(case, sm_scale=1 / math.sqrt(head_dim), sliding_window=window, soft_cap=cap,
                          tol=TOLERANCES["float32"])
    print(f"float32 max abs err {err:.3e}")


@pytest.mark.parametrize("mix,window,cap", [("mixed", None, None), ("chunked", 50, 20.0)])
def test_bfloat16_matches_oracle(mix, window, cap):
    case = make_case(7, MIXES[mix], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                     dtype=jnp.bfloat16)
    err = run_and_compare(case, sm_scale=0.125, sliding_window=window, soft_cap=cap,
                          tol=TOLERANCES["bfloat16"])
    print(f"bfloat16 max abs err {err:.3e}")


@pytest.mark.parametrize("mix,window,cap", [("mixed", None, None), ("chunked", 50, 20.0)])
def test_float16_matches_oracle(mix, window, cap):
    """dtype="float16" (GPUs below sm_80, --dtype half): softmax in float32, output in float16."""
    case = make_case(8, MIXES[mix], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=jnp.float16)
    err = run_and_compare(case, sm_scale=0.125, sliding_window=window, soft_cap=cap, tol=TOLERANCES["float16"])
    print(f"float16 max abs err {err:.3e}")


@pytest.mark.parametrize("window,cap", [(None, None), (33, 4.0)])
def test_float64_matches_oracle_with_x64(window, cap):
    with jax.enable_x64(True):
        case = make_case(11, MIXES["mixed"] + [(3, 140)], num_q_heads=6, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=np.float64)
        err = run_and_compare(case, sm_scale=0.125, sliding_window=window, soft_cap=cap,
                              tol=TOLERANCES["float64"])
    print(f"float64 max abs err {err:.3e}")


@pytest.mark.parametrize("window", [10, 128, 129])
def test_sliding_window_edges_at_kv_block_boundaries(window):
    """Windows whose first visible key is the last slot of a 128-token KV block (pos 127) or
    the first of the next (pos 128): a loop that starts one block late, or a mask off by one,
    drops or adds exactly one key. Decode rows and prefill chunks both."""
    seqs = [(1, 137), (4, 140), (1, 129), (3, 131), (1, 138), (2, 257)]
    case = make_case(21, seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    run_and_compare(case, sm_scale=0.125, sliding_window=window, tol=TOLERANCES["float32"])


def test_padding_rows_as_build_batch_writes_them():
    """Padding as build_batch writes it (tests/worker/test_batch.py checks that the case builder lays
    out metadata as build_batch does): rows past num_seqs have kv_len 0, page 0 only, and
    cu_q_lens repeats the total; page-table tails of real rows point at page 0 (NaN)."""
    case = build_batch_padding_case()
    run_and_compare(case, sm_scale=0.125, tol=TOLERANCES["float32"])


def test_all_padding_batch_is_zero():
    """A warm-up batch: num_seqs = 0, every token is padding, every cache slot NaN."""
    out = ragged_paged_attention(*all_padding_inputs(), sm_scale=0.125, impl="reference")
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_rows_do_not_depend_on_other_sequences():
    """One sequence's output is the same alone and in a batch with others (bitwise)."""
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, pad_seqs=0, pad_tokens=0)
    alone = make_case(5, [(9, 70)], **kw)
    together = make_case(6, [(1, 300), (9, 70), (30, 30)], **kw)
    # Copy the lone sequence's data into row 1 of the batch.
    together.q[1:10] = alone.q[:9]
    pages = together.metadata.page_table[1, :5]
    together.kv_pages[pages] = alone.kv_pages[alone.metadata.page_table[0, :5]]
    outs = []
    for c, rows in ((alone, slice(0, 9)), (together, slice(1, 10))):
        o = ragged_paged_attention(c.q, c.kv_pages, c.metadata, sm_scale=0.125, impl="reference")
        outs.append(np.asarray(o)[rows])
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_write_kv_slots_and_padding(dtype):
    rng = np.random.default_rng(1)
    num_pages, ps, kvh, D = 6, 8, 2, 64
    n_real, n_pad = 13, 11  # more padding tokens than a page: they collide inside page 0
    T = n_real + n_pad
    kv_pages = rng.standard_normal((num_pages, ps, 2 * kvh, D)).astype(dtype)
    k = rng.standard_normal((T, kvh, D)).astype(np.float32)
    v = rng.standard_normal((T, kvh, D)).astype(np.float32)
    real_slots = rng.choice(np.arange(ps, num_pages * ps), size=n_real, replace=False)
    pad_slots = np.arange(n_pad) % ps  # page 0, as build_batch does
    slot_mapping = np.concatenate([real_slots, pad_slots]).astype(np.int32)
    metadata = dataclasses.replace(all_padding_metadata(T, 1, ps), slot_mapping=slot_mapping)

    new = np.asarray(jax.jit(write_kv)(jnp.asarray(kv_pages), k, v, metadata))
    assert new.shape == kv_pages.shape and new.dtype == kv_pages.dtype

    expected = np.asarray(kv_pages).copy()
    for t, slot in enumerate(real_slots):
        page, off = divmod(int(slot), ps)
        expected[page, off, 0::2] = k[t].astype(dtype)
        expected[page, off, 1::2] = v[t].astype(dtype)
    # Every page except the padding sink is exactly as expected: K at even, V at odd slots,
    # nothing else touched.
    np.testing.assert_array_equal(new[1:], expected[1:])
    for t, slot in enumerate(real_slots):
        page, off = divmod(int(slot), ps)
        for h in range(kvh):
            np.testing.assert_array_equal(new[page, off, 2 * h], k[t, h].astype(dtype))
            np.testing.assert_array_equal(new[page, off, 2 * h + 1], v[t, h].astype(dtype))


def test_write_kv_then_attention_matches_oracle():
    """Fill the cache of a chunked-prefill batch through write_kv and attend to it."""
    rng = np.random.default_rng(2)
    H, KVH, D, ps = 4, 2, 64, 16
    case = make_case(9, [(10, 40), (1, 17), (6, 6)], num_q_heads=H, num_kv_heads=KVH, head_dim=D,
                     page_size=ps)
    # Rewrite this step's K/V (the last q_len positions of each sequence) with write_kv.
    T = case.q.shape[0]
    k = rng.standard_normal((T, KVH, D)).astype(np.float32)
    v = rng.standard_normal((T, KVH, D)).astype(np.float32)
    m = case.metadata
    slots = np.arange(T, dtype=np.int32) % ps  # padding tokens -> page 0
    positions = np.zeros(T, np.int32)
    for s in range(int(m.num_seqs[0])):
        start, end = m.cu_q_lens[s], m.cu_q_lens[s + 1]
        for t in range(start, end):
            pos = m.kv_lens[s] - (end - start) + (t - start)
            slots[t] = m.page_table[s, pos // ps] * ps + pos % ps
            positions[t] = pos
    # The case's metadata says the same, token by token, as build_batch would.
    np.testing.assert_array_equal(m.slot_mapping, slots)
    np.testing.assert_array_equal(m.positions, positions)
    case.kv_pages = np.asarray(write_kv(jnp.asarray(case.kv_pages), k, v, m))
    run_and_compare(case, sm_scale=0.125, tol=TOLERANCES["float32"])
