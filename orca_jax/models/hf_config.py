"""Reading a transformers `config.json`: the keys that several families spell alike.

Each family's own parser (`config_from_hf` at the end of llama.py, gpt2.py) reads its fields
and calls these for the shared ones; `orca_jax.models.config_from_hf` picks the parser.
"""

from __future__ import annotations

from typing import Any

# RoPE scaling keys of llama3-style frequency scaling, in the order `ModelConfig` keeps them.
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def eos_token_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    """`eos_token_id` as a tuple: configs hold one id, a list of ids, or none."""
    eos = cfg.get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        return tuple(eos)
    return (eos,) if eos is not None else ()


def rope_from_hf(cfg: dict[str, Any]) -> tuple[float, tuple | None]:
    """(rope_theta, rope_scaling) from either the old (`rope_theta` + `rope_scaling`) or the new
    (`rope_parameters`) transformers layout. The scaling is None for plain RoPE."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: default, llama3")
    return float(theta), tuple((k, scaling[k]) for k in LLAMA3_ROPE_KEYS)


def sliding_window_from_hf(cfg: dict[str, Any]) -> int | None:
    """The window every layer uses, or None. Qwen2/3 window only when `use_sliding_window` is
    true, and then only layers from `max_window_layers` on (spelled out in `layer_types`);
    Mistral windows every layer whenever `sliding_window` is set."""
    window = cfg.get("sliding_window")
    if window is None or not cfg.get("use_sliding_window", True):
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is None and "max_window_layers" in cfg:
        layer_types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention"
                       for i in range(cfg["num_hidden_layers"])]
    kinds = set(layer_types or ["sliding_attention"])
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return window
    # The layers run as one scan with one static window; a mix would need a window per layer.
    raise ValueError(f"sliding window on some layers only (layer_types {sorted(kinds)}) is not supported")
