"""Mixture-of-experts models on a mesh (orca_jax/distributed/parallel.py, orca_jax/models/moe.py): tensor
parallelism splits every expert's intermediate axis, expert parallelism places whole experts per
device, the attention tensor-parallel on the same devices either way.

The sharded runs go through tests/parallel_worker.py on 8 forced host devices (see
tests/distributed/test_parallel.py): a tiny Qwen2-MoE (8 experts, top-2, a shared expert, Q/K/V biases)
through the engine at tensor-parallel sizes 2 and 4 and expert-parallel sizes 2 and 4, against
one device. The layout rules are checked here, in-process.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import pytest
from jax.sharding import PartitionSpec as P

from orca_jax.distributed import parallel
from orca_jax.config import ModelConfig
from orca_jax.models import abstract_variables, logical_specs

LOGIT_ATOL = 1e-5
SIZES = ("2", "4", "ep@2", "ep@4")


@pytest.fixture(scope="module")
def moe_runs(tiny_hf_model_factory, run_parallel_worker) -> dict:
    model = tiny_hf_model_factory(
        "Qwen2MoeConfig", seed=2, random_biases=True, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=2, initializer_range=0.1,
        intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=96, num_experts=8,
        norm_topk_prob=False)
    return run_parallel_worker("tp", str(model), ",".join(("1", *SIZES)))


def test_tokens_identical_to_one_device(moe_runs):
    one = moe_runs["1"]
    assert one["steps"] >= 4 and all(len(t) == 6 for t in one["sampled"])
    for size in SIZES:
        result = moe_runs[size]
        assert result["greedy"] == one["greedy"] and result["sampled"] == one["sampled"], size
        assert result["max_logit_diff"] < LOGIT_ATOL, (size, result["max_logit_diff"])


@pytest.mark.parametrize("size", SIZES)
def test_experts_are_split_as_the_mode_says(moe_runs, size):
    result = moe_runs[size]
    devices = int(size.rpartition("@")[2])
    L, E, D, F = 2, 8, 64, 32
    if size.startswith("ep@"):  # whole experts, E / devices of them per device
        assert result["moe_specs"]["gate_proj"] == str(P(None, "model", None, None))
        assert result["moe_specs"]["down_proj"] == str(P(None, "model", None, None))
        assert result["moe_shard_shapes"] == {"gate_proj": [L, E // devices, D, F],
                                              "down_proj": [L, E // devices, F, D]}
    else:  # every expert, a slice of its intermediate axis
        assert result["moe_specs"]["gate_proj"] == str(P(None, None, None, "model"))
        assert result["moe_specs"]["down_proj"] == str(P(None, None, "model", None))
        assert result["moe_shard_shapes"] == {"gate_proj": [L, E, D, F // devices],
                                              "down_proj": [L, E, F // devices, D]}
    assert result["moe_specs"]["router"] == str(P())
    # The attention stays tensor-parallel on the same devices.
    assert result["param_specs"]["q_proj"] == str(P(None, None, "model", None))


@pytest.mark.parametrize("size", SIZES)
def test_one_all_reduce_combines_the_experts_no_all_to_all(moe_runs, size):
    """Tokens are whole on every device after the attention's all-reduce, so nothing is
    dispatched: each device runs its experts' rows and one all-reduce per layer sums them
    (XLA may fold the shared expert's partial sum into the same collective)."""
    hlo = moe_runs[size]["hlo"]
    assert hlo["all_to_all"] == 0
    assert hlo["all_reduce_moe"] == 1 and hlo["all_reduce_o_proj"] == 1
    assert hlo["in_layer_loop"] in (2, 3)  # o_proj, experts, shared expert (when not folded in)
    # The only gather is of the [S, V] logits: no expert weight moves.
    assert [s.split("{")[0] for s in hlo["all_gather_shapes"]] == ["f32[4,512]"]


# ---- the layout rules, in-process -------------------------------------------------------------
def _moe_config(**fields) -> ModelConfig:
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, model_type="qwen2_moe", qkv_bias=True, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=96)
    return ModelConfig(**{**base, **fields})


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_every_moe_weight_gets_its_spec(expert_parallel):
    config = parallel.expert_layout(_moe_config(), 4, expert_parallel)
    specs = parallel.tree_paths(parallel.param_specs(nn.unbox(abstract_variables(config)), logical_specs(config),
                                                     4)["params"])
    M = "model"
    experts = ({"gate_proj": P(None, M, None, None), "up_proj": P(None, M, None, None),
                "down_proj": P(None, M, None, None)} if expert_parallel else
               {"gate_proj": P(None, None, None, M), "up_proj": P(None, None, None, M),
                "down_proj": P(None, None, M, None)})
    moe = {name[len("layers/moe/"):]: spec for name, spec in specs.items() if name.startswith("layers/moe/")}
    assert moe == {**experts, "router": P(),
                   # The shared expert is a dense MLP: tensor-parallel in both modes.
                   "shared_expert/gate_proj/kernel": P(None, None, M), "shared_expert/up_proj/kernel": P(None, None, M),
                   "shared_expert/down_proj/kernel": P(None, M, None), "shared_expert_gate": P()}


