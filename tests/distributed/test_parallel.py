"""Tensor parallelism (orca_jax/distributed/parallel.py).

The sharded runs need several devices, and JAX fixes the device count when it starts, while
this suite runs on one: tests/parallel_worker.py runs them in a subprocess on 8 forced host
devices (`--xla_force_host_platform_device_count=8`) and reports measurements as JSON. The
rules themselves are tested here, in-process.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from orca_jax.distributed import parallel
from orca_jax.config import ModelConfig
from orca_jax.models import abstract_variables, logical_specs

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


# int8 weights (per output channel): the scales shard with their weights' output axes.
@pytest.fixture(scope="module")
def llama_int8_runs(tiny_llama_factory, run_parallel_worker) -> dict:
    model = tiny_llama_factory(seed=3, num_attention_heads=8, num_key_value_heads=2)
    return run_parallel_worker("tp", str(model), "1,2", "int8")


# Gemma 2: sliding (window 8 < the 19-token prompt) and full layers mixed, each layer's window
# passed to the per-shard attention as data; soft caps, sandwich norms, tied scaled embedding.
# One device matches HF within 1e-4 (tests/models/test_gemma_phi3.py), so TP 2 within 1e-5 of it
# does too.
@pytest.fixture(scope="module")
def gemma2_runs(tiny_hf_model_factory, run_parallel_worker) -> dict:
    model = tiny_hf_model_factory("Gemma2Config", seed=5, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                  query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                  max_position_embeddings=256, initializer_range=0.1)
    return run_parallel_worker("tp", str(model), "1,2")


@pytest.fixture(params=["llama", "gpt2", "llama_int8", "gemma2"])
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


def test_int8_scales_shard_with_their_weights(llama_int8_runs):
    specs = {**llama_int8_runs["2"]["param_specs"], **llama_int8_runs["2"]["quantized_specs"]}
    assert specs["q_proj_dtype"] == "int8"
    # kernel [L, D, N, H] column-parallel on N; its scales [L, 1, N, H] split the same heads.
    assert specs["q_proj"] == "P(None, None, 'model', None)"
    assert specs["q_proj_qscale"] == "P(None, None, 'model', None)"
    assert specs["k_proj_qscale"] == "P(None, None, 'model', None)"
    # o_proj [L, N, H, D] is row-parallel: its per-output-channel scales [L, 1, D] are whole.
    assert specs["o_proj"] == "P(None, 'model', None, None)"
    assert specs["o_proj_qscale"] == "P()"
    # The vocabulary-parallel table's per-row scales [V, 1] split the same rows.
    assert specs["embed"] == "P('model', None)"
    assert specs["embed_qscale"] == "P('model', None)"


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


def test_compiled_step_has_one_all_reduce_per_row_parallel_layer(runs, request):
    # A quantized table's lookup gathers its int8 rows and their scales: one all-reduce each.
    embed_reduces = 2 if "int8" in request.node.callspec.id else 1
    for tp, result in runs.items():
        if tp == "1":
            continue
        hlo = result["hlo"]
        # Inside the layer scan (run once per layer): attention output and MLP output.
        assert hlo["all_reduce_o_proj"] == 1 and hlo["all_reduce_mlp_out"] == 1
        assert hlo["in_layer_loop"] == 2
        # Outside: the vocabulary-sharded embedding lookup. Nothing else.
        assert hlo["all_reduce_embed"] == embed_reduces and hlo["all_reduce_total"] == 2 + embed_reduces
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


def _random_params(config: ModelConfig, seed: int = 0) -> dict:
    """Host weights in the tree the model's init makes (random values, so a misplaced head shows)."""
    rng = np.random.default_rng(seed)
    shapes = nn.unbox(abstract_variables(config))
    return jax.tree.map(lambda leaf: rng.standard_normal(leaf.shape).astype(np.float32), shapes)


