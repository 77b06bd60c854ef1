"""GPT-2 (standing in for Orca's GPT-3 family) on the flattened token axis.

    x = wte[ids] + wpe[positions];  h = x + attn(ln_1(x));  out = h + mlp(ln_2(h))

Unlike the Llama family: learned absolute positions (each token's own position indexes `wpe`,
so chunked prefill and decode need nothing special), LayerNorm with a bias, a GELU MLP
without a gate, biases everywhere, multi-head attention without RoPE, tied head. The
attention, the layer scan and the paged cache are the shared ones.
"""

from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from orca_jax.kernels import quantization
from orca_jax.config import ModelConfig
from orca_jax.models import hf_config
from orca_jax.models.hf_weights import HFTensors
from orca_jax.models.layers import MLP, LayerNorm
from orca_jax.models.llama import DecoderBlock, LlamaForCausalLM


class GPT2Block(DecoderBlock):
    """The pre-norm block with GPT-2's parts: LayerNorm, an ungated GELU MLP, no RoPE."""

    norm_cls: ClassVar[type[nn.Module]] = LayerNorm
    uses_rope: ClassVar[bool] = False

    @nn.nowrap
    def make_mlp(self) -> nn.Module:
        c = self.config
        return MLP(c.hidden_size, c.intermediate_size, c.mlp_bias, self.dtype, c.hidden_act, c.quantization,
                   name="mlp")


class GPT2ForCausalLM(LlamaForCausalLM):
    block: ClassVar[type[DecoderBlock]] = GPT2Block

    @nn.nowrap
    def embed(self, embedding, input_ids, positions):
        """Token plus learned absolute position embeddings, each token at its own position."""
        c = self.config
        table = self.param(
            "pos_embed", nn.with_logical_partitioning(nn.initializers.normal(0.01), ("positions", "embed")),
            (c.max_position_embeddings, c.hidden_size), self.dtype,
        )
        return quantization.take_rows(embedding, input_ids, self.dtype) + jnp.take(table, positions, axis=0)


def hf_to_params(tensors: dict[str, np.ndarray], c: ModelConfig) -> dict[str, Any]:
    """HF GPT-2 names -> the Flax tree of `GPT2ForCausalLM`. Consumes `tensors`.

    GPT-2's linear layers are `Conv1D`, stored [in, out] (already the einsum layout), and its
    Q, K, V are one fused `c_attn` ([D, 3D], split here). `GPT2LMHeadModel` saves its names
    under `transformer.`; the original OpenAI checkpoints (`GPT2Model`) have no prefix."""
    D, N, H = c.hidden_size, c.num_heads, c.head_dim
    prefix = "transformer." if "transformer.wte.weight" in tensors else ""
    t = HFTensors(tensors, c.num_layers, f"{prefix}h")
    qkv_kernel = t.per_layer("attn.c_attn.weight")  # [L, D, 3D]
    qkv_bias = t.per_layer("attn.c_attn.bias")  # [L, 3D]
    L = c.num_layers

    def qkv_part(i: int) -> dict[str, np.ndarray]:
        part = slice(i * D, (i + 1) * D)
        return {"kernel": qkv_kernel[:, :, part].reshape(L, D, N, H), "bias": qkv_bias[:, part].reshape(L, N, H)}

    def layer_norm(name: str) -> dict[str, np.ndarray]:
        return {"scale": t.per_layer(f"{name}.weight"), "bias": t.per_layer(f"{name}.bias")}

    params = {
        "embed": t.take(f"{prefix}wte.weight"),
        "pos_embed": t.take(f"{prefix}wpe.weight"),
        "layers": {
            "input_norm": layer_norm("ln_1"),
            "attn": {
                "q_proj": qkv_part(0),
                "k_proj": qkv_part(1),
                "v_proj": qkv_part(2),
                "o_proj": {"kernel": t.per_layer("attn.c_proj.weight", lambda w: w.reshape(N, H, D)),
                           "bias": t.per_layer("attn.c_proj.bias")},
            },
            "post_attention_norm": layer_norm("ln_2"),
            "mlp": {
                "fc": {"kernel": t.per_layer("mlp.c_fc.weight"), "bias": t.per_layer("mlp.c_fc.bias")},
                "proj": {"kernel": t.per_layer("mlp.c_proj.weight"), "bias": t.per_layer("mlp.c_proj.bias")},
            },
        },
        "final_norm": {"scale": t.take(f"{prefix}ln_f.weight"), "bias": t.take(f"{prefix}ln_f.bias")},
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = t.take("lm_head.weight").T
    return {"params": params}


def config_from_hf(cfg: dict[str, Any], model_type: str) -> ModelConfig:
    """HF GPT-2 `config.json`: learned positions, LayerNorm, GELU MLP, multi-head attention with
    biases everywhere, its own key names (`n_embd`, `n_head`, ...)."""
    if cfg.get("scale_attn_by_inverse_layer_idx") or not cfg.get("scale_attn_weights", True):
        raise ValueError("GPT-2 attention scaled other than by 1/sqrt(head_dim) is not supported")
    hidden, num_heads = cfg["n_embd"], cfg["n_head"]
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg.get("n_inner") or 4 * hidden,
        num_layers=cfg["n_layer"],
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        max_position_embeddings=cfg.get("n_positions", 1024),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        hidden_act=cfg.get("activation_function", "gelu_new"),
        eos_token_ids=hf_config.eos_token_ids(cfg),
        model_type=model_type,
    )
