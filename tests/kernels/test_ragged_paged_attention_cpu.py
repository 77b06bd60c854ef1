"""The CPU ragged paged attention against the float64 oracle of `kernels/testing.py`.

Cases as the reference's tests build them: ragged mixes of decodes, prefills and chunked
prefills after a cached prefix, GQA ratios, page sizes, sliding windows and soft caps,
padding sequence rows past `num_seqs` (garbage kv_lens, page tables at unowned pages) and
padding tokens, with NaN in every cache slot no sequence owns. Each mix runs twice: with the
default block sizes, and with blocks of one page (and query blocks of 8 tokens), so that every
loop crosses many block boundaries.

Tolerances (against the oracle computed from the inputs as the kernel sees them):
  float32 inputs   rtol 1e-5, atol 1e-5
  bfloat16 inputs  rtol 2e-2, atol 2e-2 (the output is rounded to bfloat16: ~4e-3 relative)
  float64 inputs   rtol 1e-12, atol 1e-12 (jax x64 enabled)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.kernels import ragged_paged_attention_cpu as cpu
from orca_jax.kernels.testing import (CONFIGS, MIXES, all_padding_inputs, assert_matches_oracle,
                                     build_batch_padding_case, make_case, random_mix)

TOLERANCES = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3, "float64": 1e-12}


def small_blocks(page_size: int) -> dict:
    return dict(decode_block_tokens=page_size, q_block=8, kv_block_tokens=page_size)


def run_and_compare(case, *, sm_scale, sliding_window=None, soft_cap=None, tol, **blocks):
    out = cpu.ragged_paged_attention(case.q, case.kv_pages, case.metadata, sm_scale=sm_scale,
                                     sliding_window=sliding_window, soft_cap=soft_cap, **blocks)
    return assert_matches_oracle(out, case, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                 tol=tol)


@pytest.mark.parametrize("blocks", ["default", "one_page"])
@pytest.mark.parametrize("seed,ratio,num_kv_heads,head_dim,page_size,mix,window,cap",
                         [(i, *c) for i, c in enumerate(CONFIGS)],
                         ids=[f"gqa{c[0]}-d{c[2]}-ps{c[3]}-{c[4]}-w{c[5]}-cap{c[6]}" for c in CONFIGS])
def test_float32_matches_oracle(seed, ratio, num_kv_heads, head_dim, page_size, mix, window, cap, blocks):
    case = make_case(100 + seed, MIXES[mix], num_q_heads=ratio * num_kv_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=page_size, q_scale=3.0 if cap else 1.0)
    run_and_compare(case, sm_scale=1 / math.sqrt(head_dim), sliding_window=window, soft_cap=cap,
                    tol=TOLERANCES["float32"], **(small_blocks(page_size) if blocks == "one_page" else {}))


@pytest.mark.parametrize("mix,window,cap,blocks", [("mixed", None, None, "default"), ("chunked", 50, 20.0, "one_page"),
                                                    ("decode", None, 5.0, "one_page")])
def test_bfloat16_matches_oracle(mix, window, cap, blocks):
    """A bfloat16 cache is read through its uint16 bits (see the module docstring): the
    widening must give exactly the bfloat16 values, NaN slots must stay masked."""
    case = make_case(7, MIXES[mix], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=jnp.bfloat16)
    run_and_compare(case, sm_scale=0.125, sliding_window=window, soft_cap=cap, tol=TOLERANCES["bfloat16"],
                    **(small_blocks(16) if blocks == "one_page" else {}))


@pytest.mark.parametrize("mix,window,cap", [("mixed", None, None), ("chunked", 50, 20.0)])
def test_float16_matches_oracle(mix, window, cap):
    """dtype="float16" (T4 / V100 class GPUs, and --dtype half): a float16 cache read as it is."""
    case = make_case(8, MIXES[mix], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float16)
    run_and_compare(case, sm_scale=0.125, sliding_window=window, soft_cap=cap, tol=TOLERANCES["float16"])


@pytest.mark.parametrize("window,cap", [(None, None), (33, 4.0)])
def test_float64_matches_oracle_with_x64(window, cap):
    with jax.enable_x64(True):
        case = make_case(11, MIXES["mixed"] + [(3, 140)], num_q_heads=6, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=np.float64)
        run_and_compare(case, sm_scale=0.125, sliding_window=window, soft_cap=cap, tol=TOLERANCES["float64"],
                        **small_blocks(16))


@pytest.mark.parametrize("window", [10, 128, 129])
def test_sliding_window_edges_at_block_boundaries(window):
    """Windows whose first visible key is the last slot of a 128-token block (pos 127) or the
    first of the next (pos 128): a loop that starts one block late, or a mask off by one, drops
    or adds exactly one key. Decode rows and prefill chunks both."""
    seqs = [(1, 137), (4, 140), (1, 129), (3, 131), (1, 138), (2, 257)]
    case = make_case(21, seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    run_and_compare(case, sm_scale=0.125, sliding_window=window, tol=TOLERANCES["float32"],
                    decode_block_tokens=128, q_block=8, kv_block_tokens=128)


def test_long_contexts_span_several_default_blocks():
    """SmolLM2's heads (9 query, 3 KV, head_dim 64): decodes and a chunk after a long cached
    prefix, many default blocks long."""
    seqs = [(1, 2100), (5, 1100)]
    case = make_case(4, seqs, num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=16, pad_seqs=0)
    assert cpu.default_decode_block_tokens(case.metadata.page_table.shape[0], 16) < 2100
    run_and_compare(case, sm_scale=0.125, tol=TOLERANCES["float32"])


@pytest.mark.parametrize("seed", [0, 1])
def test_random_ragged_steps_match_oracle(seed):
    rng = np.random.default_rng(seed)
    seqs = random_mix(rng, 9, max_q_len=40, max_context=400)
    case = make_case(30 + seed, seqs, num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=8, pad_seqs=3)
    run_and_compare(case, sm_scale=0.125, sliding_window=(None, 90)[seed], tol=TOLERANCES["float32"])


def test_padding_rows_as_build_batch_writes_them():
    """Padding as build_batch writes it: rows past num_seqs have kv_len 0 and page 0 only,
    cu_q_lens repeats the total; page-table tails of real rows point at page 0 (NaN)."""
    case = build_batch_padding_case()
    run_and_compare(case, sm_scale=0.125, tol=TOLERANCES["float32"])


def test_all_padding_batch_is_zero():
    """A warm-up batch: num_seqs = 0, every token padding, every cache slot NaN."""
    out = cpu.ragged_paged_attention(*all_padding_inputs(), sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_rows_do_not_depend_on_other_sequences():
    """One sequence's output is the same alone and in a batch with others."""
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, pad_seqs=0, pad_tokens=0)
    for rows, seqs in ((slice(0, 1), [(1, 70)]), (slice(0, 9), [(9, 70)])):
        alone = make_case(5, seqs, **kw)
        together = make_case(6, [(1, 300)] + seqs + [(30, 30), (1, 5)], **kw)
        n = rows.stop
        together.q[1:1 + n] = alone.q[:n]
        together.kv_pages[together.metadata.page_table[1, :5]] = alone.kv_pages[alone.metadata.page_table[0, :5]]
        out_alone = np.asarray(cpu.ragged_paged_attention(alone.q, alone.kv_pages, alone.metadata, sm_scale=0.125))
        out_together = np.asarray(cpu.ragged_paged_attention(together.q, together.kv_pages, together.metadata,
                                                             sm_scale=0.125))
        np.testing.assert_allclose(out_alone[rows], out_together[1:1 + n], rtol=1e-6, atol=1e-6)


