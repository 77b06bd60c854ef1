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

TOLERANCES = {"float32": 1e-5, "bfloat16": 2e-2}


def run_kernel(case, **kw):
    return gpu.ragged_paged_attention(case.q, case.kv_pages, case.metadata, interpret=True, **kw)


def check(case, *, sm_scale, sliding_window=None, soft_cap=None, tol, **kernel_kw):
    out = run_kernel(case, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, **kernel_kw)
    return assert_matches_oracle(out, case, sm_scale=sm_scale, sliding_window=sliding_window,
                                 soft_cap=soft_cap, tol=tol)


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


@pytest.mark.parametrize("splits", [1, 2, 7])
def test_split_kv_matches_unsplit(splits):
    """Flash decoding: long decodes and a chunk split over KV slices, including slices with no
    visible key (7 splits of a 3-block window), merge to the oracle's answer."""
    seqs = [(1, 700), (1, 45), (6, 390), (1, 257)]
    case = make_case(31, seqs, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    check(case, sm_scale=0.125, tol=TOLERANCES["float32"], num_kv_splits=splits)
    check(case, sm_scale=0.125, sliding_window=150, tol=TOLERANCES["float32"], num_kv_splits=splits)


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


@pytest.mark.parametrize("dtype,group,head_dim,page_size,window,cap,splits", [
    (jnp.bfloat16, 4, 128, 16, None, None, 1),
    (jnp.float32, 3, 64, 8, 32, 5.0, 4),
])
def test_lowers_to_triton_for_cuda(dtype, group, head_dim, page_size, window, cap, splits):
    """Cross-lower for CUDA from this CPU: every operation of the kernel has a Triton lowering
    and the step holds exactly one Triton kernel (the split merge is plain XLA)."""
    T, S, max_pages = 64, 8, 16
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    metadata = AttentionMetadata(positions=i32((T,)), slot_mapping=i32((T,)), page_table=i32((S, max_pages)),
                                 kv_lens=i32((S,)), cu_q_lens=i32((S + 1,)), num_seqs=i32((1,)))
    args = (jax.ShapeDtypeStruct((T, 2 * group, head_dim), dtype),
            jax.ShapeDtypeStruct((100, page_size, 4, head_dim), dtype), metadata)
    fn = jax.jit(functools.partial(gpu.ragged_paged_attention, sm_scale=0.1, sliding_window=window,
                                   soft_cap=cap, num_kv_splits=splits))
    triton = "__gpu$xla.gpu.triton"
    with jax.sharding.use_abstract_mesh(abstract_gpu_mesh()):  # jax >= 0.11 asks which GPU
        exported = jax.export.export(fn, platforms=["cuda"],
                                     disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(*args)
    module = exported.mlir_module()
    assert module.count(f"@{triton}") == 1
    assert "mosaic_gpu" not in module
