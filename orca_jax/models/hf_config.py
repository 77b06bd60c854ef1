"""Reading a transformers `config.json`: the keys that several families spell alike.

Each family's own parser (`config_from_hf` at the end of llama.py, gpt2.py) reads its fields
and calls these for the shared ones; `orca_jax.models.config_from_hf` picks the parser.
"""

from __future__ import annotations

from typing import Any

from orca_jax.models.rope import ROPE_TYPES

# The rope types whose scaling is read against the context the model was pretrained with
# (HF's standardize_rope_params fills their `original_max_position_embeddings`).
_ROPE_TYPES_WITH_ORIGINAL_CONTEXT = ("llama3", "yarn", "longrope")
# Older spellings of a rope type: LongRoPE was "su" in the first Phi-3 configs.
_ROPE_TYPE_ALIASES = {"su": "longrope"}
# Keys of HF's RoPE parameters that are not scaling: read on their own (theta returned beside
# the scaling, partial_rotary_factor_from_hf), so the scaling holds no second copy of them.
_NOT_SCALING_KEYS = ("type", "rope_type", "rope_theta", "partial_rotary_factor")


def eos_token_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    """`eos_token_id` as a tuple: configs hold one id, a list of ids, or none."""
    eos = cfg.get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        return tuple(eos)
    return (eos,) if eos is not None else ()


def rope_from_hf(cfg: dict[str, Any]) -> tuple[float, tuple | None]:
    """(rope_theta, rope_scaling) from the old (`rope_theta` + `rope_scaling`) or the new
    (`rope_parameters`, nested by layer type in Gemma 3's) transformers layout.

    The scaling is None for plain RoPE, else HF's whole scaling dict (orca_jax/models/rope.py
    reads it) as sorted (key, value) items, lists made tuples, so that ModelConfig stays
    hashable: `rope_type` normalised (older configs spell it `type`) and, for the types scaled
    against the pretraining context, `original_max_position_embeddings` always there: the
    dict's, else the config's top-level one (where Phi-3 keeps it), else
    `max_position_embeddings`, as HF's standardize_rope_params fills it."""
    params = _global_rope_parameters(cfg)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type == "default":
        return float(theta), None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    scaling = {key: tuple(value) if isinstance(value, list) else value
               for key, value in params.items() if key not in _NOT_SCALING_KEYS}
    scaling["rope_type"] = rope_type
    if rope_type in _ROPE_TYPES_WITH_ORIGINAL_CONTEXT:
        original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") \
            or cfg.get("max_position_embeddings")
        if original is not None:  # else rope.py falls back to the family's max_position_embeddings
            scaling["original_max_position_embeddings"] = original
    return float(theta), tuple(sorted(scaling.items()))


def partial_rotary_factor_from_hf(cfg: dict[str, Any]) -> float:
    """The fraction of each head that RoPE rotates (Phi-3/4, Phi-2): `partial_rotary_factor`,
    in the RoPE parameters (new layout, which HF prefers) or at the top level; 1.0 if unset."""
    factor = _global_rope_parameters(cfg).get("partial_rotary_factor")
    if factor is None:
        factor = cfg.get("partial_rotary_factor")
    return 1.0 if factor is None else float(factor)


def _global_rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of the model's full-attention layers: `rope_scaling` (old layout),
    else `rope_parameters` (new), whose Gemma 3 form holds one dict per layer type (the sliding
    layers' own base is read by the family parser)."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if any(isinstance(value, dict) for value in params.values()):
        params = params.get("full_attention") or {}
    return params


def attention_layers_from_hf(cfg: dict[str, Any]) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) of the Llama-style families: the window and, where the
    layers differ, each layer's attention (HF's `layer_types`; None: all layers alike, windowed
    when the window is set). Qwen2/3 window only when `use_sliding_window` is true, and then
    only the layers from `max_window_layers` on (or as `layer_types` spells out); Mistral
    windows every layer whenever `sliding_window` is set."""
    window = cfg.get("sliding_window")
    if window is None or not cfg.get("use_sliding_window", True):
        return None, None
    layer_types = cfg.get("layer_types")
    if layer_types is None and "max_window_layers" in cfg:
        layer_types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention"
                       for i in range(cfg["num_hidden_layers"])]
    kinds = set(layer_types or ["sliding_attention"])
    if kinds == {"full_attention"}:
        return None, None
    if kinds == {"sliding_attention"}:
        return window, None
    return window, tuple(layer_types)
