"""The mixture-of-experts families: the Llama-family block with its MLP replaced by a
`moe.SparseMoE` layer, and the attention of the dense family each one extends.

    model_type  transformers class         attention as    router                 shared expert
    mixtral     MixtralForCausalLM         mistral         softmax, top-k renorm  -
    qwen2_moe   Qwen2MoeForCausalLM        qwen2 (biases)  softmax, norm_topk_prob  sigmoid-gated
    qwen3_moe   Qwen3MoeForCausalLM        qwen3 (QK norm) softmax, norm_topk_prob  -

Every layer must be a mixture-of-experts one: the layers run as one scan over stacked weights,
so checkpoints that mix dense layers in (`mlp_only_layers`, `decoder_sparse_step` > 1) are
refused. The released Mixtral, Qwen1.5/2-MoE and Qwen3-MoE checkpoints have none.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import numpy as np

from orca_jax.config import ModelConfig
from orca_jax.kernels.metadata import AttentionMetadata
from orca_jax.models import llama
from orca_jax.models.hf_weights import HFTensors
from orca_jax.models.moe import SparseMoE

# The dense family whose attention (and config switches) each MoE family shares.
ATTENTION_FAMILY = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}
# Where the router and experts live in each family's HF checkpoint, and its per-expert names
# of the gate, up and down projections.
HF_MOE_PREFIX = {"mixtral": "block_sparse_moe", "qwen2_moe": "mlp", "qwen3_moe": "mlp",
                 "gpt_oss": "mlp"}  # gpt-oss runs this block too, read by its own converter (gpt_oss.py)
_HF_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                    "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


class MoEDecoderBlock(llama.DecoderBlock):
    @nn.nowrap
    def feed_forward(self, x, metadata: AttentionMetadata):
        # cu_q_lens' last entry is the step's real token count; the bucket's rest is padding.
        return SparseMoE(self.config, self.dtype, self.mesh, name="moe")(x, metadata.cu_q_lens[-1])


class MoEForCausalLM(llama.LlamaForCausalLM):
    block: ClassVar[type[llama.DecoderBlock]] = MoEDecoderBlock


def config_from_hf(cfg: dict[str, Any], model_type: str) -> ModelConfig:
    """HF `config.json` of Mixtral, Qwen2-MoE or Qwen3-MoE: the dense family's fields, then the
    experts'."""
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{model_type}: dense MLP layers among the expert layers (mlp_only_layers "
                         f"{cfg.get('mlp_only_layers')}, decoder_sparse_step {cfg.get('decoder_sparse_step')}) are "
                         "not supported: the layers run as one scan of identical blocks")
    dense = llama.config_from_hf(cfg, ATTENTION_FAMILY[model_type])
    if model_type == "qwen2_moe" and "qkv_bias" in cfg:  # transformers 5 spells Qwen2-MoE's biases out
        dense = dataclasses.replace(dense, qkv_bias=bool(cfg["qkv_bias"]))
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not num_experts:
        raise ValueError(f"{model_type} config has no expert count (num_local_experts / num_experts)")
    return dataclasses.replace(
        dense,
        model_type=model_type,
        num_experts=num_experts,
        num_experts_per_tok=cfg["num_experts_per_tok"],
        # Mixtral's experts are as wide as its `intermediate_size`; the Qwens give them their own.
        moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
        # Mixtral always renormalises its top-k; the Qwens say whether in their config.
        norm_topk_prob=model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        router_scoring="softmax",
    )


def hf_to_params(tensors: dict[str, np.ndarray], c: ModelConfig) -> dict[str, Any]:
    """HF MoE names -> the Flax tree of `MoEForCausalLM`: the dense family's attention, norms and
    embeddings (`llama.hf_to_params` without its MLP), then the router and the experts stacked
    [L, E, ...]. Experts are read as HF checkpoints store them (one tensor per expert and
    projection), or already stacked: transformers' fused `experts.gate_up_proj` [E, 2F, D] with
    `experts.down_proj` [E, D, F], or one `experts.{gate,up,down}_proj` [E, out, in] per
    projection (the GGUF loader's names for llama.cpp's `ffn_*_exps`). Consumes `tensors`."""
    t = HFTensors(tensors, c.num_layers, "model.layers")
    prefix = f"model.layers.{{}}.{HF_MOE_PREFIX[c.model_type]}"
    moe = t.stack_layers(lambda i: _hf_moe_layer(t, c, prefix.format(i)))
    params = llama.hf_to_params(tensors, c, with_mlp=False)
    params["params"]["layers"]["moe"] = moe
    return params


def _hf_moe_layer(t: HFTensors, c: ModelConfig, prefix: str) -> dict[str, Any]:
    gate, up, down = _hf_experts(t, c, f"{prefix}.experts")
    layer = {"router": t.take(f"{prefix}.gate.weight").T,  # [E, D] -> [D, E]
             "gate_proj": gate, "up_proj": up, "down_proj": down}
    if c.shared_expert_intermediate_size:
        shared = f"{prefix}.shared_expert"
        layer["shared_expert"] = {name: {"kernel": t.take(f"{shared}.{name}.weight").T}
                                  for name in ("gate_proj", "up_proj", "down_proj")}
        layer["shared_expert_gate"] = t.take(f"{prefix}.shared_expert_gate.weight").reshape(-1)  # [1, D] -> [D]
    return layer


def _hf_experts(t: HFTensors, c: ModelConfig, prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer's experts as (gate [E, D, F], up [E, D, F], down [E, F, D])."""
    F = c.moe_intermediate_size
    if t.has(f"{prefix}.gate_up_proj"):  # transformers' fused layout
        gate_up = t.take(f"{prefix}.gate_up_proj")  # [E, 2F, D]
        down = t.take(f"{prefix}.down_proj")  # [E, D, F]
        return gate_up[:, :F].transpose(0, 2, 1), gate_up[:, F:].transpose(0, 2, 1), down.transpose(0, 2, 1)
    if t.has(f"{prefix}.gate_proj"):  # stacked per projection, [E, out, in]
        return tuple(t.take(f"{prefix}.{name}").transpose(0, 2, 1) for name in ("gate_proj", "up_proj", "down_proj"))
    names = _HF_EXPERT_NAMES[c.model_type]
    return tuple(np.stack([t.take(f"{prefix}.{e}.{name}.weight").T for e in range(c.num_experts)])
                 for name in names)