def test_layouts_the_sizes_do_not_allow_are_refused():
    with pytest.raises(ValueError, match=r"expert parallelism over 3 devices needs the experts \(8\) to divide"):
        parallel.expert_layout(_moe_config(), 3, True)
    with pytest.raises(ValueError, match=r"splits each expert's intermediate axis \(30\).*enable_expert_parallel"):
        parallel.expert_layout(_moe_config(moe_intermediate_size=30), 4, False)
    # ... where the other mode fits.
    assert parallel.expert_layout(_moe_config(moe_intermediate_size=30), 4, True).expert_parallel
    dense = dataclasses.replace(_moe_config(), num_experts=0, num_experts_per_tok=0, model_type="qwen2")
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts model; qwen2 is dense"):
        parallel.expert_layout(dense, 2, True)
    assert parallel.expert_layout(dense, 2, False) is dense


# ---- gpt-oss: biased router and experts, clamped SwiGLU, sinks; float and MXFP4 experts --------
GPT_OSS = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=8,
               max_position_embeddings=256, initializer_range=0.1)
GPT_OSS_SIZES = ("2", "ep@2")


@pytest.fixture(scope="module")
def gpt_oss_runs(tiny_hf_model_factory, make_mxfp4_checkpoint, run_parallel_worker) -> dict:
    """The tiny gpt-oss at tensor and expert parallelism 2, float and MXFP4 (its down
    projection's packed axis holds two blocks of 32, so tensor parallelism splits whole blocks)."""
    float_dir = tiny_hf_model_factory("GptOssConfig", seed=4, random_biases=True, **GPT_OSS)
    packed_dir, _ = make_mxfp4_checkpoint(float_dir)
    return {kind: run_parallel_worker("tp", str(directory), ",".join(("1", *GPT_OSS_SIZES)))
            for kind, directory in (("float", float_dir), ("mxfp4", packed_dir))}


@pytest.mark.parametrize("kind", ["float", "mxfp4"])
def test_gpt_oss_tokens_identical_to_one_device(gpt_oss_runs, kind):
    runs = gpt_oss_runs[kind]
    one = runs["1"]
    for size in GPT_OSS_SIZES:
        print(f"gpt_oss {kind} {size}: max |logit diff| to one device {runs[size]['max_logit_diff']:.2e}")
        assert runs[size]["greedy"] == one["greedy"] and runs[size]["sampled"] == one["sampled"], size
        assert runs[size]["max_logit_diff"] < LOGIT_ATOL, (size, runs[size]["max_logit_diff"])


def test_gpt_oss_packed_experts_split_as_the_mode_says(gpt_oss_runs):
    """Tensor parallelism splits the packed rows of gate/up (F) and the packed axis of down
    (whole blocks of 32: bytes and scales alike); expert parallelism whole experts. The
    down-projection bias stays whole (added once, after the all-reduce)."""
    L, E, D, F = 2, 6, 64, 64
    tp, ep = gpt_oss_runs["mxfp4"]["2"], gpt_oss_runs["mxfp4"]["ep@2"]
    assert tp["moe_shard_shapes"] == {"gate_proj_blocks": [L, E, F // 2, D // 2],
                                      "down_proj_blocks": [L, E, D, F // 2 // 2],
                                      "down_proj_scales": [L, E, D, F // 32 // 2]}
    assert ep["moe_shard_shapes"] == {"gate_proj_blocks": [L, E // 2, F, D // 2],
                                      "down_proj_blocks": [L, E // 2, D, F // 2],
                                      "down_proj_scales": [L, E // 2, D, F // 32]}
    assert tp["moe_specs"]["down_bias"] == str(P()) == ep["moe_specs"]["down_bias"]
    assert tp["hlo"]["all_reduce_moe"] == 1 and tp["hlo"]["all_to_all"] == 0


def test_gpt_oss_mxfp4_tensor_parallel_needs_whole_blocks_per_device():
    from orca_jax.models import config_from_hf

    config = dataclasses.replace(config_from_hf({**GPT_OSS, "model_type": "gpt_oss", "intermediate_size": 32}),
                                 expert_format="mxfp4")
    with pytest.raises(ValueError, match="1 blocks of 32, which do not divide by 2; enable_expert_parallel"):
        parallel.expert_layout(config, 2, False)
    assert parallel.expert_layout(config, 2, True).expert_parallel
