"""Llama-family decoder on the flattened token axis: Llama 2/3, SmolLM, and the families that
are the same block with a few switches from `ModelConfig`:

- Mistral: sliding-window attention (`sliding_window`);
- Qwen2/2.5: biases on Q, K, V but not on the output projection (`qkv_bias`, `o_bias`);
- Qwen3: RMSNorm on each query and key head before RoPE (`qk_norm`), head_dim from the config.

    h = x + attn(norm(x));  out = h + mlp(norm(h))

The layers are stacked and scanned over the flat all-layer KV cache (`run_layer_stack`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from orca_jax.distributed import parallel
from orca_jax.kernels import quantization
from orca_jax.config import ModelConfig
from orca_jax.models import hf_config
from orca_jax.models.hf_weights import HFTensors
from orca_jax.models.prompt_logprobs import prompt_logprobs
from orca_jax.kernels.metadata import AttentionMetadata
from orca_jax.models.layers import (GatedMLP, PagedAttention, RMSNorm, embedding_table, layer_rope, layer_window,
                                    quantized_kernel, run_layer_stack)


class DecoderBlock(nn.Module):
    config: ModelConfig
    pages_per_layer: int
    page_size: int
    attention_impl: str = "reference"
    dtype: Any = jnp.float32
    mesh: Any = None  # tensor parallelism (see orca_jax.distributed.parallel); None: one device

    @nn.compact
    def __call__(self, carry, layer, metadata: AttentionMetadata):
        x, kv_pages = carry
        layer_metadata = metadata.for_layer(layer, self.pages_per_layer, self.page_size)
        attn_out, kv_pages = self.attention(self.make_norm("input_norm")(x), kv_pages, layer_metadata, layer)
        h = x + attn_out
        out = h + self.feed_forward(self.make_norm("post_attention_norm")(h), metadata)
        return (out, kv_pages), None

    # What a family may swap (GPT-2 does): the norm, the MLP, RoPE.
    norm_cls: ClassVar[type[nn.Module]] = RMSNorm
    uses_rope: ClassVar[bool] = True

    @nn.nowrap
    def make_norm(self, name: str) -> nn.Module:
        return self.norm_cls(self.config.rms_norm_eps, self.dtype, name=name)

    @nn.nowrap
    def attention(self, x, kv_pages, layer_metadata: AttentionMetadata, layer):
        """This layer's attention, with its own window and RoPE (picked by the scan index
        `layer` where the model's layers differ; constants of the program where they do not)."""
        rope_tables = layer_rope(self.config, layer) if self.uses_rope else None
        return self.make_attention()(x, kv_pages, layer_metadata, rope_tables, layer_window(self.config, layer))

    @nn.nowrap
    def feed_forward(self, x, metadata: AttentionMetadata):
        """The block's second half on the normed activations (a mixture of experts also reads
        the step's metadata: which tokens are padding)."""
        del metadata
        return self.make_mlp()(x)

    @nn.nowrap
    def make_mlp(self) -> nn.Module:
        c = self.config
        return GatedMLP(c.hidden_size, c.intermediate_size, c.mlp_bias, self.dtype, c.hidden_act, c.quantization,
                        name="mlp")

    @nn.nowrap
    def make_attention(self) -> nn.Module:
        c = self.config
        return PagedAttention(
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            hidden_size=c.hidden_size, qkv_bias=c.qkv_bias, o_bias=c.o_bias,
            soft_cap=c.attn_logit_softcapping, attention_impl=self.attention_impl, dtype=self.dtype,
            qk_norm_eps=c.rms_norm_eps if c.qk_norm else None, norm_cls=self.norm_cls, sm_scale=c.sm_scale,
            use_sinks=c.attention_sinks, mesh=self.mesh, quantization=c.quantization, name="attn",
        )


class LlamaForCausalLM(nn.Module):
    config: ModelConfig
    attention_impl: str = "reference"
    dtype: Any = jnp.float32
    mesh: Any = None  # tensor parallelism (see orca_jax.distributed.parallel); None: one device
    block: ClassVar[type[DecoderBlock]] = DecoderBlock

    @nn.nowrap
    def lm_head(self, c: ModelConfig):
        """The untied head [D, V], quantized with the layers when they are."""
        shape, axes = (c.hidden_size, c.vocab_size), ("embed", "vocab")
        if c.quantization is None:
            return self.param("lm_head", nn.with_logical_partitioning(nn.initializers.normal(0.02), axes), shape,
                              self.dtype)
        return quantized_kernel(self, "lm_head", "lm_head_qscale", "lm_head_qzero", shape, axes, 1, c.quantization)

    @nn.nowrap
    def embed(self, embedding, input_ids, positions):
        """Token embeddings of the flattened tokens (families with learned positions add them)."""
        del positions  # RoPE applies positions inside attention
        return quantization.take_rows(embedding, input_ids, self.dtype)

    @nn.compact
    def __call__(self, input_ids, kv_cache, metadata: AttentionMetadata, logits_indices, hidden=None,
                 prompt_targets=None, prompt_k: int = 1):
        """input_ids i32[T]; kv_cache [L, P, page_size, 2K, H]; logits_indices i32[S].
        Returns (logits f32[S, V], kv_cache); with `prompt_targets` i32[T] (the prompt token
        after each token, -1: none wanted) (logits, kv_cache, PromptLogprobs) with the top
        `prompt_k` (orca_jax.models.prompt_logprobs).

        A pipeline stage (orca_jax.worker.pipeline) runs the layers its cache and weights hold (L is
        its share) and only its end of the model: a stage after the first takes the previous
        stage's activations `hidden` [T, D] instead of embedding the tokens, and a stage before
        the last passes `logits_indices=None` and gets (activations [T, D], kv_cache) back. Its
        weights are those parts only (a tied head's last stage holds the table too)."""
        c = self.config
        # The table (and a separate head) quantized with the layers: at V = 49,152 it is a fifth
        # of a small model's weights, and a tied head reads all of it at every step.
        needs_table = hidden is None or (logits_indices is not None and c.tie_word_embeddings)
        embedding = embedding_table(self, "embed", (c.vocab_size, c.hidden_size), ("vocab", "embed"), self.dtype,
                                    c.quantization) if needs_table else None
        x = self.embed(embedding, input_ids, metadata.positions) if hidden is None else hidden
        x, kv_cache = run_layer_stack(
            self.block, x, kv_cache, metadata, config=c, attention_impl=self.attention_impl, dtype=self.dtype,
            mesh=self.mesh,
        )
        if logits_indices is None:
            return x, kv_cache
        norm = self.block.norm_cls(c.rms_norm_eps, self.dtype, name="final_norm")
        head = None if c.tie_word_embeddings else self.lm_head(c)

        def logits_of(h):  # final-normed rows [n, D] -> f32[n, V]
            if head is None:
                logits = quantization.table_logits(h, embedding)
            else:
                logits = quantization.einsum("SD,DV->SV", h, head, preferred_element_type=jnp.float32)
            if c.final_logit_softcapping is not None:
                cap = c.final_logit_softcapping
                logits = cap * jnp.tanh(logits / cap)
            if self.mesh is not None:  # vocabulary-sharded logits: whole rows for sampling
                logits = parallel.gather_logits(self.mesh, logits)
            return logits

        logits = logits_of(norm(x[logits_indices]))
        if prompt_targets is None:
            return logits, kv_cache
        # The norm over all T rows is cheap next to the layers; the head runs only if asked.
        return logits, kv_cache, prompt_logprobs(logits_of, norm(x), prompt_targets, prompt_k)


