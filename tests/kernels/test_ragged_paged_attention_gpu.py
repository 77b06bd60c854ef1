"""The Pallas GPU kernel, run in Pallas' interpreter on CPU, against the float64 oracle.

Batches are built as the engine builds them (orca_jax.kernels.testing): decode-only,
prefill-only, mixed, chunked prefill over a cached prefix, padding sequence rows and padding
tokens, every unowned cache slot NaN. The interpreter runs the kernel body as written, so a
wrong mask, page lookup or softmax shows here; what it cannot show is whether Triton compiles
the kernel for a GPU, which `test_lowers_to_triton_for_cuda` checks as far as a CPU can (the
Triton IR is built; test_ragged_paged_attention_gpu_compile.py takes it on to PTX and ptxas).

Tolerances against the oracle (computed from the inputs as rounded to their dtype):
  float32 inputs   rtol 1e-5, atol 1e-5
  bfloat16 inputs  rtol 2e-2, atol 2e-2 (P is rounded to bfloat16 before P @ V, as on GPUs)
  float16 inputs   rtol 5e-3, atol 5e-3 (P rounded to float16: 8x finer than bfloat16)
"""

from __future__ import annotations

import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.kernels import AttentionMetadata
from orca_jax.kernels import ragged_paged_attention_gpu as gpu
from orca_jax.kernels.testing import CONFIGS, MIXES, assert_matches_oracle, make_case, random_mix
from orca_jax.kernels.triton_compile import abstract_gpu_mesh

TOLERANCES = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}


def run_kernel(case, **kw):
    return gpu.ragged_paged_attention(case.q, case.kv_pages, case.metadata, interpret=True, **kw)


def check(case, *, sm_scale, sliding_window=None, soft_cap=None, sinks=None, tol, **kernel_kw):
    out = run_kernel(case, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
                     **kernel_kw)
    return assert_matches_oracle(out, case, sm_scale=sm_scale, sliding_window=sliding_window,
                                 soft_cap=soft_cap, sinks=sinks, tol=tol)


def traced_window_kernel(**kernel_kw):
    """The kernel under jit with the window as an argument: a traced int32 scalar, as a model's
    layer scan passes each layer's window. Returns (fn(case, window), count of its traces)."""
    traces = []

    @jax.jit
    def attention(q, kv_pages, metadata, window):
        traces.append(window)
        return gpu.ragged_paged_attention(q, kv_pages, metadata, sliding_window=window, interpret=True,
                                          **kernel_kw)

    return (lambda case, window: attention(case.q, case.kv_pages, case.metadata, jnp.int32(window))), traces


def draw_sinks(seed, num_q_heads):
    """Sinks about as large as the top scores (scores of unit q and k at sm_scale 1/sqrt(D)
    are about N(0, 1)), so that each takes a visible share of its head's softmax."""
    return np.random.default_rng(seed).uniform(-2.0, 4.0, num_q_heads).astype(np.float32)


