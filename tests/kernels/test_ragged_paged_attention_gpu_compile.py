"""The Pallas GPU kernel compiled for sm_90 (H100/H200) and sm_80 (A100) from this CPU: the
step's Triton IR, as jax hands it to XLA, through the `triton` package's NVIDIA backend and the
ptxas inside its wheel (orca_jax/kernels/triton_compile.py). The interpreter tests
(test_ragged_paged_attention_gpu.py) show that the kernel computes the right thing; these show
that at the shapes it serves it compiles to tensor-core code that fits in registers and in
shared memory, which is what its speed on a GPU depends on first.

bfloat16 is what a GPU serves (`dtype="auto"` takes the checkpoint's): its serving shapes must
not spill. float32 compiles to plain FMA code that does spill (see the table printed by
`python -m orca_jax.kernels.triton_compile`); here it must only compile and fit. The 8-bit
caches (int8, float8_e4m3fn; kernels/kv_quant.py) with bfloat16 queries must not spill either,
on the A100 too, where Triton has no float8 conversion (the kernel decodes float8 bits with
integer operations, so its Triton IR holds no float8 arithmetic). Nor may a sliding window
given as data with attention sinks (gpt-oss's options).

Below sm_80 (T4 sm_75, V100 sm_70) `dtype="auto"` is float16 and Triton compiles every dot to
FMA code: its tensor-core path starts at sm_80 (kernels/gpu_info.py). There the kernel takes
the tiles `choose_tiles` gives those GPUs, which must not spill; the MMA tiles would.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.kernels import ragged_paged_attention_gpu as gpu
from orca_jax.kernels import triton_compile as tc

# Shared memory one program may use (the opt-in maximum per block): A100 163 KiB, H100 227 KiB.
SHARED_MEMORY_LIMIT = {70: 96 * 1024, 75: 64 * 1024, 80: 163 * 1024, 90: 227 * 1024}
PRE_AMPERE_CAPABILITIES = tc.PRE_AMPERE_CAPABILITIES  # T4, V100: float16, no Triton tensor-core dots
SHAPES = {shape.name: shape for shape in tc.SERVING_SHAPES}
SERVING_CASES = [(shape.name, step) for shape in tc.SERVING_SHAPES for step in tc.serving_steps(shape)]


@functools.lru_cache(maxsize=None)
def lowered(shape_name: str, step: str, dtype: str, **kernel_options) -> tc.TritonKernel:
    shape = SHAPES[shape_name]
    num_tokens, num_seq_slots = tc.serving_steps(shape)[step]
    return tc.attention_kernel(shape, num_tokens, num_seq_slots, jnp.dtype(dtype), **kernel_options)


@functools.lru_cache(maxsize=None)
def compiled(shape_name: str, step: str, dtype: str, capability: int) -> tc.CompileReport:
    report = tc.compile_for_nvidia(lowered(shape_name, step, dtype), capability)
    print(f"{shape_name} {step} {dtype} {report}")
    return report


def test_parse_ptxas_report():
    log = ("ptxas info    : 11 bytes gmem, 8 bytes cmem[4]\n"
           "ptxas info    : Compiling entry function 'ragged_paged_attention' for 'sm_80'\n"
           "ptxas info    : Function properties for ragged_paged_attention\n"
           "    8 bytes stack frame, 28 bytes spill stores, 24 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 440 bytes cmem[0]\n")
    assert tc.parse_ptxas_report(log) == dict(registers=255, stack_frame=8, spill_stores=28, spill_loads=24)
    with pytest.raises(ValueError, match="no register report"):
        tc.parse_ptxas_report("ptxas info    : 11 bytes gmem\n")


def test_lowering_hands_xla_the_kernels_launch():
    """The IR read out of the lowered step is the kernel with the launch the wrapper chose:
    its grid (query blocks, KV heads, KV splits) and its warps."""
    shape = SHAPES["llama-8b"]
    kernel = lowered("llama-8b", "prefill-4096", "bfloat16")
    rows = gpu.choose_block_rows(4096, shape.max_num_seqs, shape.head_dim)
    group = shape.num_q_heads // shape.num_kv_heads
    assert kernel.grid == (4096 // (rows // group) + shape.max_num_seqs, shape.num_kv_heads, 1)
    assert kernel.num_warps == gpu.choose_num_warps(rows, 64, shape.head_dim) == 8
    assert kernel.num_stages == 2
    assert "tt.func public @ragged_paged_attention" in kernel.ttir
    assert kernel.ttir.count("tt.dot") == 2  # Q K^T and P V, once per KV block


@pytest.mark.parametrize("capability", tc.SERVING_CAPABILITIES, ids=lambda c: f"sm{c}")
@pytest.mark.parametrize("shape_name,step", SERVING_CASES, ids=[f"{n}-{s}" for n, s in SERVING_CASES])
def test_bfloat16_serving_shapes_do_not_spill(shape_name, step, capability):
    report = compiled(shape_name, step, "bfloat16", capability)
    assert not report.spills, f"{shape_name} {step} spills registers on {report.arch}: {report}"
    assert report.shared_memory <= SHARED_MEMORY_LIMIT[capability]
    # Tensor cores, not FMA: Hopper's warpgroup MMA where a program has 64 rows (wgmma's
    # smallest), the Ampere instruction at the 16-row decode blocks and on sm_80.
    rows = 16 if step.startswith("decode") else 64
    assert report.matmul == ("wgmma" if capability == 90 and rows == 64 else "mma.sync")


@pytest.mark.parametrize("capability", tc.SERVING_CAPABILITIES, ids=lambda c: f"sm{c}")
@pytest.mark.parametrize("step", ["decode-256", "prefill-4096"])
def test_float32_compiles_and_fits_shared_memory(step, capability):
    report = compiled("llama-8b", step, "float32", capability)
    assert report.shared_memory <= SHARED_MEMORY_LIMIT[capability]
    assert 0 < report.registers <= 255


@pytest.mark.parametrize("capability", tc.SERVING_CAPABILITIES, ids=lambda c: f"sm{c}")
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("step", ["decode-256", "prefill-4096"])
def test_8bit_cache_serving_shapes_do_not_spill(step, kv_dtype, capability):
    kernel = lowered("llama-8b", step, "bfloat16", kv_dtype=kv_dtype)
    # Values, then each scale byte, of K and of V: loads of whole power-of-two tiles; float8 is
    # only loaded and reinterpreted as int8, never converted (which sm_80 could not do).
    assert kernel.ttir.count("tt.dot") == 2
    assert "tt.fp_to_fp" not in kernel.ttir
    report = tc.compile_for_nvidia(kernel, capability)
    print(f"llama-8b {step} bfloat16 q, {kv_dtype} cache: {report}")
    assert not report.spills, f"{step} with a {kv_dtype} cache spills registers on {report.arch}: {report}"
    assert report.shared_memory <= SHARED_MEMORY_LIMIT[capability]
    rows = 16 if step.startswith("decode") else 64
    assert report.matmul == ("wgmma" if capability == 90 and rows == 64 else "mma.sync")


@functools.lru_cache(maxsize=None)
def lowered_with_window_and_sinks(step: str) -> tc.TritonKernel:
    """Llama-8B's heads with gpt-oss's attention options: a window (an int, which reaches the
    kernel as data, as a layer scan's traced window does) and a sink per query head."""
    shape = SHAPES["llama-8b"]
    num_tokens, num_seq_slots = tc.serving_steps(shape)[step]
    return tc.attention_kernel(shape, num_tokens, num_seq_slots, jnp.bfloat16, sliding_window=128,
                               sinks=np.zeros(shape.num_q_heads, np.float32))


@pytest.mark.parametrize("capability", tc.SERVING_CAPABILITIES, ids=lambda c: f"sm{c}")
@pytest.mark.parametrize("step", ["decode-256", "prefill-4096"])
def test_window_and_sinks_do_not_spill(step, capability):
    """The window's load and mask and the sinks' start of the online softmax cost no spills at
    the serving shapes (a sink folded in after the loop did: 4 bytes at decode-256 on sm_90)."""
    kernel = lowered_with_window_and_sinks(step)
    assert kernel.ttir.count("tt.dot") == 2
    report = tc.compile_for_nvidia(kernel, capability)
    print(f"llama-8b {step} bfloat16, window and sinks: {report}")
    assert not report.spills, f"{step} with window and sinks spills registers on {report.arch}: {report}"
    assert report.shared_memory <= SHARED_MEMORY_LIMIT[capability]
    rows = 16 if step.startswith("decode") else 64
    assert report.matmul == ("wgmma" if capability == 90 and rows == 64 else "mma.sync")


@functools.lru_cache(maxsize=None)
def compiled_pre_ampere(shape_name: str, step: str, capability: int, tiles: str) -> tc.CompileReport:
    """float16 for a pre-Ampere target with the tiles chosen for it ("fma") or the MMA ones."""
    head_dim = SHAPES[shape_name].head_dim
    kv_block_tokens, num_warps = gpu.choose_tiles(capability if tiles == "fma" else 90, head_dim)
    kernel = lowered(shape_name, step, "float16", kv_block_tokens=kv_block_tokens, num_warps=num_warps)
    report = tc.compile_for_nvidia(kernel, capability)
    print(f"{shape_name} {step} float16 {tiles} tiles: {report}")
    return report


@pytest.mark.parametrize("capability", PRE_AMPERE_CAPABILITIES, ids=lambda c: f"sm{c}")
@pytest.mark.parametrize("shape_name,step", SERVING_CASES, ids=[f"{n}-{s}" for n, s in SERVING_CASES])
def test_float16_pre_ampere_serving_shapes_do_not_spill(shape_name, step, capability):
    report = compiled_pre_ampere(shape_name, step, capability, "fma")
    assert not report.spills, f"{shape_name} {step} spills registers on {report.arch}: {report}"
    assert report.shared_memory <= SHARED_MEMORY_LIMIT[capability]
    assert report.matmul == "fma", "Triton has no tensor-core dots below sm_80 (if it does now, retune)"


@pytest.mark.parametrize("capability", PRE_AMPERE_CAPABILITIES, ids=lambda c: f"sm{c}")
def test_pre_ampere_needs_its_own_tiles(capability):
    """Why `choose_tiles` differs below sm_80: the MMA tiles spill there."""
    report = compiled_pre_ampere("llama-8b", "prefill-4096", capability, "mma")
    assert report.spills and report.matmul == "fma", report


@pytest.mark.parametrize("capability", [80, 90])
def test_float16_compiles_to_tensor_cores_from_sm80(capability):
    report = compiled("llama-8b", "decode-256", "float16", capability)
    assert not report.spills and report.matmul == "mma.sync", report


def test_choose_tiles_by_capability():
    assert gpu.choose_tiles(None, 128) == gpu.choose_tiles(90, 128) == (64, "auto")
    assert gpu.choose_tiles(80, 64) == (64, "auto")
    assert gpu.choose_tiles(75, 128) == gpu.choose_tiles(70, 64) == (16, 8)


def test_spill_check_sees_spills():
    """The check above can fail: tiles too large for 4 warps' registers (128 rows by 128 keys
    of head_dim 128) are reported as spilling."""
    kernel = lowered("llama-8b", "prefill-4096", "bfloat16", block_rows=128, kv_block_tokens=128, num_warps=4)
    report = tc.compile_for_nvidia(kernel, 90)
    assert report.spills and report.spill_stores > 0 and report.registers == 255, report


def test_choose_num_warps():
    """8 warps only where 4 would spill (measured by the tests above and by the report)."""
    assert gpu.choose_num_warps(block_rows=16, kv_block_tokens=64, head_dim=64) == 4  # decode, SmolLM2
    assert gpu.choose_num_warps(block_rows=64, kv_block_tokens=64, head_dim=64) == 4  # prefill, SmolLM2
    assert gpu.choose_num_warps(block_rows=16, kv_block_tokens=64, head_dim=128) == 4  # decode, Llama-8B
    assert gpu.choose_num_warps(block_rows=64, kv_block_tokens=64, head_dim=128) == 8  # prefill, Llama-8B
    assert gpu.choose_num_warps(block_rows=16, kv_block_tokens=64, head_dim=256) == 8  # decode, head_dim 256
