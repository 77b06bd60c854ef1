"""Tensor parallelism (orca_jax/parallel.py).

The sharded runs need several devices, and JAX fixes the device count when it starts, while
this suite runs on one: tests/parallel_worker.py runs them in a subprocess on 8 forced host
devices (`--xla_force_host_platform_device_count=8`) and reports measurements as JSON. The
rules themselves are tested here, in-process.
"""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from orca_jax import parallel
from orca_jax.config import ModelConfig

LOGIT_ATOL = 1e-5


# GQA 8 query heads over 2 KV heads: sizes 1, 2 shard the KV heads; 4 and 8 replicate them.
@pytest.fixture(scope="module")
def llama_runs(tiny_llama_factory, run_parallel_worker) -> dict:
    model = tiny_llama_factory(seed=3, num_attention_heads=8, num_key_value_heads=2)
    return run_parallel_worker("tp", str(model), "1,2,4,8,pallas_gpu@4")


# GPT-2: tied (vocabulary-sharded) embedding and head, biases everywhere, fc/proj MLP.
@pytest.fixture(scope="module")
def gpt2_runs(tiny_hf_model_factory, run_parallel_worker) -> dict:
    model = tiny_hf_model_factory("GPT2Config", seed=1, random_biases=True, n_embd=64, n_layer=2, n_head=4,
                                  n_inner=128, n_positions=256, initializer_range=0.1)
    return run_parallel_worker("tp", str(model), "1,4")


@pytest.fixture(params=["llama", "gpt2"])
def runs(request) -> dict:
    return request.getfixturevalue(f"{request.param}_runs")


def test_logits_equal_one_device_within_tolerance(runs):
    assert runs["1"]["steps"] >= 4  # chunked prefill, decodes, and mixes of both
    for tp, result in runs.items():
        assert result["max_logit_diff"] < LOGIT_ATOL, (tp, result["max_logit_diff"])


def test_greedy_and_seeded_sampled_tokens_identical_to_one_device(runs):
    for tp, result in runs.items():
        assert result["greedy"] == runs["1"]["greedy"], tp
        assert result["sampled"] == runs["1"]["sampled"], tp
    assert all(len(t) == 6 for t in runs["1"]["sampled"])


def test_a_pallas_kernel_runs_per_shard_unchanged(llama_runs):
    """The GPU kernel (in Pallas' interpreter on CPU) inside the same shard_map, at size 4
    (KV heads replicated): the kernel sees one device's heads and cache only."""
    result = llama_runs["pallas_gpu@4"]
    assert result["max_logit_diff"] < LOGIT_ATOL
    assert result["greedy"] == llama_runs["1"]["greedy"] and result["sampled"] == llama_runs["1"]["sampled"]
    assert result["kv_shard_shapes"] == llama_runs["4"]["kv_shard_shapes"]


