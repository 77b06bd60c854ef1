"""GPT-2 (standing in for Orca's GPT-3 family) on the flattened token axis.

    x = wte[ids] + wpe[positions];  h = x + attn(ln_1(x));  out = h + mlp(ln_2(h))

Unlike the Llama family: learned absolute positions (each token's own position indexes `wpe`,
so chunked prefill and decode need nothing special), LayerNorm with a bias, a GELU MLP
without a gate, biases everywhere, multi-head attention without RoPE, tied head. The
attention, the layer scan and the paged cache are the shared ones.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from orca_jax.config import ModelConfig
from orca_jax.models.hf_weights import HFTensors
from orca_jax.models.layers import (
    MLP, AttentionInputs, LayerNorm, PagedAttention, inputs_for_layer, run_layer_stack,
)


class GPT2Block(nn.Module):
    config: ModelConfig
    pages_per_layer: int
    page_size: int
    attention_impl: str = "reference"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, carry, layer, inputs: AttentionInputs):
        x, kv_pages = carry
        c = self.config
        attn = PagedAttention(
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            hidden_size=c.hidden_size, qkv_bias=c.qkv_bias, o_bias=c.o_bias,
            attention_impl=self.attention_impl, dtype=self.dtype, use_rope=False, name="attn",
        )
        mlp = MLP(c.hidden_size, c.intermediate_size, c.mlp_bias, self.dtype, c.hidden_act, name="mlp")
        layer_inputs = inputs_for_layer(inputs, layer, self.pages_per_layer, self.page_size)
        attn_out, kv_pages = attn(LayerNorm(c.rms_norm_eps, self.dtype, name="input_norm")(x), kv_pages, layer_inputs)
        h = x + attn_out
        out = h + mlp(LayerNorm(c.rms_norm_eps, self.dtype, name="post_attention_norm")(h))
        return (out, kv_pages), None


class GPT2ForCausalLM(nn.Module):
    config: ModelConfig
    attention_impl: str = "reference"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids, kv_cache, inputs: AttentionInputs, logits_indices):
        """input_ids i32[T]; kv_cache [L, P, page_size, 2K, H]; logits_indices i32[S].
        Returns (logits f32[S, V], kv_cache)."""
        c = self.config
        embedding = self.param("embed", nn.initializers.normal(0.02), (c.vocab_size, c.hidden_size), self.dtype)
        positions = self.param(
            "pos_embed", nn.initializers.normal(0.01), (c.max_position_embeddings, c.hidden_size), self.dtype
        )
        x = jnp.take(embedding, input_ids, axis=0) + jnp.take(positions, inputs.positions, axis=0)
        x, kv_cache = run_layer_stack(
            GPT2Block, x, kv_cache, inputs, config=c, attention_impl=self.attention_impl, dtype=self.dtype,
        )
        h = LayerNorm(c.rms_norm_eps, self.dtype, name="final_norm")(x[logits_indices])
        if c.tie_word_embeddings:
            logits = jnp.einsum("SD,VD->SV", h, embedding, preferred_element_type=jnp.float32)
        else:
            head = self.param("lm_head", nn.initializers.normal(0.02), (c.hidden_size, c.vocab_size), self.dtype)
            logits = jnp.einsum("SD,DV->SV", h, head, preferred_element_type=jnp.float32)
        return logits, kv_cache


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
