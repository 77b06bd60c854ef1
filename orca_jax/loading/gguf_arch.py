"""GGUF architectures: which `general.architecture` values load, and what their metadata means.

llama.cpp's converter (convert_hf_to_gguf.py) is the format's reference, so each entry here says
what that converter writes for the HF family, and how to read it back:

  "llama"     LlamaForCausalLM, MistralForCausalLM and MixtralForCausalLM alike (llama.cpp has
              no "mistral" or "mixtral" architecture): a file with `llama.expert_count` is
              Mixtral. Its RoPE is the interleaved kind (LLAMA_ROPE_TYPE_NORM), so the converter
              permuted the Q and K rows (`LlamaModel.permute`); the loader undoes that.
  "qwen2"     Qwen2 / Qwen2.5: Q, K, V biases. NEOX RoPE (rotate-half, as in transformers), so
              the rows were written as they are: nothing to undo.
  "qwen3"     Qwen3: per-head `attn_q_norm` / `attn_k_norm`, head_dim from
              `attention.key_length` (not hidden / heads). NEOX RoPE, rows unpermuted, like qwen2.
  "qwen2moe"  Qwen2MoeForCausalLM (Qwen1.5/2-MoE): qwen2's attention, experts as wide as
              `expert_feed_forward_length`, a shared expert (`ffn_*_shexp`, gated by
              `ffn_gate_inp_shexp`) as wide as `expert_shared_feed_forward_length`. llama.cpp
              keeps the top-k router weights as they are (norm_topk_prob False).
  "qwen3moe"  Qwen3MoeForCausalLM: qwen3's attention, experts as wide as
              `expert_feed_forward_length`; llama.cpp renormalises the top-k router weights
              (norm_topk_prob True) whatever the HF config said, and so does the loader.
  "gemma2"    Gemma2ForCausalLM: every `*norm.weight` written as 1 + w (llama.cpp's norm
              multiplies by the weight, HF's by 1 + w), so the loader subtracts the one back;
              the four norms of a block as attn_norm / post_attention_norm / ffn_norm (before
              the MLP) / post_ffw_norm; `attn_logit_softcapping`, `final_logit_softcapping`,
              `attention.sliding_window` (every other layer, as llama.cpp fixes it). No key
              holds `query_pre_attn_scalar`: llama.cpp takes hidden / heads for the 27B
              (46 layers) and head_dim otherwise, as the released configs have it; so does this.
  "gemma3"    Gemma3ForCausalLM and the text tower of Gemma3ForConditionalGeneration: norms
              (Q/K norms too) as gemma2; five sliding layers to one full (llama.cpp's fixed
              pattern, unless the file has `attention.sliding_window_pattern`), the sliding
              ones at RoPE base 10000 (fixed in llama.cpp too), the full ones at
              `rope.freq_base` with the file's linear scaling; query_pre_attn_scalar as gemma2
              (the 27B has 62 layers).
  "phi3"      Phi3ForCausalLM (Phi-3, Phi-4-mini): fused `attn_qkv` and `ffn_up` (gate and up,
              as in HF); partial rotary from `rope.dimension_count`; LongRoPE as the tensors
              `rope_factors_short` / `rope_factors_long` with `rope.scaling.attn_factor` and
              `rope.scaling.original_context_length` (the converter writes no scaling type);
              `attention.sliding_window` 0 for none (Phi-4-mini).
  "gpt-oss"   GptOssForCausalLM: biases on the attention, the router (`ffn_gate_inp`) and the
              stacked experts (`ffn_*_exps.bias`), the sinks as `attn_sinks`, the norm before
              the experts as `post_attention_norm`; the converter splits HF's interleaved
              gate_up_proj into gate and up. `attention.sliding_window` (128) on every other
              layer, the first sliding (llama.cpp's fixed pattern, transformers' default), YaRN
              from `rope.scaling.*` (not truncated, as both run it). Experts in MXFP4 (GGML type
              39: a scale byte and 16 bytes of codes per 32 values) stay 4-bit: the values read
              back pack to the same codes (orca_jax/kernels/packed4.py).
All of these use NEOX RoPE except "llama", so only its Q/K rows were permuted.

Mixture-of-experts files hold each layer's router (`ffn_gate_inp`) and its experts stacked, one
tensor per projection (`ffn_{gate,up,down}_exps`, [experts, out, in] in numpy order), as the
converter has written them since 2024; older files, with a tensor per expert, are refused.

The metadata is turned into the HF `config.json` keys it stands for (`hf_config`), which the
family's own parser (`orca_jax.models.config_from_hf`) then reads: GGUF and HF checkpoints share
one set of defaults and checks, and the switches (qkv_bias, qk_norm, sliding_window, head_dim)
follow from the model_type chosen here exactly as they do for an HF directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GGUFArchitecture:
    model_type: str  # the orca_jax model family that runs it (orca_jax.models.ARCHITECTURES)
    # True where llama.cpp's converter reordered each Q/K head's rows into interleaved pairs for
    # its NORM RoPE; False for NEOX-RoPE architectures, whose rows are stored as in HF.
    rope_rows_permuted: bool
    # What llama.cpp's converter added to every `*norm.weight` (Gemma's 1 + w norms: 1.0).
    norm_offset: float = 0.0


ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", rope_rows_permuted=True),
    "qwen2": GGUFArchitecture("qwen2", rope_rows_permuted=False),
    "qwen3": GGUFArchitecture("qwen3", rope_rows_permuted=False),
    "qwen2moe": GGUFArchitecture("qwen2_moe", rope_rows_permuted=False),
    "qwen3moe": GGUFArchitecture("qwen3_moe", rope_rows_permuted=False),
    "gemma2": GGUFArchitecture("gemma2", rope_rows_permuted=False, norm_offset=1.0),
    "gemma3": GGUFArchitecture("gemma3_text", rope_rows_permuted=False, norm_offset=1.0),
    "phi3": GGUFArchitecture("phi3", rope_rows_permuted=False),
    "gpt-oss": GGUFArchitecture("gpt_oss", rope_rows_permuted=False),
}
# Layers of the releases whose query_pre_attn_scalar is hidden / heads, not head_dim (the
# 27B Gemma 2 and Gemma 3), as llama.cpp tells them apart.
_SCALED_BY_HIDDEN_PER_HEAD = {"gemma2": 46, "gemma3": 62}
# The tensors that hold LongRoPE's factors, and the HF key of each.
LONGROPE_TENSORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# Whether llama.cpp renormalises an architecture's top-k router weights (its graph fixes it per
# architecture, whatever the HF config said); Mixtral's HF parser always does.
_NORM_TOPK_PROB = {"qwen2moe": False, "qwen3moe": True}

# Architectures people are likely to try, and why they are refused (the error says so).
_WHY_NOT = {
    "gpt2": "llama.cpp stores GPT-2's attention as one fused attn_qkv tensor and its Conv1D weights "
            "transposed, which this loader does not read yet; load the HF checkpoint instead",
    "mistral3": "Ministral 3 files scale attention by a position-dependent temperature "
                "(llama_4_scaling), which orca_jax does not implement",
}


def architecture(meta: dict[str, Any]) -> GGUFArchitecture:
    """The entry for the file's `general.architecture`; ValueError naming the supported ones."""
    name = meta.get("general.architecture")
    if name not in ARCHITECTURES:
        why = f" ({_WHY_NOT[name]})" if name in _WHY_NOT else ""
        raise ValueError(
            f"unsupported GGUF architecture {name!r}{why}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def rope_rows_permuted(meta: dict[str, Any]) -> bool:
    """Whether the file's Q/K rows need `unpermute_rope_rows` to get back HF's layout."""
    return architecture(meta).rope_rows_permuted


def norm_offset(meta: dict[str, Any]) -> float:
    """What to subtract from the file's `*norm.weight` tensors to get HF's."""
    return architecture(meta).norm_offset


def hf_config(meta: dict[str, Any], rope_factors: dict[str, tuple] | None = None) -> dict[str, Any]:
    """GGUF metadata -> the HF `config.json` dict it stands for. Checks here only what the HF
    parser cannot see (metadata a config.json has no key for); the rest is left to it.
    `rope_factors`: the file's LongRoPE factor tensors, by HF key (`LONGROPE_TENSORS`)."""
    arch_name = meta.get("general.architecture")
    arch = architecture(meta)

    def key(name, default=None):
        return meta.get(f"{arch_name}.{name}", default)

    heads = _same_in_every_layer(key("attention.head_count"), "attention.head_count")
    head_dim = key("attention.key_length")
    _check_value_length(key("attention.value_length"), head_dim)
    hf = {
        "vocab_size": key("vocab_size", 0),  # the loader takes it from the embedding's shape
        "hidden_size": key("embedding_length"),
        "intermediate_size": _same_in_every_layer(key("feed_forward_length"), "feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        # None: as many as query heads.
        "num_key_value_heads": _same_in_every_layer(key("attention.head_count_kv"), "attention.head_count_kv"),
        "head_dim": head_dim,  # None: hidden_size / heads
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": True,  # the loader unties it when the file has output.weight
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        **_rope_scaling(key),
        **_sliding_window(key),
        **_experts(key, arch_name),
        **_gemma(key, arch_name, heads),
    }
    if rope_factors:
        hf["rope_scaling"] = _longrope(key, rope_factors)
    hf.update(_partial_rotary(key("rope.dimension_count"), hf))
    hf["model_type"] = arch.model_type
    if arch.model_type == "llama":
        # Experts tell a Mixtral file from a Llama one, a window a Mistral one (same architecture
        # name). Llama and Mistral parse alike, the name only keeps logs and checkpoint markers
        # honest; Mixtral is its own family.
        if "num_local_experts" in hf:
            hf["model_type"] = "mixtral"
        elif hf.get("sliding_window") is not None:
            hf["model_type"] = "mistral"
    return hf


def _gemma(key, arch_name: str, heads) -> dict[str, Any]:
    """Gemma's soft caps, and the score scale no key holds (module docstring)."""
    if arch_name not in _SCALED_BY_HIDDEN_PER_HEAD:
        return {}
    hf = {"attn_logit_softcapping": key("attn_logit_softcapping"),
          "final_logit_softcapping": key("final_logit_softcapping")}
    # Always written: a Gemma config.json without the key means transformers' default (256).
    if key("block_count") == _SCALED_BY_HIDDEN_PER_HEAD[arch_name] and heads:
        hf["query_pre_attn_scalar"] = key("embedding_length") // heads
    elif heads:
        hf["query_pre_attn_scalar"] = key("attention.key_length") or key("embedding_length") // heads
    if arch_name == "gemma3" and key("attention.sliding_window_pattern") is None:
        hf["sliding_window_pattern"] = 6
    return hf


def _longrope(key, rope_factors: dict[str, tuple]) -> dict[str, Any]:
    """Phi-3's LongRoPE, which the converter writes as two factor tensors and two keys."""
    missing = sorted(set(LONGROPE_TENSORS.values()) - set(rope_factors))
    if missing:
        raise ValueError(f"GGUF file has LongRoPE factors without {', '.join(missing)}")
    scaling = {"rope_type": "longrope", **rope_factors,
               "original_max_position_embeddings": key("rope.scaling.original_context_length")}
    if key("rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float(key("rope.scaling.attn_factor"))
    return scaling


def _experts(key, arch_name: str) -> dict[str, Any]:
    """The experts' counts and widths under the keys of the family's HF config (Mixtral's
    `num_local_experts`, the Qwens' `num_experts`); nothing for a dense file."""
    count = key("expert_count")
    if not count:
        return {}
    used = key("expert_used_count")
    if not used:
        raise ValueError(f"GGUF {arch_name}.expert_count is {count} but {arch_name}.expert_used_count is missing")
    if arch_name == "llama":  # Mixtral: the experts are `feed_forward_length` wide
        return {"num_local_experts": count, "num_experts_per_tok": used}
    if arch_name == "gpt-oss":  # gpt-oss's config has no width of its own for the experts
        width = key("expert_feed_forward_length")
        return {"num_local_experts": count, "num_experts_per_tok": used,
                **({"intermediate_size": _same_in_every_layer(width, "expert_feed_forward_length")} if width else {})}
    return {
        "num_experts": count,
        "num_experts_per_tok": used,
        "moe_intermediate_size": _same_in_every_layer(key("expert_feed_forward_length"), "expert_feed_forward_length"),
        "shared_expert_intermediate_size": key("expert_shared_feed_forward_length", 0),
        "norm_topk_prob": _NORM_TOPK_PROB.get(arch_name, False),
    }


def _same_in_every_layer(value, name: str):
    """A per-layer array (llama.cpp allows one for head counts and FFN widths) is fine when every
    layer agrees: the layers run as one scan over stacked weights."""
    if not isinstance(value, (list, tuple)):
        return value
    if len(set(value)) != 1:
        raise ValueError(f"GGUF {name} differs between layers ({list(value)}); not supported")
    return value[0]


def _check_value_length(value_length, key_length) -> None:
    if value_length is not None and key_length is not None and value_length != key_length:
        raise ValueError(f"GGUF attention.value_length {value_length} != key_length {key_length}; not supported")


def _partial_rotary(rope_dims, hf: dict[str, Any]) -> dict[str, Any]:
    """`rope.dimension_count` (llama.cpp writes head_dim for a full rotation, fewer for a
    partial one) as HF's `partial_rotary_factor`; nothing when it rotates every dimension."""
    if rope_dims is None or not (hf["head_dim"] or (hf["hidden_size"] and hf["num_attention_heads"])):
        return {}  # nothing to compare (a file missing its sizes fails in the family parser)
    head_dim = hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
    if rope_dims > head_dim or rope_dims % 2:
        raise ValueError(f"GGUF rope.dimension_count {rope_dims} does not fit head_dim {head_dim}")
    return {} if rope_dims == head_dim else {"partial_rotary_factor": rope_dims / head_dim}


def _rope_scaling(key) -> dict[str, Any]:
    """`rope.scaling.*` as the HF `rope_scaling` it came from, so that the family parser
    accepts or refuses it as it would the HF config (Llama 3's scaling needs no key: the file
    carries it as the rope_freqs tensor; LongRoPE's factors are tensors too, read by the
    family's converter)."""
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    scaling = {"rope_type": kind, "factor": key("rope.scaling.factor")}
    if kind == "yarn":
        for name in _YARN_KEYS_NOT_READ:
            if key(f"rope.scaling.{name}") is not None:
                raise ValueError(f"GGUF rope.scaling.{name} is not supported (no HF YaRN parameter is read "
                                 f"from it); supported YaRN keys: {', '.join(_YARN_KEYS.values())}")
        scaling.update({hf_key: key(f"rope.scaling.{gguf_key}") for hf_key, gguf_key in _YARN_KEYS.items()
                        if key(f"rope.scaling.{gguf_key}") is not None})
    return {"rope_scaling": scaling}


# YaRN's HF keys and the GGUF keys llama.cpp's converter writes them under.
_YARN_KEYS = {"original_max_position_embeddings": "original_context_length", "beta_fast": "yarn_beta_fast",
              "beta_slow": "yarn_beta_slow"}
# llama.cpp's own YaRN knobs, whose mapping onto HF's attention_factor is not one to one.
_YARN_KEYS_NOT_READ = ("yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier")


def _sliding_window(key) -> dict[str, Any]:
    """`attention.sliding_window` (0: none) and, when present, its per-layer pattern as HF's
    `layer_types`. llama.cpp's converter writes no window for MistralForCausalLM (Mistral 7B
    v0.1's 4096 is dropped, and llama.cpp runs it with full attention); files that carry one get
    it applied, as the HF config would."""
    window = key("attention.sliding_window")
    if not window:
        return {}
    pattern = key("attention.sliding_window_pattern")
    if pattern is None:
        return {"sliding_window": window}
    return {"sliding_window": window,
            "layer_types": ["sliding_attention" if sliding else "full_attention" for sliding in pattern]}