def test_kv_cache_is_sharded_over_kv_heads(llama_runs):
    for tp in (2, 4, 8):
        result = llama_runs[str(tp)]
        assert result["kv_spec"] == str(P(None, None, None, "model", None))
        assert result["kv_devices"] == tp
        # KV heads stored: the model's 2, or one (replicated) per device when the mesh is larger.
        stored = max(2, tp)
        assert result["kv_heads_stored"] == stored
        L, pages, page_size, slots, head_dim = result["kv_shape"]
        assert slots == 2 * stored
        # Each device holds whole K/V pairs of its own heads only.
        assert result["kv_shard_shapes"] == [str((L, pages, page_size, 2 * stored // tp, head_dim))]


def test_weights_follow_the_sharding_rules(runs):
    for tp, result in runs.items():
        if tp == "1":
            continue
        assert result["param_specs"] == {
            "q_proj": str(P(None, None, "model", None)),
            "k_proj": str(P(None, None, "model", None)),
            "o_proj": str(P(None, "model", None, None)),
            "embed": str(P("model", None)),
        }


def test_compiled_step_has_one_all_reduce_per_row_parallel_layer(runs):
    for tp, result in runs.items():
        if tp == "1":
            continue
        hlo = result["hlo"]
        # Inside the layer scan (run once per layer): attention output and MLP output.
        assert hlo["all_reduce_o_proj"] == 1 and hlo["all_reduce_mlp_out"] == 1
        assert hlo["in_layer_loop"] == 2
        # Outside: the vocabulary-sharded embedding lookup. Nothing else.
        assert hlo["all_reduce_embed"] == 1 and hlo["all_reduce_total"] == 3
        # The only gather is of the [S, V] logits (4 rows, vocabulary 512), never a weight.
        assert [s.split("{")[0] for s in hlo["all_gather_shapes"]] == ["f32[4,512]"]


# ---- the rules, in-process ------------------------------------------------------------------
def _config(num_heads: int, num_kv_heads: int) -> ModelConfig:
    return ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16)


@pytest.mark.parametrize("tp,repeats", [(1, 1), (2, 1), (4, 2), (8, 4)])
def test_kv_heads_replicated_only_when_the_mesh_is_larger(tp, repeats):
    assert parallel.kv_head_repeats(_config(8, 2), tp) == repeats
    assert parallel.sharded_model_config(_config(8, 2), tp).num_kv_heads == 2 * repeats


def test_head_counts_the_mesh_cannot_split_are_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the number of query heads \(8\)"):
        parallel.kv_head_repeats(_config(8, 2), 3)
    # 12 query heads split over 4 devices, but 6 KV heads neither divide by 4 nor divide it.
    with pytest.raises(ValueError, match="tensor_parallel_size=4 and num_kv_heads=6"):
        parallel.kv_head_repeats(_config(12, 6), 4)


def test_replicated_kv_heads_keep_each_query_heads_kv_head():
    L, D, K, H, N, repeats = 2, 4, 2, 3, 8, 4
    kernel = np.arange(L * D * K * H, dtype=np.float32).reshape(L, D, K, H)
    params = {"params": {"layers": {"attn": {"k_proj": {"kernel": kernel.copy()},
                                             "v_proj": {"kernel": kernel.copy(), "bias": np.ones((L, K, H))}}}}}
    out = parallel.replicate_kv_heads(params, repeats)["params"]["layers"]["attn"]
    assert out["k_proj"]["kernel"].shape == (L, D, K * repeats, H)
    assert out["v_proj"]["bias"].shape == (L, K * repeats, H)
    for n in range(N):  # query head n reads KV head n // (N / K) before, n // (N / (K * r)) after
        before = kernel[:, :, n // (N // K)]
        after = out["k_proj"]["kernel"][:, :, n // (N // (K * repeats))]
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("path,shape,spec", [
    ("embed", (512, 64), P("model", None)),
    ("embed", (513, 64), P()),  # a vocabulary that does not divide: replicated
    ("lm_head", (64, 512), P(None, "model")),
    ("pos_embed", (256, 64), P()),
    ("layers/attn/q_proj/kernel", (2, 64, 8, 16), P(None, None, "model", None)),
    ("layers/attn/v_proj/bias", (2, 2, 16), P(None, "model", None)),
    ("layers/attn/o_proj/kernel", (2, 8, 16, 64), P(None, "model", None, None)),
    ("layers/attn/o_proj/bias", (2, 64), P()),
    ("layers/attn/q_norm/scale", (2, 16), P()),
    ("layers/mlp/gate_proj/kernel", (2, 64, 128), P(None, None, "model")),
    ("layers/mlp/fc/bias", (2, 128), P(None, "model")),
    ("layers/mlp/down_proj/kernel", (2, 128, 64), P(None, "model", None)),
    ("layers/mlp/proj/bias", (2, 64), P()),
    ("layers/input_norm/scale", (2, 64), P()),
    ("final_norm/scale", (64,), P()),
])
def test_param_spec_rules(path, shape, spec):
    assert parallel.param_spec(path, shape, 2) == spec


def test_more_devices_than_there_are_is_refused(tiny_llama_dir):
    from orca_jax.engine import LLMEngine

    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 devices.*xla_force_host_platform_device_count"):
        LLMEngine(model=str(tiny_llama_dir), tensor_parallel_size=2, warmup=False)
    # Head counts are checked first, with their own message (4 query heads, 3 devices).
    with pytest.raises(ValueError, match="must divide the number of query heads"):
        LLMEngine(model=str(tiny_llama_dir), tensor_parallel_size=3, warmup=False)


def test_one_device_keeps_the_unsharded_path(tiny_llama_dir):
    from jax.sharding import SingleDeviceSharding

    from orca_jax.engine import LLMEngine

    engine = LLMEngine(model=str(tiny_llama_dir), max_num_seqs=2, max_num_batched_tokens=8, page_size=8,
                       num_pages=8, max_model_len=64, warmup=False)
    assert engine.runner.mesh is None and engine.runner.model.mesh is None and engine.channel is None
    assert isinstance(engine.runner.kv_cache.sharding, SingleDeviceSharding)