def hf_to_params(tensors: dict[str, np.ndarray], c: ModelConfig, with_mlp: bool = True) -> dict[str, Any]:
    """HF Llama/Mistral/Qwen2/Qwen3 names and PyTorch layouts ([out, in]) -> the Flax tree of
    `LlamaForCausalLM` (named-axis kernels, layers stacked for the scan). Consumes `tensors`.
    `with_mlp` False: the layers' tree without "mlp" (a mixture-of-experts family adds its own)."""
    D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    t = HFTensors(tensors, c.num_layers, "model.layers")
    attn = {
        "q_proj": {"kernel": t.per_layer("self_attn.q_proj.weight", lambda w: w.T.reshape(D, N, H))},
        "k_proj": {"kernel": t.per_layer("self_attn.k_proj.weight", lambda w: w.T.reshape(D, K, H))},
        "v_proj": {"kernel": t.per_layer("self_attn.v_proj.weight", lambda w: w.T.reshape(D, K, H))},
        "o_proj": {"kernel": t.per_layer("self_attn.o_proj.weight", lambda w: w.T.reshape(N, H, D))},
    }
    if c.qkv_bias:
        attn["q_proj"]["bias"] = t.per_layer("self_attn.q_proj.bias", lambda b: b.reshape(N, H))
        attn["k_proj"]["bias"] = t.per_layer("self_attn.k_proj.bias", lambda b: b.reshape(K, H))
        attn["v_proj"]["bias"] = t.per_layer("self_attn.v_proj.bias", lambda b: b.reshape(K, H))
    if c.o_bias:
        attn["o_proj"]["bias"] = t.per_layer("self_attn.o_proj.bias")
    if c.qk_norm:
        attn["q_norm"] = {"scale": t.per_layer("self_attn.q_norm.weight")}
        attn["k_norm"] = {"scale": t.per_layer("self_attn.k_norm.weight")}
    params = {
        "embed": t.take("model.embed_tokens.weight"),
        "layers": {
            "input_norm": {"scale": t.per_layer("input_layernorm.weight")},
            "attn": attn,
            "post_attention_norm": {"scale": t.per_layer("post_attention_layernorm.weight")},
        },
        "final_norm": {"scale": t.take("model.norm.weight")},
    }
    if with_mlp:
        params["layers"]["mlp"] = _hf_mlp(t, c)
    if not c.tie_word_embeddings:
        params["lm_head"] = t.take("lm_head.weight").T
    return {"params": params}


def _hf_mlp(t: HFTensors, c: ModelConfig) -> dict[str, Any]:
    mlp = {name: {"kernel": t.per_layer(f"mlp.{name}.weight", lambda w: w.T)}
           for name in ("gate_proj", "up_proj", "down_proj")}
    if c.mlp_bias:
        for name in mlp:
            mlp[name]["bias"] = t.per_layer(f"mlp.{name}.bias")
    return mlp


def config_from_hf(cfg: dict[str, Any], model_type: str) -> ModelConfig:
    """HF `config.json` of Llama, Mistral, Qwen2 or Qwen3 (`model_type`): the same block, with
    the switches each family's config implies."""
    num_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    rope_theta, rope_scaling = hf_config.rope_from_hf(cfg)
    attention_bias = cfg.get("attention_bias", False)  # Llama, Qwen3: biases on all four projections
    sliding_window, layer_types = hf_config.attention_layers_from_hf(cfg)
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or hidden // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        # Qwen2 always has Q, K, V biases and never an output bias (its config has no switch).
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=cfg.get("mlp_bias", False),
        qk_norm=model_type == "qwen3",
        hidden_act=cfg.get("hidden_act", "silu"),
        sliding_window=sliding_window,
        layer_types=layer_types,
        partial_rotary_factor=hf_config.partial_rotary_factor_from_hf(cfg),
        eos_token_ids=hf_config.eos_token_ids(cfg),
        model_type=model_type,
    )
