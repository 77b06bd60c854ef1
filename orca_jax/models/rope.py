"""Rotary position embeddings, with the frequency scalings of transformers' `rope_type`s.

`rope_tables` computes, in numpy and once per model, what transformers' `ROPE_INIT_FUNCTIONS`
(transformers/modeling_rope_utils.py) compute: the inverse frequencies of each rotary pair
and the factor HF calls `attention_scaling`, which multiplies cos and sin. They are constants
of the config, folded into the compiled step. `apply_rope` rotates queries or keys by them in
transformers' rotate-half layout, on the first `rotary_dim` of each head (partial rotary).

Two HF types recompute their frequencies from the length of the sequence at hand; an engine
that batches sequences of every length through one program needs one table instead:
- `dynamic` (NTK): computed as HF does for a sequence of `factor * max_position_embeddings`
  tokens, the longest context the scaling is meant for (vLLM does the same). Shorter
  sequences therefore run with that longest context's base, where HF would use a smaller one.
- `longrope`: HF switches a whole sequence to the long factors once it grows past
  `original_max_position_embeddings`. Here the keys already in the paged cache keep the
  rotation they were written with, so the choice is made per token instead: short factors for
  positions below `original_max_position_embeddings`, long factors from it on. Sequences that
  stay below it match HF exactly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class RopeTables:
    """What `apply_rope` needs of a model's RoPE. A pytree: the frequencies and the factor are
    data (so a layer scan can pick a layer's tables by its traced index), the switch position
    is static. R = rotary_dim."""

    inv_freq: Any  # f32[R/2]: the frequencies (longrope: the short ones)
    attention_factor: Any = 1.0  # float (or a traced f32[]): multiplies cos and sin
    long_inv_freq: Any = None  # f32[R/2], longrope only: the frequencies from long_from_position on
    long_from_position: int | None = None  # longrope only: original_max_position_embeddings

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[-1]


jax.tree_util.register_dataclass(
    RopeTables, data_fields=["inv_freq", "attention_factor", "long_inv_freq"], meta_fields=["long_from_position"]
)


def rope_tables(head_dim: int, theta: float, scaling: dict | None, *, partial_rotary_factor: float = 1.0,
                max_position_embeddings: int, freq_factors: tuple | None = None) -> RopeTables:
    """The RoPE tables of a model: `scaling` is HF's rope scaling dict (its `rope_type`, or
    `type` in older configs, picks the scaling; None: plain RoPE), `freq_factors` per-frequency
    divisors (GGUF `rope_freqs.weight`, which llama.cpp writes for llama3-scaled models)."""
    scaling = dict(scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    if rope_type not in _TABLES_BY_TYPE:
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    missing = [key for key in _REQUIRED_KEYS.get(rope_type, ()) if scaling.get(key) is None]
    if missing:
        raise ValueError(f"rope scaling {rope_type!r} needs {', '.join(missing)}")
    # As HF rounds it: int(), so an odd product loses its last dimension.
    rotary_dim = int(head_dim * partial_rotary_factor)
    for key in ("short_factor", "long_factor"):
        if rope_type == "longrope" and len(scaling[key]) != rotary_dim // 2:
            raise ValueError(f"longrope {key} has {len(scaling[key])} entries; the rotary dimension "
                             f"{rotary_dim} needs {rotary_dim // 2}")
    tables = _TABLES_BY_TYPE[rope_type](rotary_dim, float(theta), scaling, max_position_embeddings)
    if freq_factors is not None:
        divisors = np.asarray(freq_factors, np.float32)
        tables = dataclasses.replace(tables, inv_freq=(tables.inv_freq / divisors).astype(np.float32))
    return tables


def apply_rope(x: jax.Array, positions: jax.Array, tables: RopeTables) -> jax.Array:
    """Rotate-half RoPE (the transformers layout) by each token's own position, on the first
    `tables.rotary_dim` of each head; the rest passes through. x [T, N, H], positions i32[T]."""
    inv_freq = jnp.asarray(tables.inv_freq)[None, :]  # [1, R/2]
    if tables.long_inv_freq is not None:
        is_long = (positions >= tables.long_from_position)[:, None]
        inv_freq = jnp.where(is_long, jnp.asarray(tables.long_inv_freq)[None, :], inv_freq)  # [T, R/2]
    # Angles, cos and sin in float32 and only then cast, as HF's rotary embedding does.
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, R/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]  # [T, 1, R]
    cos = (jnp.cos(angles) * tables.attention_factor).astype(x.dtype)
    sin = (jnp.sin(angles) * tables.attention_factor).astype(x.dtype)
    rotary_dim = tables.rotary_dim
    rot, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = jnp.split(rot, 2, axis=-1)
    rotated = rot * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
    return jnp.concatenate([rotated, passed], axis=-1) if passed.shape[-1] else rotated


def select_tables(pick_first, first: RopeTables, second: RopeTables) -> RopeTables:
    """`first` where `pick_first` (a bool[], traced: the layer scan's index) holds, else
    `second`: the tables of a model whose layers rotate by two bases (Gemma 3). Both must have
    the same rotary_dim and the same longrope switch."""
    if first.inv_freq.shape != second.inv_freq.shape or first.long_from_position != second.long_from_position \
            or (first.long_inv_freq is None) != (second.long_inv_freq is None):
        raise ValueError("RoPE tables of different shapes or longrope switches cannot be picked per layer")
    return jax.tree.map(lambda a, b: jnp.where(pick_first, a, b), first, second)


# -- The inverse frequencies of each rope_type, numpy float32 step by step as HF's torch code. --

def _exponents(rotary_dim: int) -> np.ndarray:
    """2i / R for each rotary pair i, float32 (HF: arange(0, R, 2).float() / R)."""
    return np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)


def _theta_powers(rotary_dim: int, theta: float) -> np.ndarray:
    """theta ** (2i / R), float32. The power is taken in float64 and rounded once: torch's
    float32 pow (what HF runs) is within an ulp of that, closer than numpy's float32 pow."""
    powers = np.float64(np.float32(theta)) ** _exponents(rotary_dim).astype(np.float64)
    return powers.astype(np.float32)


def _plain_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    return (np.float32(1.0) / _theta_powers(rotary_dim, theta)).astype(np.float32)


def _default(rotary_dim, theta, scaling, max_position_embeddings) -> RopeTables:
    return RopeTables(_plain_inv_freq(rotary_dim, theta))


def _linear(rotary_dim, theta, scaling, max_position_embeddings) -> RopeTables:
    """Position interpolation: every frequency slowed by `factor`."""
    return RopeTables((_plain_inv_freq(rotary_dim, theta) / np.float32(scaling["factor"])).astype(np.float32))


def _dynamic(rotary_dim, theta, scaling, max_position_embeddings) -> RopeTables:
    """NTK-aware scaling: a larger base, at the longest context the factor allows (module
    docstring); HF's `max_position_embeddings` is the original context here."""
    factor = scaling["factor"]
    seq_len = factor * max_position_embeddings
    base = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    return RopeTables(_plain_inv_freq(rotary_dim, base))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, Eq. 21: 0.1 * mscale * ln(scale) + 1 (1 when not scaled)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(scaling: dict, factor: float) -> float:
    """Given, or from mscale / mscale_all_dim when both are set (DeepSeek), else from the factor."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_correction_range(beta_fast, beta_slow, rotary_dim, theta, original_max, truncate) -> tuple:
    """The rotary pairs between which YaRN blends: pairs that turn more than `beta_fast` times
    over the original context keep their frequency, fewer than `beta_slow` are interpolated."""
    def pair_of(num_rotations):
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = pair_of(beta_fast), pair_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rotary_dim - 1)


def _yarn(rotary_dim, theta, scaling, max_position_embeddings) -> RopeTables:
    """YaRN (Peng et al. 2023): high frequencies kept, low ones interpolated by `factor`, a
    linear ramp over the pairs in between; cos and sin scaled by the attention factor."""
    original_max = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-V3's configs: the ratio of the contexts
        factor = max_position_embeddings / original_max
    low, high = _yarn_correction_range(scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1,
                                       rotary_dim, theta, original_max, scaling.get("truncate", True))
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolated_share = np.float32(1) - ramp.astype(np.float32)
    pos_freqs = _theta_powers(rotary_dim, theta)
    extrapolated = np.float32(1.0) / pos_freqs
    interpolated = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = interpolated * (np.float32(1) - extrapolated_share) + extrapolated * extrapolated_share
    return RopeTables(inv_freq.astype(np.float32), _yarn_attention_factor(scaling, factor))


def _longrope(rotary_dim, theta, scaling, max_position_embeddings) -> RopeTables:
    """LongRoPE (Phi-3): a searched divisor per frequency, short ones below the original
    context and long ones from it on (per token: module docstring)."""
    original_max = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = scaling.get("factor")
    if factor is None:  # Phi-3's configs: the ratio of the contexts
        factor = max_position_embeddings / original_max
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    base_freqs = _theta_powers(rotary_dim, theta)

    def scaled(divisors):
        return (np.float32(1.0) / (np.asarray(divisors, np.float32) * base_freqs)).astype(np.float32)

    return RopeTables(scaled(scaling["short_factor"]), float(attention_factor),
                      long_inv_freq=scaled(scaling["long_factor"]), long_from_position=int(original_max))


def _llama3(rotary_dim, theta, scaling, max_position_embeddings) -> RopeTables:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    inv_freq = _plain_inv_freq(rotary_dim, theta)
    factor, low_freq_factor = scaling["factor"], scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_max = scaling.get("original_max_position_embeddings") or max_position_embeddings
    low_freq_wavelen = original_max / low_freq_factor
    high_freq_wavelen = original_max / high_freq_factor
    # torch computes `number / tensor` as `reciprocal(tensor) * number`: so do we, to its bit.
    wavelen = (np.float32(1) / inv_freq) * np.float32(2 * math.pi)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    turns = (np.float32(1) / wavelen) * np.float32(original_max)  # over the original context
    smooth = (turns - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return RopeTables(np.where(is_medium, blended, scaled).astype(np.float32))


_TABLES_BY_TYPE: dict[str, Callable[..., RopeTables]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "longrope": _longrope,
    "llama3": _llama3,
}
# What each scaling cannot do without (HF raises on these too).
_REQUIRED_KEYS = {"linear": ("factor",), "dynamic": ("factor",), "longrope": ("short_factor", "long_factor"),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
# HF's `rope_type`s this engine computes (transformers' `proportional`, Gemma 4's, is not one).
ROPE_TYPES = tuple(_TABLES_BY_TYPE)
