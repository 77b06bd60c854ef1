"""Phi-3 and Phi-4-mini (`phi3`): the Llama block, stored with fused projections.

The checkpoint keeps Q, K and V as one `qkv_proj` ([N + 2K heads of H, D], in that order) and
the MLP's gate and up as one `gate_up_proj` ([2F, D], gate first); they are split at load into
the Llama block's own kernels, so the block, its sharding and quantization are the Llama
ones. What else differs is configuration: LongRoPE scaling (short and long factors,
orca_jax/models/rope.py), partial rotary (Phi-4-mini rotates 3/4 of each head), and a sliding
window on every layer where the config sets one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from orca_jax.config import ModelConfig
from orca_jax.models import hf_config, llama


def config_from_hf(cfg: dict[str, Any], model_type: str) -> ModelConfig:
    """HF `config.json` of Phi-3 / Phi-4-mini."""
    num_heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    rope_theta, rope_scaling = hf_config.rope_from_hf(cfg)
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or hidden // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        partial_rotary_factor=hf_config.partial_rotary_factor_from_hf(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        hidden_act=cfg.get("hidden_act", "silu"),
        sliding_window=cfg.get("sliding_window"),
        eos_token_ids=hf_config.eos_token_ids(cfg),
        model_type=model_type,
    )


def hf_to_params(tensors: dict[str, np.ndarray], c: ModelConfig) -> dict[str, Any]:
    """HF Phi-3 names -> the Flax tree of `LlamaForCausalLM`: the fused projections split into
    the Llama names first. Consumes `tensors`."""
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i in range(c.num_layers):
        prefix = f"model.layers.{i}"
        q, k, v = np.split(tensors.pop(f"{prefix}.self_attn.qkv_proj.weight"), [q_rows, q_rows + kv_rows])
        tensors.update({f"{prefix}.self_attn.q_proj.weight": q, f"{prefix}.self_attn.k_proj.weight": k,
                        f"{prefix}.self_attn.v_proj.weight": v})
        gate, up = np.split(tensors.pop(f"{prefix}.mlp.gate_up_proj.weight"), 2)
        tensors.update({f"{prefix}.mlp.gate_proj.weight": gate, f"{prefix}.mlp.up_proj.weight": up})
    return llama.hf_to_params(tensors, c)
