"""Every token bucket's step lowered for a TPU and for an NVIDIA GPU on this CPU
(orca_jax/worker/cross_lowering.py): a dense model, a sliding-window one, a mixture of experts
and an 8-bit KV cache, at tensor parallelism 1 and 8 (8 forced host devices, in a subprocess:
tests/cross_lowering_worker.py), with the platform's attention kernel in the program wherever it
serves the shapes.

What a CPU cannot check, and these tests therefore do not: XLA's compile of the programs for
the device (memory fit, the SPMD partitioner's collectives), the Mosaic compile of jax's TPU
kernel body (Mosaic has no host-side compiler; the Triton kernel's IR is taken on to ptxas by
tests/kernels/test_ragged_paged_attention_gpu_compile.py), and every number the programs compute.
"""

from __future__ import annotations

import json

import jax
import pytest

from orca_jax.worker import cross_lowering

TPU_KERNEL, GPU_KERNEL = cross_lowering.KERNEL_CALLS["pallas_tpu"], cross_lowering.KERNEL_CALLS["pallas_gpu"]
BUCKETS = ("8", "16", "32")
# head_dim 128: the TPU kernel's lane width; 8 KV heads, so that each of 8 shards holds one.
_HEADS = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=8, head_dim=128, num_hidden_layers=2,
              max_position_embeddings=512)
MODELS = {
    "dense": ("LlamaConfig", dict(_HEADS, intermediate_size=256), "bfloat16"),
    "sliding": ("MistralConfig", dict(_HEADS, intermediate_size=256, sliding_window=64), "bfloat16"),
    "moe": ("Qwen3MoeConfig", dict(_HEADS, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                                   num_experts_per_tok=2), "bfloat16"),
    "int8_kv": ("LlamaConfig", dict(_HEADS, intermediate_size=256), "int8"),
}


@pytest.fixture(scope="module")
def lowered(tiny_hf_model_factory, run_parallel_worker) -> dict:
    cases = {name: dict(model=str(tiny_hf_model_factory(cls, seed=4, **settings)), kv_cache_dtype=kv, tp=[1, 8])
             for name, (cls, settings, kv) in MODELS.items()}
    return run_parallel_worker(json.dumps(cases), worker="cross_lowering_worker.py")


@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("name", ["dense", "sliding", "moe"])
def test_the_tpu_program_holds_jaxs_tpu_kernel(lowered, name, tp):
    steps = lowered[f"{name}/tp{tp}/tpu"]
    assert sorted(steps) == sorted(BUCKETS)
    for bucket, step in steps.items():
        assert TPU_KERNEL in step["custom_calls"], (name, tp, bucket, step)
        assert GPU_KERNEL not in step["custom_calls"]


@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_cuda_program_holds_the_triton_kernel(lowered, name, tp):
    """Every model, the 8-bit cache included (the GPU kernel reads its per-row scales)."""
    for bucket, step in lowered[f"{name}/tp{tp}/cuda"].items():
        assert GPU_KERNEL in step["custom_calls"], (name, tp, bucket, step)
        assert TPU_KERNEL not in step["custom_calls"]


@pytest.mark.parametrize("tp", [1, 8])
def test_the_8bit_cache_falls_back_to_the_reference_on_tpu(lowered, tp):
    """jax's TPU kernel scales a quantized cache by one float per tensor; our 8-bit rows carry a
    scale per token and head (kernels/kv_quant.py), so the TPU program attends with the
    reference, and says so (ragged_paged_attention_tpu.unsupported_reason)."""
    for step in lowered[f"int8_kv/tp{tp}/tpu"].values():
        assert TPU_KERNEL not in step["custom_calls"]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_experts_run_as_ragged_dot_on_accelerators(lowered, platform):
    """The grouped matmuls the target builds (ragged_dot), not the CPU's blocked loop."""
    for tp in (1, 8):
        assert all(step["ragged_dot"] for step in lowered[f"moe/tp{tp}/{platform}"].values())
    assert not any(step["ragged_dot"] for step in lowered["dense/tp1/tpu"].values())


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_tensor_parallel_programs_keep_their_per_shard_attention(lowered, platform):
    """At TP 8 the attention runs per shard (shard_map: a manual computation in the program),
    the experts too; at TP 1 nothing is manual."""
    for name in ("dense", "sliding", "moe", "int8_kv"):
        assert all(s["manual_computations"] == 0 for s in lowered[f"{name}/tp1/{platform}"].values())
        expected = 2 if name == "moe" else 1
        assert all(s["manual_computations"] == expected for s in lowered[f"{name}/tp8/{platform}"].values()), name


def test_a_runner_of_this_process_exports_for_tpu(tiny_hf_model_factory):
    """In process (one device): the TPU step exports (jax.export) and serializes, as a program
    built on this CPU to be run on a TPU VM would be."""
    from orca_jax.engine.engine import LLMEngine

    cls, settings, _ = MODELS["dense"]
    engine = LLMEngine(model=str(tiny_hf_model_factory(cls, seed=4, **settings)), warmup=False,
                       attention_impl="reference", max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16,
                       page_size=16, num_pages=16, max_model_len=128, dtype="bfloat16", kv_cache_dtype="bfloat16")
    [exported] = cross_lowering.export_steps(engine.runner, cross_lowering.TPU_V6E).values()
    assert exported.platforms == ("tpu",)
    assert TPU_KERNEL in exported.mlir_module()
    assert len(exported.serialize()) > 0


def test_block_sizes_come_from_jaxs_table_for_the_abstract_tpu():
    """Lowered from a CPU, jax's own lookup would read this CPU; ours reads the abstract TPU's
    kind: v5e's tuned entry, v4's fixed sizes, and jax's defaults for an untuned shape or no TPU."""
    from orca_jax.kernels import ragged_paged_attention_tpu as tpu

    tuned = ("bfloat16", "bfloat16", 32, 8, 128, 128, 1024, 8)  # 1024 tokens, 8 pages of 128
    table = tpu._tpu_ops().tuned_block_sizes.TUNED_BLOCK_SIZES["TPU v5"]
    expected = table[("bfloat16", "bfloat16", 32, 8, 128, 128, 1024, 1024)]
    assert expected != tpu.DEFAULT_BLOCK_SIZES
    with jax.sharding.use_abstract_mesh(cross_lowering.abstract_mesh(cross_lowering.TPU_V5E, None)):
        assert tpu.cross_host_tuned_lookup(*tuned) == expected
        assert tpu.cross_host_tuned_lookup("bfloat16", "bfloat16", 2, 1, 128, 16, 8, 2) == tpu.DEFAULT_BLOCK_SIZES
    with jax.sharding.use_abstract_mesh(cross_lowering.abstract_mesh(
            cross_lowering.Target("tpu", "TPU v4", "pallas_tpu"), None)):
        assert tpu.cross_host_tuned_lookup(*tuned) == tpu.TPU_V4_BLOCK_SIZES
    assert tpu.cross_host_tuned_lookup(*tuned) == tpu.DEFAULT_BLOCK_SIZES  # no abstract TPU