def poison_before_window(case, seqs, *, window, page_size, block_kv):
    """NaN in the values of every KV block that lies wholly before each sequence's window (its
    first query's): a kernel that reads one shows NaN, masked or not (0 * NaN in P @ V)."""
    kv_pages = np.array(case.kv_pages)
    for s, (q_len, kv_len) in enumerate(seqs):
        unseen = max(kv_len - q_len - window + 1, 0) // block_kv * block_kv
        for pos in range(unseen):
            kv_pages[case.metadata.page_table[s, pos // page_size], pos % page_size, 1::2] = np.nan
    case.kv_pages = kv_pages
    return case


@pytest.mark.parametrize("seed,ratio,num_kv_heads,head_dim,page_size,mix,window,cap",
                         [(i, *c) for i, c in enumerate(CONFIGS)],
                         ids=[f"gqa{c[0]}-d{c[2]}-ps{c[3]}-{c[4]}-w{c[5]}-cap{c[6]}" for c in CONFIGS])
def test_float32_named_mixes(seed, ratio, num_kv_heads, head_dim, page_size, mix, window, cap):
    case = make_case(200 + seed, MIXES[mix], num_q_heads=ratio * num_kv_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=page_size, q_scale=3.0 if cap else 1.0)
    err = check(case, sm_scale=1 / math.sqrt(head_dim), sliding_window=window, soft_cap=cap,
                tol=TOLERANCES["float32"])
    print(f"max abs err {err:.2e}")


@pytest.mark.parametrize("seed", range(6))
def test_float32_random_ragged_batches(seed):
    """Random steps: shapes, GQA ratio, page size, window and cap drawn from the seed."""
    rng = np.random.default_rng(1000 + seed)
    ratio = int(rng.choice([1, 3, 4, 8]))
    num_kv_heads = int(rng.choice([1, 2]))
    head_dim = int(rng.choice([64, 128]))
    page_size = int(rng.choice([8, 16, 32]))
    window = int(rng.integers(1, 150)) if rng.random() < 0.4 else None
    cap = float(rng.uniform(2, 30)) if rng.random() < 0.4 else None
    seqs = random_mix(rng, int(rng.integers(1, 7)), decode_share=float(rng.uniform(0, 1)))
    case = make_case(seed, seqs, num_q_heads=ratio * num_kv_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=page_size, pad_seqs=int(rng.integers(0, 3)),
                     pad_tokens=int(rng.integers(0, 9)))
    check(case, sm_scale=1 / math.sqrt(head_dim), sliding_window=window, soft_cap=cap,
          tol=TOLERANCES["float32"])


@pytest.mark.parametrize("mix,window,cap", [("mixed", None, None), ("chunked", 50, 20.0)])
def test_bfloat16(mix, window, cap):
    case = make_case(7, MIXES[mix], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                     dtype=jnp.bfloat16)
    check(case, sm_scale=0.125, sliding_window=window, soft_cap=cap, tol=TOLERANCES["bfloat16"])


@pytest.mark.parametrize("mix,window,cap,splits", [("mixed", None, None, 1), ("chunked", 50, 20.0, 1),
                                                   ("decode", None, None, 3)])
def test_float16(mix, window, cap, splits):
    """The GPUs below sm_80 (T4, V100) run float16, with the tiles `choose_tiles` gives them."""
    case = make_case(9, MIXES[mix], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                     dtype=jnp.float16)
    kv_block_tokens, num_warps = gpu.choose_tiles(75, head_dim=128)
    check(case, sm_scale=0.125, sliding_window=window, soft_cap=cap, tol=TOLERANCES["float16"],
          num_kv_splits=splits, kv_block_tokens=kv_block_tokens, num_warps=num_warps)


@pytest.mark.parametrize("splits", [1, 2, 7])
def test_split_kv_matches_unsplit(splits):
    """Flash decoding: long decodes and a chunk split over KV slices, including slices with no
    visible key (7 splits of a 3-block window), merge to the oracle's answer."""
    seqs = [(1, 700), (1, 45), (6, 390), (1, 257)]
    case = make_case(31, seqs, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    check(case, sm_scale=0.125, tol=TOLERANCES["float32"], num_kv_splits=splits)
    check(case, sm_scale=0.125, sliding_window=150, tol=TOLERANCES["float32"], num_kv_splits=splits)


@pytest.mark.parametrize("dtype,mix,ratio,num_kv_heads,splits,window,cap", [
    ("float32", "mixed", 3, 2, 1, None, None),  # group 3 padded to 4: a padded head's sink
    ("float32", "chunked", 4, 1, 4, None, None),  # split KV: the sink counts once in the merge
    ("float32", "mixed", 8, 1, 3, 40, 5.0),  # with the window, and a cap the sink escapes
    ("bfloat16", "mixed", 4, 2, 1, None, None),
    ("bfloat16", "chunked", 3, 2, 3, None, 20.0),
])
def test_sinks_join_each_softmax_once(dtype, mix, ratio, num_kv_heads, splits, window, cap):
    """gpt-oss's attention sinks: one logit per query head in each softmax's denominator,
    neither scaled nor capped, added once whether or not the KV range is split."""
    num_q_heads = ratio * num_kv_heads
    case = make_case(61, MIXES[mix], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=64,
                     page_size=16, dtype=jnp.dtype(dtype), q_scale=3.0 if cap else 1.0)
    check(case, sm_scale=0.125, sliding_window=window, soft_cap=cap, sinks=draw_sinks(62, num_q_heads),
          tol=TOLERANCES[dtype], num_kv_splits=splits)


@pytest.mark.parametrize("splits", [1, 3])
def test_traced_window_is_data(splits):
    """A window passed as a traced int32 (each layer's own in a scan) masks as the same window
    given as an int, and a second window reuses the program: the window is an input, not a
    compile-time constant. A full-attention layer of a mixed model passes a window larger than
    any context (2**30): full attention, with no int32 overflow in the window's arithmetic."""
    case = make_case(71, MIXES["chunked"], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    attention, traces = traced_window_kernel(sm_scale=0.125, num_kv_splits=splits)
    for window in (24, 100, 2 ** 30):
        assert_matches_oracle(attention(case, window), case, sm_scale=0.125,
                              sliding_window=None if window == 2 ** 30 else window, tol=TOLERANCES["float32"])
    assert len(traces) == 1


@pytest.mark.parametrize("splits,with_sinks", [("auto", False), (3, True)])
def test_traced_window_reads_only_the_blocks_it_covers(splits, with_sinks):
    """A sliding layer at long context: every KV block before the window is NaN, so a program
    that read one (0 * NaN in P @ V) would show NaN. The KV range of each program, and each of
    its splits, starts at the window."""
    window, page_size, kv_block_tokens = 100, 16, 64
    seqs = [(1, 1500), (8, 1200), (1, 40), (3, 700)]
    case = make_case(91, seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=page_size)
    case = poison_before_window(case, seqs, window=window, page_size=page_size, block_kv=kv_block_tokens)
    sinks = draw_sinks(92, 4) if with_sinks else None
    attention, _ = traced_window_kernel(sm_scale=0.125, sinks=sinks, num_kv_splits=splits,
                                        kv_block_tokens=kv_block_tokens)
    assert_matches_oracle(attention(case, window), case, sm_scale=0.125, sliding_window=window, sinks=sinks,
                          tol=TOLERANCES["float32"])
    # The poison is there to be read: a full layer reads it.
    assert np.isnan(np.asarray(attention(case, 2 ** 30))[:1]).all()


def test_rejects_malformed_window_and_sinks():
    case = make_case(5, MIXES["decode"], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    with pytest.raises(ValueError, match="sliding_window"):
        run_kernel(case, sm_scale=0.125, sliding_window=jnp.array([8, 8], jnp.int32))
    with pytest.raises(ValueError, match="sliding_window"):
        run_kernel(case, sm_scale=0.125, sliding_window=8.0)
    with pytest.raises(ValueError, match="sinks"):
        run_kernel(case, sm_scale=0.125, sinks=np.zeros(2, np.float32))  # one per KV head, not per query head


def test_block_shapes_do_not_change_the_answer():
    """Query blocks of 1 token (8 rows / group 8) and of 32; KV blocks of one page and of four."""
    case = make_case(41, MIXES["chunked"], num_q_heads=8, num_kv_heads=1, head_dim=64, page_size=16)
    for block_rows, kv_block_tokens in ((8, 16), (256, 64)):
        check(case, sm_scale=0.125, sliding_window=64, tol=TOLERANCES["float32"],
              block_rows=block_rows, kv_block_tokens=kv_block_tokens)


def test_all_padding_batch_is_zero():
    """A warm-up batch: num_seqs = 0, every token padding, every cache slot NaN."""
    T, S, D = 8, 4, 64
    q = np.random.default_rng(0).standard_normal((T, 4, D)).astype(np.float32)
    kv_pages = np.full((3, 16, 4, D), np.nan, np.float32)
    metadata = AttentionMetadata(
        positions=np.zeros(T, np.int32), slot_mapping=np.arange(T, dtype=np.int32) % 16,
        page_table=np.zeros((S, 2), np.int32), kv_lens=np.zeros(S, np.int32),
        cu_q_lens=np.zeros(S + 1, np.int32), num_seqs=np.zeros(1, np.int32))
    out = gpu.ragged_paged_attention(q, kv_pages, metadata, sm_scale=0.125, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_split_count_fills_the_gpu_only_when_needed():
    # 2 long decodes x 8 KV heads = 16 programs: split; 256 decodes x 8 heads: no split.
    assert gpu.choose_num_kv_splits(num_q_blocks=2, num_kv_heads=8, max_kv_blocks=128) > 1
    assert gpu.choose_num_kv_splits(num_q_blocks=256, num_kv_heads=8, max_kv_blocks=128) == 1
    # Never more slices than KV blocks.
    assert gpu.choose_num_kv_splits(num_q_blocks=1, num_kv_heads=1, max_kv_blocks=3) == 3
    # A GPU with fewer multiprocessors fills sooner: 16 programs are 4 per core of a 4-core GPU.
    assert gpu.choose_num_kv_splits(num_q_blocks=2, num_kv_heads=8, max_kv_blocks=128, num_cores=4) == 1
    assert gpu.choose_num_kv_splits(num_q_blocks=2, num_kv_heads=8, max_kv_blocks=128, num_cores=8) == 2


@pytest.mark.parametrize("device,expected", [
    (types.SimpleNamespace(platform="gpu", core_count=108), 108),  # an A100 reports its SMs
    (types.SimpleNamespace(platform="gpu", core_count=0), gpu.FALLBACK_NUM_CORES),  # nothing to go by
    (types.SimpleNamespace(platform="gpu"), gpu.FALLBACK_NUM_CORES),  # a jaxlib without core_count
    (types.SimpleNamespace(platform="cpu", core_count=2), gpu.FALLBACK_NUM_CORES),  # interpreter: as an H100
])
def test_core_count_is_read_from_the_gpu_with_the_h100_as_fallback(device, expected):
    assert gpu.num_cores(device) == expected


def test_core_count_of_this_machine_is_a_positive_int():
    assert gpu.FALLBACK_NUM_CORES == 132
    count = gpu.num_cores(jax.devices()[0])
    assert isinstance(count, int) and count > 0
    if jax.devices()[0].platform == "cpu":
        assert count == gpu.FALLBACK_NUM_CORES


@pytest.mark.parametrize("T,S,busy", [(256, 256, 256), (64, 64, 64), (8, 8, 8), (512, 32, 64)])
def test_decode_steps_count_one_busy_block_per_sequence(T, S, busy):
    """A decode bucket (T == S) has one busy query block per sequence, so 256 decodes over 8
    KV heads fill an H200 without splitting; a prefill bucket has about T / block_q."""
    block_q = gpu.choose_block_rows(T, S, 128) // 4  # group 4, Llama-3-8B
    assert gpu.estimate_busy_blocks(T, S, block_q) == busy
    splits = gpu.choose_num_kv_splits(gpu.estimate_busy_blocks(T, S, block_q), 8, max_kv_blocks=64)
    assert (splits == 1) == (busy * 8 >= 4 * 132)


def test_block_rows_follow_the_step_shape():
    assert gpu.choose_block_rows(num_tokens=256, num_seq_slots=256, head_dim=128) == 16  # decodes
    assert gpu.choose_block_rows(num_tokens=512, num_seq_slots=32, head_dim=128) == 64  # prefill
    assert gpu.choose_block_rows(num_tokens=512, num_seq_slots=32, head_dim=256) == 32  # registers


@pytest.mark.parametrize("dtype,group,head_dim,page_size,window,cap,sinks,splits", [
    (jnp.bfloat16, 4, 128, 16, None, None, False, 1),
    (jnp.float32, 3, 64, 8, 32, 5.0, False, 4),
    (jnp.bfloat16, 4, 128, 16, "traced", None, True, 1),  # sinks start every softmax
    (jnp.bfloat16, 3, 64, 16, "traced", 30.0, True, 4),  # sinks start split 0's, then the merge
])
def test_lowers_to_triton_for_cuda(dtype, group, head_dim, page_size, window, cap, sinks, splits):
    """Cross-lower for CUDA from this CPU: every operation of the kernel has a Triton lowering
    and the step holds exactly one Triton kernel (the split merge is plain XLA). A traced
    window and the sinks are arguments of the step, as a layer scan passes them."""
    T, S, max_pages = 64, 8, 16
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    metadata = AttentionMetadata(positions=i32((T,)), slot_mapping=i32((T,)), page_table=i32((S, max_pages)),
                                 kv_lens=i32((S,)), cu_q_lens=i32((S + 1,)), num_seqs=i32((1,)))
    traced = {}
    if window == "traced":
        traced["sliding_window"] = jax.ShapeDtypeStruct((), jnp.int32)
    if sinks:
        traced["sinks"] = jax.ShapeDtypeStruct((2 * group,), jnp.float32)
    args = (jax.ShapeDtypeStruct((T, 2 * group, head_dim), dtype),
            jax.ShapeDtypeStruct((100, page_size, 4, head_dim), dtype), metadata, traced)
    static = dict(sm_scale=0.1, soft_cap=cap, num_kv_splits=splits)
    if window != "traced":
        static["sliding_window"] = window
    fn = jax.jit(lambda q, kv_pages, metadata, traced: gpu.ragged_paged_attention(
        q, kv_pages, metadata, **static, **traced))
    triton = "__gpu$xla.gpu.triton"
    with jax.sharding.use_abstract_mesh(abstract_gpu_mesh()):  # jax >= 0.11 asks which GPU
        exported = jax.export.export(fn, platforms=["cuda"],
                                     disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(*args)
    module = exported.mlir_module()
    assert module.count(f"@{triton}") == 1
    assert "mosaic_gpu" not in module