def test_one_program_serves_every_step_of_a_shape():
    """Lengths, page tables, the decode/prefill split and num_seqs are data: steps of the same
    shapes reuse one compiled program (the engine compiles once per bucket)."""
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, pad_seqs=1, max_pages_per_seq=20)
    steps = [[(1, 40), (1, 300), (6, 6), (1, 2)], [(13, 13), (1, 1), (1, 1), (1, 9)],
             [(4, 200), (5, 90), (1, 64), (1, 310)]]
    cases = [make_case(40 + i, seqs, pad_tokens=20 - sum(q for q, _ in seqs), **kw) for i, seqs in enumerate(steps)]
    assert len({(c.q.shape, c.kv_pages.shape[1:], c.metadata.page_table.shape) for c in cases}) == 1
    jitted = jax.jit(lambda q, kv, m: cpu.ragged_paged_attention(q, kv, m, sm_scale=0.125))
    for case in cases:
        kv_pages = np.full((64,) + case.kv_pages.shape[1:], np.nan, np.float32)  # one pool shape for all
        kv_pages[: case.kv_pages.shape[0]] = case.kv_pages
        case.kv_pages = kv_pages
        assert_matches_oracle(jitted(case.q, case.kv_pages, case.metadata), case, sm_scale=0.125,
                              tol=TOLERANCES["float32"])
    assert jitted._cache_size() == 1


@pytest.mark.parametrize("num_seq_slots,page_size,expected", [(1, 16, 256), (32, 16, 256), (33, 16, 128),
                                                              (64, 16, 128), (512, 16, 128), (64, 48, 144)])
def test_default_decode_block_is_a_whole_number_of_pages(num_seq_slots, page_size, expected):
    block = cpu.default_decode_block_tokens(num_seq_slots, page_size)
    assert block == expected and block % page_size == 0


@pytest.mark.parametrize("q_shape,kv_shape,match", [
    ((5, 4, 64), (3, 16, 4, 32), "head_dim"),
    ((5, 4, 64), (3, 16, 3, 64), "cannot share"),
    ((5, 3, 64), (3, 16, 4, 64), "cannot share"),
    ((5, 64), (3, 16, 4, 64), "must be"),
])
def test_bad_shapes_fail_clearly(q_shape, kv_shape, match):
    case = make_case(0, [(1, 5), (4, 4)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    with pytest.raises(ValueError, match=match):
        cpu.ragged_paged_attention(np.zeros(q_shape, np.float32), np.zeros(kv_shape, np.float32), case.metadata,
                                   sm_scale=0.1)
