"""Gemma 2 and Gemma 3 (text): the Llama block with Gemma's parts.

    h = x + post_attn_norm(attn(input_norm(x)));  out = h + post_ff_norm(mlp(pre_ff_norm(h)))

- RMSNorm weights stored as offsets from one, the whole norm in float32 (`GemmaRMSNorm`);
- a norm after attention and after the MLP as well as before each ("sandwich" norms);
- GeGLU (tanh GELU, `hidden_activation`), embeddings scaled by sqrt(hidden_size) in the model
  dtype, the head tied to the embedding;
- scores scaled by `query_pre_attn_scalar ** -0.5`;
- sliding and full layers mixed (`layer_types`): Gemma 2 alternates them, Gemma 3 has five
  sliding for each full one;
- Gemma 2: attention scores and final logits soft-capped;
- Gemma 3: Q/K norms (Gemma's RMSNorm per head), sliding layers at their own RoPE base
  (`rope_local_base_freq`) without the scaling the full layers have.

A `gemma3` checkpoint (the vision-language model) is loaded by its text tower: its config's
`text_config`, its language model's tensors; the vision tower and projector are left out, and
the loader says so.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from orca_jax.config import ModelConfig
from orca_jax.kernels import quantization
from orca_jax.kernels.metadata import AttentionMetadata
from orca_jax.models import hf_config, llama
from orca_jax.models.hf_weights import HFTensors
from orca_jax.models.layers import GemmaRMSNorm
from orca_jax.models.llama import DecoderBlock, LlamaForCausalLM

logger = logging.getLogger(__name__)

# Where a `gemma3` (vision-language) checkpoint keeps its text tower, by transformers version,
# and the prefixes of what is not the text tower.
_TEXT_TOWER_PREFIXES = ("model.language_model.", "language_model.model.")
_TEXT_TOWER_HEADS = ("lm_head.", "language_model.lm_head.")
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


# transformers' defaults for the keys a Gemma config.json may leave out. The hub's Gemma 3 files
# write only what differs from them: google/gemma-3-4b-it's text_config has no vocab_size, head
# counts, head_dim or rope_theta, and reading those as anything but these values builds a
# different model. tests/models/test_gemma_phi3.py checks the table against transformers'
# own config classes.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0,
        attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, eos_token_id=1,
    ),
    "gemma3_text": dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1_000_000.0,
        rope_local_base_freq=10000.0, attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
        sliding_window_pattern=6, attn_logit_softcapping=None, final_logit_softcapping=None, eos_token_id=1,
    ),
}


class GemmaBlock(DecoderBlock):
    """The decoder block with Gemma's norms around attention and the MLP."""

    norm_cls: ClassVar[type[nn.Module]] = GemmaRMSNorm

    @nn.compact
    def __call__(self, carry, layer, metadata: AttentionMetadata):
        x, kv_pages = carry
        layer_metadata = metadata.for_layer(layer, self.pages_per_layer, self.page_size)
        attn_out, kv_pages = self.attention(self.make_norm("input_norm")(x), kv_pages, layer_metadata, layer)
        h = x + self.make_norm("post_attention_norm")(attn_out)
        mlp_out = self.feed_forward(self.make_norm("pre_feedforward_norm")(h), metadata)
        return (h + self.make_norm("post_feedforward_norm")(mlp_out), kv_pages), None


class GemmaForCausalLM(LlamaForCausalLM):
    block: ClassVar[type[DecoderBlock]] = GemmaBlock

    @nn.nowrap
    def embed(self, embedding, input_ids, positions):
        """Token embeddings times sqrt(hidden_size), the factor rounded to the model dtype first
        (as transformers does)."""
        del positions
        normalizer = jnp.asarray(self.config.hidden_size ** 0.5, self.dtype)
        return quantization.take_rows(embedding, input_ids, self.dtype) * normalizer


def gemma_layer_types(cfg: dict[str, Any], pattern: int) -> tuple[str, ...]:
    """HF's `layer_types`, or the pattern its configs derive them from: every `pattern`-th
    layer full, the others sliding (Gemma 2: 2; Gemma 3: `sliding_window_pattern`, 6)."""
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(cfg["num_hidden_layers"]))


def local_rope_theta(cfg: dict[str, Any]) -> float:
    """Gemma 3's sliding layers' RoPE base: `rope_local_base_freq` (older configs), or the
    sliding layers' entry of `rope_parameters` nested by layer type (newer ones)."""
    by_layer_type = cfg.get("rope_parameters") or {}
    sliding = by_layer_type.get("sliding_attention")
    if isinstance(sliding, dict) and "rope_theta" in sliding:
        return float(sliding["rope_theta"])
    return float(cfg.get("rope_local_base_freq", 10000.0))


def config_from_hf(cfg: dict[str, Any], model_type: str) -> ModelConfig:
    """HF `config.json` of Gemma 2 (`gemma2`) or Gemma 3 (`gemma3_text`, or a `gemma3`
    checkpoint's `text_config`)."""
    if model_type == "gemma3":
        logger.warning("gemma3: loading the text tower only (no vision tower, no image inputs)")
        text = cfg.get("text_config") or cfg  # a text-only file saved under the multimodal class
        eos = cfg.get("eos_token_id", text.get("eos_token_id"))  # the outer file's: [1, 106], <end_of_turn> too
        cfg = {**text, **({"eos_token_id": eos} if eos is not None else {})}
    is_gemma3 = model_type in ("gemma3", "gemma3_text")
    cfg = {**HF_DEFAULTS["gemma3_text" if is_gemma3 else "gemma2"], **cfg}
    num_heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // num_heads
    rope_theta, rope_scaling = hf_config.rope_from_hf(cfg)
    pattern = cfg["sliding_window_pattern"] if is_gemma3 else 2
    attention_bias = cfg["attention_bias"]
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rope_local_theta=local_rope_theta(cfg) if is_gemma3 else None,
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm=is_gemma3,
        hidden_act=cfg["hidden_activation"] or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        sliding_window=cfg["sliding_window"],
        layer_types=gemma_layer_types(cfg, pattern),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        query_pre_attn_scalar=cfg["query_pre_attn_scalar"],
        eos_token_ids=hf_config.eos_token_ids(cfg),
        model_type=model_type,
    )


def hf_to_params(tensors: dict[str, np.ndarray], c: ModelConfig) -> dict[str, Any]:
    """HF Gemma 2/3 names -> the Flax tree of `GemmaForCausalLM`: the Llama names plus the
    two norms around the MLP. Consumes `tensors`."""
    if c.model_type == "gemma3":
        tensors = text_tower(tensors)
    params = llama.hf_to_params(tensors, c)
    t = HFTensors(tensors, c.num_layers, "model.layers")
    layers = params["params"]["layers"]
    layers["pre_feedforward_norm"] = {"scale": t.per_layer("pre_feedforward_layernorm.weight")}
    layers["post_feedforward_norm"] = {"scale": t.per_layer("post_feedforward_layernorm.weight")}
    return params


def text_tower(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A `gemma3` checkpoint's text-tower tensors under the `gemma3_text` names (`model.*`),
    the vision tower and projector dropped. Consumes `tensors`."""
    text, skipped = {}, 0
    for name in list(tensors):
        tensor = tensors.pop(name)
        if name.startswith(_VISION_PREFIXES):
            skipped += 1
            continue
        for prefix in _TEXT_TOWER_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name[len(prefix):]
                break
        for head in _TEXT_TOWER_HEADS:
            if name.startswith(head):
                name = "lm_head." + name[len(head):]
        text[name] = tensor
    logger.info("gemma3: %d vision tensors left out", skipped)
    return text
