"""Llama-family decoder (Llama 2/3, SmolLM, Mistral) on the flattened token axis.

    h = x + attn(norm(x));  out = h + mlp(norm(h))

The layers are stacked and scanned (`nn.scan`), so compile time does not grow with depth. The
KV cache of all layers travels through the scan as one array viewed as
`num_layers * num_pages` pages; layer l's pages are `l * num_pages + page`, so each layer
writes into the same donated buffer in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from orca_jax.config import ModelConfig
from orca_jax.models.layers import AttentionInputs, Einsum, GatedMLP, PagedAttention, RMSNorm


class DecoderBlock(nn.Module):
    config: ModelConfig
    pages_per_layer: int
    page_size: int
    attention_impl: str = "reference"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, carry, layer, inputs: AttentionInputs):
        x, kv_pages = carry
        c = self.config
        layer_inputs = dataclasses.replace(
            inputs,
            slot_mapping=inputs.slot_mapping + layer * self.pages_per_layer * self.page_size,
            page_table=inputs.page_table + layer * self.pages_per_layer,
        )
        attn = PagedAttention(
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            hidden_size=c.hidden_size, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
            sliding_window=c.sliding_window, attention_impl=self.attention_impl, dtype=self.dtype,
            name="attn",
        )
        mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.mlp_bias, self.dtype, name="mlp")
        attn_out, kv_pages = attn(RMSNorm(c.rms_norm_eps, self.dtype, name="input_norm")(x), kv_pages, layer_inputs)
        h = x + attn_out
        out = h + mlp(RMSNorm(c.rms_norm_eps, self.dtype, name="post_attention_norm")(h))
        return (out, kv_pages), None


class LlamaForCausalLM(nn.Module):
    config: ModelConfig
    attention_impl: str = "reference"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids, kv_cache, inputs: AttentionInputs, logits_indices):
        """input_ids i32[T]; kv_cache [L, P, page_size, 2K, H]; logits_indices i32[S].
        Returns (logits f32[S, V], kv_cache)."""
        c = self.config
        num_layers, num_pages, page_size = kv_cache.shape[:3]
        embedding = self.param("embed", nn.initializers.normal(0.02), (c.vocab_size, c.hidden_size), self.dtype)
        x = jnp.take(embedding, input_ids, axis=0)

        blocks = nn.scan(
            DecoderBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast),
            length=num_layers,
        )(c, num_pages, page_size, self.attention_impl, self.dtype, name="layers")
        flat_cache = kv_cache.reshape(num_layers * num_pages, *kv_cache.shape[2:])
        (x, flat_cache), _ = blocks((x, flat_cache), jnp.arange(num_layers), inputs)

        h = RMSNorm(c.rms_norm_eps, self.dtype, name="final_norm")(x[logits_indices])
        if c.tie_word_embeddings:
            logits = jnp.einsum("SD,VD->SV", h, embedding, preferred_element_type=jnp.float32)
        else:
            head = self.param("lm_head", nn.initializers.normal(0.02), (c.hidden_size, c.vocab_size), self.dtype)
            logits = jnp.einsum("SD,DV->SV", h, head, preferred_element_type=jnp.float32)
        return logits, flat_cache.reshape(kv_cache.shape)