def test_repeated_kv_heads_keep_each_query_heads_kv_head():
    config, repeats = dataclasses.replace(_config(8, 2), model_type="qwen2", qkv_bias=True), 4
    params = _random_params(config)
    original = jax.tree.map(np.copy, params)
    out = parallel.repeat_kv_heads(params, logical_specs(config), repeats)["params"]["layers"]["attn"]
    before = original["params"]["layers"]["attn"]
    assert out["k_proj"]["kernel"].shape == (2, 64, 2 * repeats, 16)
    assert out["v_proj"]["bias"].shape == (2, 2 * repeats, 16)
    N, K = config.num_heads, config.num_kv_heads
    for n in range(N):  # query head n reads KV head n // (N / K) before, n // (N / (K * r)) after
        for name in ("k_proj", "v_proj"):
            np.testing.assert_array_equal(before[name]["kernel"][:, :, n // (N // K)],
                                          out[name]["kernel"][:, :, n // (N // (K * repeats))])
            np.testing.assert_array_equal(before[name]["bias"][:, n // (N // K)],
                                          out[name]["bias"][:, n // (N // (K * repeats))])
    # Only the weights with a "kv_heads" axis change.
    np.testing.assert_array_equal(out["q_proj"]["kernel"], before["q_proj"]["kernel"])
    np.testing.assert_array_equal(params["params"]["embed"], original["params"]["embed"])


def test_one_kv_head_repeat_for_host_and_device_arrays():
    """The same function repeats host weights (numpy) and restored device weights (jax.numpy,
    inside jit), and the checkpoint's device path (jitted, placed on a mesh) gives the same."""
    from orca_jax.loading import checkpoint

    config, repeats = dataclasses.replace(_config(8, 2), model_type="qwen2", qkv_bias=True), 4
    host = parallel.repeat_kv_heads(_random_params(config), logical_specs(config), repeats)
    device_in = jax.tree.map(jnp.asarray, _random_params(config))
    on_device = jax.jit(functools.partial(parallel.repeat_kv_heads, logical=logical_specs(config), repeats=repeats, xp=jnp))(device_in)
    mesh = parallel.make_mesh(1)
    placed = checkpoint._repeat_kv_heads_on_device(jax.tree.map(jnp.asarray, _random_params(config)), config, mesh,
                                                   repeats)
    for result in (on_device, placed):
        assert jax.tree.structure(result) == jax.tree.structure(host)
        for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(host)):
            assert isinstance(a, jax.Array)
            np.testing.assert_array_equal(np.asarray(a), b)


# The specs every weight of each family had before its sharding was declared in the model
# (then a table of path patterns): tensor-parallel results must not change.
M = "model"
_LLAMA_SPECS = {
    "embed": P(M, None),
    "lm_head": P(None, M),
    "final_norm/scale": P(),
    "layers/input_norm/scale": P(),
    "layers/post_attention_norm/scale": P(),
    "layers/attn/q_proj/kernel": P(None, None, M, None),
    "layers/attn/k_proj/kernel": P(None, None, M, None),
    "layers/attn/v_proj/kernel": P(None, None, M, None),
    "layers/attn/o_proj/kernel": P(None, M, None, None),
    "layers/mlp/gate_proj/kernel": P(None, None, M),
    "layers/mlp/up_proj/kernel": P(None, None, M),
    "layers/mlp/down_proj/kernel": P(None, M, None),
}
_QKV_BIASES = {
    "layers/attn/q_proj/bias": P(None, M, None),
    "layers/attn/k_proj/bias": P(None, M, None),
    "layers/attn/v_proj/bias": P(None, M, None),
}
EXPECTED_SPECS = {
    # Llama with attention_bias and mlp_bias: every bias there is.
    "llama": {**_LLAMA_SPECS, **_QKV_BIASES, "layers/attn/o_proj/bias": P(),
              "layers/mlp/gate_proj/bias": P(None, M), "layers/mlp/up_proj/bias": P(None, M),
              "layers/mlp/down_proj/bias": P()},
    "qwen2": {**{k: v for k, v in _LLAMA_SPECS.items() if k != "lm_head"}, **_QKV_BIASES},  # tied
    "qwen3": {**_LLAMA_SPECS, "layers/attn/q_norm/scale": P(), "layers/attn/k_norm/scale": P()},
    "gpt2": {
        "embed": P(M, None),
        "pos_embed": P(),
        "final_norm/scale": P(), "final_norm/bias": P(),
        "layers/input_norm/scale": P(), "layers/input_norm/bias": P(),
        "layers/post_attention_norm/scale": P(), "layers/post_attention_norm/bias": P(),
        "layers/attn/q_proj/kernel": P(None, None, M, None),
        "layers/attn/k_proj/kernel": P(None, None, M, None),
        "layers/attn/v_proj/kernel": P(None, None, M, None),
        **_QKV_BIASES,
        "layers/attn/o_proj/kernel": P(None, M, None, None), "layers/attn/o_proj/bias": P(),
        "layers/mlp/fc/kernel": P(None, None, M), "layers/mlp/fc/bias": P(None, M),
        "layers/mlp/proj/kernel": P(None, M, None), "layers/mlp/proj/bias": P(),
    },
}
FAMILY_CONFIGS = {
    "llama": dict(qkv_bias=True, o_bias=True, mlp_bias=True),
    "qwen2": dict(model_type="qwen2", qkv_bias=True, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", qk_norm=True),
    "gpt2": dict(model_type="gpt2", num_kv_heads=8, qkv_bias=True, o_bias=True, mlp_bias=True,
                 tie_word_embeddings=True, hidden_act="gelu_new"),
}


def _family_config(family: str, **fields) -> ModelConfig:
    return dataclasses.replace(_config(8, 2), **{**FAMILY_CONFIGS[family], **fields})


@pytest.mark.parametrize("family", sorted(EXPECTED_SPECS))
def test_every_weight_of_each_family_keeps_its_spec(family):
    config = _family_config(family)
    specs = parallel.param_specs(nn.unbox(abstract_variables(config)), logical_specs(config), 2)
    assert parallel.tree_paths(specs["params"]) == EXPECTED_SPECS[family]


def test_a_dimension_that_does_not_divide_is_replicated_with_a_warning(caplog):
    config = _family_config("llama", vocab_size=513)
    with caplog.at_level("WARNING", logger="orca_jax.distributed.parallel"):
        specs = parallel.tree_paths(parallel.param_specs(nn.unbox(abstract_variables(config)), logical_specs(config), 2)["params"])
    assert specs["embed"] == P() and specs["lm_head"] == P()
    assert specs["layers/attn/q_proj/kernel"] == P(None, None, M, None)  # the rest as before
    assert "parameter embed (513, 64) does not divide by 2 devices: replicated" in caplog.text


class _Declares(nn.Module):
    """A module whose one weight declares `axes` (None: declares none)."""

    axes: tuple[str, ...] | None

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.ones if self.axes is None else nn.with_logical_partitioning(nn.initializers.ones,
                                                                                          self.axes)
        return x @ self.param("kernel", init, (x.shape[-1], 4))


def _logical_specs_of(module: nn.Module) -> dict:
    return parallel.logical_specs(jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((2, 3))))


def test_a_weight_without_logical_axes_is_refused():
    with pytest.raises(ValueError, match="parameter kernel declares no logical axes"):
        _logical_specs_of(_Declares(None))
    assert _logical_specs_of(_Declares(("embed", "mlp"))) == {"params": {"kernel": P("embed", "mlp")}}


def test_a_logical_axis_the_rules_do_not_map_is_refused():
    with pytest.raises(ValueError, match=r"parameter kernel has logical axes \['channels'\] that "
                                         r"parallel.LOGICAL_AXIS_RULES does not map"):
        _logical_specs_of(_Declares(("embed", "channels")))
    with pytest.raises(ValueError, match="parameter kernel of shape \\(3, 4\\) declares 1 logical axes"):
        _logical_specs_of(_Declares(("embed",)))


def test_a_weight_the_model_does_not_declare_is_refused():
    config = _family_config("llama")
    params = nn.unbox(abstract_variables(config))
    params = {"params": {**params["params"], "extra": {"kernel": np.zeros((4, 4))}}}
    with pytest.raises(ValueError, match="parameter extra/kernel is not one the model declares"):
        parallel.param_specs(params, logical_specs(config), 2)


def test_more_devices_than_there_are_is_refused(tiny_llama_dir):
    from orca_jax.engine.engine import LLMEngine

    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 devices.*xla_force_host_platform_device_count"):
        LLMEngine(model=str(tiny_llama_dir), tensor_parallel_size=2, warmup=False)
    # Head counts are checked first, with their own message (4 query heads, 3 devices).
    with pytest.raises(ValueError, match="must divide the number of query heads"):
        LLMEngine(model=str(tiny_llama_dir), tensor_parallel_size=3, warmup=False)


def test_one_device_keeps_the_unsharded_path(tiny_llama_dir):
    from jax.sharding import SingleDeviceSharding

    from orca_jax.engine.engine import LLMEngine

    engine = LLMEngine(model=str(tiny_llama_dir), max_num_seqs=2, max_num_batched_tokens=8, page_size=8,
                       num_pages=8, max_model_len=64, warmup=False)
    assert engine.runner.mesh is None and engine.runner.model.mesh is None and engine.channel is None
    assert isinstance(engine.runner.kv_cache.sharding, SingleDeviceSharding)
