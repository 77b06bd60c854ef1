"""gpt-oss (OpenAI's gpt-oss-20b and gpt-oss-120b): the Llama-family block with a mixture of
experts as its MLP (`moe_families.MoEForCausalLM`), and these switches from its config:

- attention: biases on all four projections, a learned sink logit per query head
  (`attention_sinks`), sliding (128-token) and full layers alternating (`layer_types`), YaRN RoPE
  (factor 32 over a 4,096-token pretraining context), grouped-query heads (64 of 64 dims, 8 KV);
- experts: the router with a bias, its top-k logits softmaxed (the same weights as the whole
  softmax renormalised over the top k, `norm_topk_prob`), biases on every expert projection
  (`moe_bias`), the clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`; orca_jax/models/moe.py);
- weights: the released checkpoints store the experts in MXFP4 (`*_blocks`, `*_scales`), kept
  packed (`expert_format="mxfp4"`, orca_jax/kernels/packed4.py); the rest is bfloat16.

HF keeps each expert's gate and up projections interleaved in one `gate_up_proj` (gate in the
even output channels, up in the odd ones); they are split here into the separate stacks the
grouped matmuls take.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from orca_jax.config import ModelConfig
from orca_jax.models import llama, moe_families
from orca_jax.models.hf_weights import HFTensors

# transformers' GptOssConfig defaults for what a config.json may leave out (gpt-oss-20b's file
# spells most of them out; tests/models/test_gpt_oss.py checks these against transformers).
HF_DEFAULTS = dict(
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_local_experts=128,
    num_experts_per_tok=4, head_dim=64, num_attention_heads=64, num_key_value_heads=8, sliding_window=128,
    rms_norm_eps=1e-5, max_position_embeddings=131072, swiglu_alpha=1.702, swiglu_limit=7.0,
    attention_bias=True, tie_word_embeddings=False, hidden_act="silu",
)
DEFAULT_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096, rope_theta=150000.0)
# The model that runs it: the mixture-of-experts decoder, with this family's switches.
MODEL_CLASS = moe_families.MoEForCausalLM
# HF's name for the experts' packed format (`quantization_config.quant_method`).
MXFP4 = "mxfp4"


def config_from_hf(cfg: dict[str, Any], model_type: str) -> ModelConfig:
    """HF `config.json` of gpt-oss (`model_type` "gpt_oss"; a GGUF file's metadata comes as one)."""
    cfg = {**HF_DEFAULTS, **cfg}
    theta = cfg.get("rope_theta", DEFAULT_ROPE["rope_theta"])
    if not (cfg.get("rope_scaling") or cfg.get("rope_parameters")):
        cfg["rope_parameters"] = dict(DEFAULT_ROPE, rope_theta=theta)
    elif cfg.get("rope_scaling"):  # the YaRN keys a GGUF file does not write are gpt-oss's own
        cfg["rope_scaling"] = {**{k: v for k, v in DEFAULT_ROPE.items() if k != "rope_theta"}, **cfg["rope_scaling"]}
    if not cfg.get("layer_types"):  # transformers' default: sliding first, then every other layer
        cfg["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                              for i in range(cfg["num_hidden_layers"])]
    dense = llama.config_from_hf(cfg, "llama")
    return dataclasses.replace(
        dense,
        model_type=model_type,
        attention_sinks=True,
        num_experts=cfg["num_local_experts"],
        # gpt-oss's own files name it `experts_per_token` as well; transformers reads this one.
        num_experts_per_tok=cfg.get("num_experts_per_tok") or cfg["experts_per_token"],
        moe_intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=True,
        router_scoring="softmax",
        moe_bias=True,
        swiglu_limit=float(cfg["swiglu_limit"]),
        swiglu_alpha=float(cfg["swiglu_alpha"]),
        expert_format=_expert_format(cfg),
    )


def _expert_format(cfg: dict[str, Any]) -> str | None:
    quantization = cfg.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method != MXFP4:
        raise ValueError(f"gpt_oss: quantization_config quant_method {method!r} is not supported; the released "
                         f"checkpoints' {MXFP4!r} is (or float weights without a quantization_config)")
    return MXFP4


def hf_to_params(tensors: dict[str, np.ndarray], c: ModelConfig) -> dict[str, Any]:
    """HF gpt-oss names -> the Flax tree of `MoEForCausalLM`: Llama's attention, norms and
    embeddings with the sinks, then the router and the experts stacked [L, E, ...], packed or
    float as the checkpoint holds them (and as `c.expert_format` says). Consumes `tensors`."""
    t = HFTensors(tensors, c.num_layers, "model.layers")
    moe = t.stack_layers(lambda i: _hf_moe_layer(t, c, f"model.layers.{i}.mlp"))
    sinks = t.per_layer("self_attn.sinks")
    params = llama.hf_to_params(tensors, c, with_mlp=False)
    params["params"]["layers"]["attn"]["sinks"] = sinks
    params["params"]["layers"]["moe"] = moe
    return params


def _hf_moe_layer(t: HFTensors, c: ModelConfig, prefix: str) -> dict[str, Any]:
    experts = f"{prefix}.experts"
    router = f"{prefix}.router" if t.has(f"{prefix}.router.weight") else f"{prefix}.gate"  # GGUF's name
    layer = {
        "router": t.take(f"{router}.weight").T,  # [E, D] -> [D, E]
        "router_bias": t.take(f"{router}.bias"),
        "down_bias": t.take(f"{experts}.down_proj_bias"),
    }
    if t.has(f"{experts}.gate_proj"):  # a GGUF file's: one stack per projection, [E, out, in]
        layer.update({f"{name}_bias": t.take(f"{experts}.{name}_proj_bias") for name in ("gate", "up")})
        layer.update({f"{name}_proj": t.take(f"{experts}.{name}_proj").transpose(0, 2, 1)
                      for name in ("gate", "up", "down")})
        return layer
    gate_up_bias = t.take(f"{experts}.gate_up_proj_bias")  # [E, 2F], gate even, up odd
    layer.update(gate_bias=gate_up_bias[:, 0::2], up_bias=gate_up_bias[:, 1::2])
    packed = t.has(f"{experts}.gate_up_proj_blocks")
    if packed != (c.expert_format == MXFP4):
        held = "MXFP4 blocks" if packed else "float experts"
        raise ValueError(f"gpt_oss: the checkpoint holds {held} but its config's quantization_config says "
                         f"{c.expert_format or 'none'}")
    if packed:
        layer.update(_hf_packed_experts(t, experts))
    else:
        gate_up = t.take(f"{experts}.gate_up_proj")  # [E, D, 2F]
        layer.update(gate_proj=gate_up[:, :, 0::2], up_proj=gate_up[:, :, 1::2],
                     down_proj=t.take(f"{experts}.down_proj"))  # [E, F, D]
    return layer


def _hf_packed_experts(t: HFTensors, experts: str) -> dict[str, np.ndarray]:
    """MXFP4 experts as stored ([E, out, in / 32, 16] codes, [E, out, in / 32] scales) -> the
    packed leaves, [E, out, in / 2] and [E, out, in / 32], gate and up split by output channel."""
    def blocks(name: str) -> tuple[np.ndarray, np.ndarray]:
        codes = t.take(f"{experts}.{name}_blocks")
        return codes.reshape(*codes.shape[:2], -1), t.take(f"{experts}.{name}_scales")

    gate_up, gate_up_scales = blocks("gate_up_proj")
    down, down_scales = blocks("down_proj")
    return {"gate_proj_blocks": gate_up[:, 0::2], "gate_proj_scales": gate_up_scales[:, 0::2],
            "up_proj_blocks": gate_up[:, 1::2], "up_proj_scales": gate_up_scales[:, 1::2],
            "down_proj_blocks": down, "down_proj_scales": down_scales}
