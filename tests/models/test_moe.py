"""The mixture-of-experts layer (orca_jax/models/moe.py) against a float64 numpy reference that
runs every expert on every token and keeps the chosen ones; the MoE families' config fields
(orca_jax/models/moe_families.py); and what the engine promises for them: nothing compiles
after warm-up, weight quantization is refused clearly. HF parity is tests/models/test_model_families.py."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax import SamplingParams
from orca_jax.worker.compile_guard import compile_count, no_compiles
from orca_jax.config import ModelConfig
from orca_jax.models import config_from_hf, quantize_params
from orca_jax.models.moe import SparseMoE, combine, group_by_expert, route

ATOL = 1e-5
T, D, E, K = 16, 32, 8, 2


def _config(**fields) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=D, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                head_dim=8, model_type="qwen2_moe", num_experts=E, num_experts_per_tok=K, moe_intermediate_size=24)
    return ModelConfig(**{**base, **fields})


def reference_moe(x, p, config: ModelConfig, num_tokens: int):
    """Every expert on every token (float64), then each token's top-k mixed; padding tokens
    (index >= num_tokens) get only the shared expert."""
    x = np.asarray(x, np.float64)
    silu = lambda h: h / (1 + np.exp(-h))  # noqa: E731
    logits = x @ np.asarray(p["router"], np.float64)
    if config.router_scoring == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    out = np.zeros_like(x)
    for t in range(num_tokens):
        chosen = np.argsort(-scores[t])[: config.num_experts_per_tok]
        weights = scores[t, chosen]
        if config.norm_topk_prob:
            weights = weights / weights.sum()
        for e, w in zip(chosen, weights):
            h = silu(x[t] @ p["gate_proj"][e]) * (x[t] @ p["up_proj"][e])
            out[t] += w * (h @ p["down_proj"][e])
    if config.shared_expert_intermediate_size:
        s = p["shared_expert"]
        h = silu(x @ s["gate_proj"]["kernel"]) * (x @ s["up_proj"]["kernel"])
        gate = 1 / (1 + np.exp(-(x @ p["shared_expert_gate"])))
        out += gate[:, None] * (h @ s["down_proj"]["kernel"])
    return out


def _init(config: ModelConfig, seed: int = 0, num_tokens: int = T):
    module = SparseMoE(config)
    x = jax.random.normal(jax.random.key(seed), (num_tokens, D))
    params = nn.unbox(module.init(jax.random.key(seed + 1), x, jnp.int32(num_tokens)))
    # A router of unit scale, so that the choice of experts varies from token to token.
    params["params"]["router"] = jax.random.normal(jax.random.key(seed + 2), (D, config.num_experts))
    return module, x, params


@pytest.mark.parametrize("fields", [
    dict(),  # softmax, top-k scores kept (Qwen2-MoE without its shared expert)
    dict(norm_topk_prob=True),  # renormalised (Mixtral, Qwen3-MoE)
    dict(shared_expert_intermediate_size=40),  # Qwen2-MoE's sigmoid-gated shared expert
    dict(router_scoring="sigmoid", norm_topk_prob=True, num_experts_per_tok=3),
    dict(num_experts_per_tok=E),  # every expert
])
@pytest.mark.parametrize("num_tokens", [T, 5])  # a full bucket, and one mostly padding
def test_layer_matches_the_reference(fields, num_tokens):
    config = _config(**fields)
    module, x, params = _init(config)
    out = jax.jit(module.apply)(params, x, jnp.int32(num_tokens))
    expected = reference_moe(x, jax.tree.map(np.asarray, params["params"]), config, num_tokens)
    np.testing.assert_allclose(np.asarray(out)[:num_tokens], expected[:num_tokens], atol=ATOL, rtol=0)
    if not config.shared_expert_intermediate_size:
        assert not np.asarray(out)[num_tokens:].any()  # padding tokens cost the experts nothing


def test_some_experts_get_no_rows():
    """Five tokens, top-2 of 8: at least six (token, choice) pairs short of one per expert, so
    some groups are empty, and the layer still matches (the parametrized case above with 5)."""
    config = _config()
    _, x, params = _init(config)
    _, experts = route(x[:5] @ params["params"]["router"], K, "softmax", False)
    assert len(set(np.asarray(experts).ravel().tolist())) < E


def test_route_normalises_only_when_asked():
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
    w, e = route(logits, 2, "softmax", False)
    probs = np.exp([2.0, 1.0, 0.0, -1.0]) / np.exp([2.0, 1.0, 0.0, -1.0]).sum()
    np.testing.assert_allclose(np.asarray(w)[0], probs[:2], rtol=1e-6)
    assert np.asarray(e).tolist() == [[0, 1]]
    w, _ = route(logits, 2, "softmax", True)
    np.testing.assert_allclose(np.asarray(w).sum(), 1.0, rtol=1e-6)
    w, _ = route(logits, 2, "sigmoid", False)
    np.testing.assert_allclose(np.asarray(w)[0], 1 / (1 + np.exp([-2.0, -1.0])), rtol=1e-6)


def test_grouping_sorts_by_expert_and_leaves_out_padding_and_other_shards():
    experts = jnp.array([[3, 1], [0, 3], [2, 1], [1, 0]])  # token 3 is padding
    order, sizes = group_by_expert(experts, jnp.int32(3), 0, 4)
    assert np.asarray(sizes).tolist() == [1, 2, 1, 2]
    flat = np.asarray(experts).ravel()
    assert flat[np.asarray(order)[:6]].tolist() == [0, 1, 1, 2, 3, 3]
    assert sorted(np.asarray(order)[6:].tolist()) == [6, 7]  # the padding token's pairs, last
    # The shard holding experts 2 and 3 (expert parallelism, second of two devices).
    order, sizes = group_by_expert(experts, jnp.int32(3), 2, 2)
    assert np.asarray(sizes).tolist() == [1, 2]
    assert flat[np.asarray(order)[:3]].tolist() == [2, 3, 3]


def test_combine_inverts_the_sort():
    rng = np.random.default_rng(0)
    per_pair = rng.standard_normal((8, 3)).astype(np.float32)  # [T*k, D] in pair order
    order = jnp.asarray(rng.permutation(8))
    weights = jnp.asarray(rng.random((4, 2)).astype(np.float32))
    out = combine(jnp.asarray(per_pair)[order], order, weights)
    expected = (per_pair.reshape(4, 2, 3) * np.asarray(weights)[..., None]).sum(1)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6)


def test_no_tokens_by_experts_by_hidden_array_on_the_cpu_path():
    """The blocked path builds nothing of shape [rows, experts, hidden] (any order); jax's
    generic ragged_dot lowering does (the check would catch it), which is why CPU does not use it."""
    # Sizes that no two axes share: 12 tokens, 24 (token, choice) rows, hidden 32, width 20, 4 experts.
    config = _config(num_experts=4, moe_intermediate_size=20)
    module, x, params = _init(config, num_tokens=12)
    hlo = jax.jit(module.apply).lower(params, x, jnp.int32(12)).compile().as_text()
    shapes = {tuple(int(d) for d in s.split(",")) for s in re.findall(r"f32\[([\d,]+)\]", hlo)}
    rows = {12, 12 * K}

    def dense_expansion(shape):
        return len(shape) == 3 and 4 in shape and D in shape and rows & set(shape)

    assert not [s for s in shapes if dense_expansion(s)]
    from orca_jax.kernels import grouped_mlp

    generic = jax.jit(lambda r, s, g: grouped_mlp.grouped_matmul(r, g, s, "ragged_dot")).lower(
        jnp.zeros((12 * K, D)), jnp.zeros(4, jnp.int32), jnp.zeros((4, D, 20))).compile().as_text()
    generic_shapes = {tuple(int(d) for d in s.split(",")) for s in re.findall(r"f32\[([\d,]+)\]", generic)}
    assert [s for s in generic_shapes if dense_expansion(s)]


# ---- config fields of the families ----------------------------------------------------------
_HF = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, num_experts_per_tok=2)


def test_mixtral_fields():
    c = config_from_hf({**_HF, "model_type": "mixtral", "num_local_experts": 8, "sliding_window": None})
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 64)  # experts as wide as intermediate_size
    assert c.norm_topk_prob and c.shared_expert_intermediate_size == 0 and not c.qkv_bias and not c.qk_norm


def test_qwen_moe_fields():
    c = config_from_hf({**_HF, "model_type": "qwen2_moe", "num_experts": 60, "moe_intermediate_size": 16,
                        "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "use_sliding_window": False})
    assert (c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (60, 16, 48)
    assert c.qkv_bias and not c.o_bias and not c.norm_topk_prob
    c = config_from_hf({**_HF, "model_type": "qwen3_moe", "num_experts": 128, "moe_intermediate_size": 16,
                        "norm_topk_prob": True, "head_dim": 16})
    assert c.qk_norm and c.norm_topk_prob and c.head_dim == 16 and c.shared_expert_intermediate_size == 0
    assert config_from_hf({**_HF, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4}).model_type == "qwen3_moe"


@pytest.mark.parametrize("mixed", [dict(mlp_only_layers=[0]), dict(decoder_sparse_step=2)])
def test_dense_layers_among_expert_layers_are_refused(mixed):
    with pytest.raises(ValueError, match="dense MLP layers among the expert layers .* one scan"):
        config_from_hf({**_HF, "model_type": "qwen3_moe", "num_experts": 4, **mixed})


def test_weight_quantization_is_refused_clearly():
    config = _config(quantization="int8")
    with pytest.raises(ValueError, match="weight quantization \\(int8\\) of mixture-of-experts models is not supported"):
        quantize_params({"params": {}}, config)


# ---- the engine -----------------------------------------------------------------------------
def test_no_compiles_after_warmup(tiny_hf_model_factory):
    from orca_jax.engine.engine import LLMEngine

    directory = tiny_hf_model_factory(
        "Qwen3MoeConfig", seed=4, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, head_dim=16, norm_topk_prob=True)
    engine = LLMEngine(model=str(directory), max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=48,
                       max_model_len=128, min_token_bucket=16)  # two buckets: warm-up covers more than one
    compile_count()
    rng = np.random.default_rng(5)
    with no_compiles("serving a mixture of experts"):
        for i, n in enumerate((3, 40, 17, 9, 25)):
            params = SamplingParams(max_tokens=6 + i, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
            engine.add_request(f"r{i}", rng.integers(3, 500, size=n).tolist(), params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    assert len(done) == 5 and engine.allocator.num_used == 0
