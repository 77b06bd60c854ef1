"""RoPE scaling (orca_jax/models/rope.py) against transformers: each rope_type's frequencies and
attention factor against `ROPE_INIT_FUNCTIONS`, the rotation against `apply_rotary_pos_emb` fed
by HF's own rotary embedding module, the per-token LongRoPE switch, and the reading of HF's
RoPE config layouts (orca_jax/models/hf_config.py)."""

from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama import modeling_llama
from transformers.models.phi3 import modeling_phi3

from orca_jax.models import hf_config, rope

pytestmark = pytest.mark.usefixtures("torch_single_thread")

MAX_POS, ORIGINAL = 256, 64
_SIZES = dict(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=MAX_POS)
# Phi-3 derives head_dim (16) from the sizes; half of it rotates: 4 pairs, so 4 factors each.
_PHI3 = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=MAX_POS, partial_rotary_factor=0.5,
             original_max_position_embeddings=ORIGINAL)
_SHORT, _LONG = [1.0, 1.2, 1.5, 2.0], [1.0, 2.0, 4.0, 8.0]
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}

# name -> (transformers config class, its settings, the seq_len handed to HF's init function).
CASES = {
    "default": ("LlamaConfig", dict(_SIZES), None),
    "default-partial": ("Phi3Config", dict(_PHI3), None),
    "linear": ("LlamaConfig", dict(_SIZES, rope_scaling={"rope_type": "linear", "factor": 4.0}), None),
    "linear-partial": ("LlamaConfig", dict(_SIZES, partial_rotary_factor=0.5,
                                           rope_scaling={"rope_type": "linear", "factor": 4.0}), None),
    # The one table an engine uses: HF's at the longest context the factor is meant for.
    "dynamic": ("LlamaConfig", dict(_SIZES, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 2 * MAX_POS),
    "yarn": ("LlamaConfig", dict(_SIZES, rope_scaling=_YARN), None),
    "yarn-partial": ("LlamaConfig", dict(_SIZES, partial_rotary_factor=0.75, rope_scaling=_YARN), None),
    "yarn-attention-factor": ("LlamaConfig", dict(_SIZES, rope_scaling={**_YARN, "attention_factor": 0.8}), None),
    "yarn-mscale": ("LlamaConfig", dict(_SIZES, rope_scaling={**_YARN, "factor": 40.0, "mscale": 1.0,
                                                              "mscale_all_dim": 0.8}), None),
    "yarn-mscale-alone": ("LlamaConfig", dict(_SIZES, rope_scaling={**_YARN, "mscale": 0.7}), None),
    "yarn-betas-untruncated": ("LlamaConfig", dict(_SIZES, rope_scaling={**_YARN, "beta_fast": 16, "beta_slow": 2,
                                                                         "truncate": False}), None),
    "longrope-short": ("Phi3Config", dict(_PHI3, rope_scaling={"type": "longrope", "short_factor": _SHORT,
                                                               "long_factor": _LONG}), ORIGINAL),
    "longrope-long": ("Phi3Config", dict(_PHI3, rope_scaling={"type": "longrope", "short_factor": _SHORT,
                                                              "long_factor": _LONG}), ORIGINAL + 1),
    "longrope-attention-factor": ("Phi3Config", dict(_PHI3, rope_scaling={
        "rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG, "attention_factor": 1.3}), None),
    "llama3": ("LlamaConfig", dict(_SIZES, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": ORIGINAL}), None),
}


def _hf_config(name: str):
    config_class, settings, _ = CASES[name]
    # A copy: transformers fills defaults (theta, the partial factor) into the dict it is given.
    return getattr(transformers, config_class)(**copy.deepcopy(settings))


def _rotary_class(config):
    return modeling_phi3.Phi3RotaryEmbedding if config.model_type == "phi3" else modeling_llama.LlamaRotaryEmbedding


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _our_tables(config) -> rope.RopeTables:
    """Our tables from the config as its config.json holds it, read by hf_config."""
    cfg = config.to_dict()
    theta, scaling = hf_config.rope_from_hf(cfg)
    return rope.rope_tables(_head_dim(config), theta, dict(scaling) if scaling else None,
                            partial_rotary_factor=hf_config.partial_rotary_factor_from_hf(cfg),
                            max_position_embeddings=cfg["max_position_embeddings"])


def _hf_inv_freq(config, seq_len=None) -> tuple[np.ndarray, float]:
    """(inv_freq, attention_factor) as transformers computes them for a sequence of seq_len."""
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":  # each model's rotary class computes the plain frequencies itself
        inv_freq, factor = _rotary_class(config).compute_default_rope_parameters(config)
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, device="cpu", seq_len=seq_len)
    return inv_freq.numpy(), factor


@pytest.mark.parametrize("name", list(CASES))
def test_tables_match_transformers(name):
    config = _hf_config(name)
    ours = _our_tables(config)
    hf_inv_freq, hf_factor = _hf_inv_freq(config, CASES[name][2])
    seq_len = CASES[name][2]
    inv_freq = ours.long_inv_freq if name == "longrope-long" else ours.inv_freq
    assert inv_freq.dtype == np.float32 and inv_freq.shape == hf_inv_freq.shape
    np.testing.assert_allclose(inv_freq, hf_inv_freq, rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(hf_factor, rel=1e-6)
    if name.startswith("longrope"):
        assert ours.long_from_position == ORIGINAL and seq_len in (None, ORIGINAL, ORIGINAL + 1)
    else:
        assert ours.long_inv_freq is None and ours.long_from_position is None


def test_cases_exercise_what_they_name():
    """Guards the parity cases above from comparing plain RoPE on both sides."""
    plain = _our_tables(_hf_config("default")).inv_freq
    for name in ("linear", "dynamic", "yarn", "llama3"):
        assert not np.allclose(_our_tables(_hf_config(name)).inv_freq, plain), name
    factors = {name: _our_tables(_hf_config(name)).attention_factor for name in CASES}
    assert factors["yarn"] == pytest.approx(0.1 * math.log(4.0) + 1)
    assert factors["yarn-attention-factor"] == 0.8
    assert factors["yarn-mscale"] != factors["yarn"] and factors["yarn-mscale"] != pytest.approx(1.0)
    assert factors["longrope-short"] == pytest.approx(math.sqrt(1 + math.log(MAX_POS / ORIGINAL) / math.log(ORIGINAL)))
    assert factors["longrope-attention-factor"] == 1.3
    assert _our_tables(_hf_config("yarn-partial")).rotary_dim == 12
    assert _our_tables(_hf_config("longrope-short")).rotary_dim == 8


def test_freq_factors_divide_the_frequencies():
    """GGUF's rope_freqs.weight (llama.cpp's llama3 scaling) divides each frequency."""
    divisors = tuple(np.linspace(1.0, 8.0, 8).tolist())
    plain = rope.rope_tables(16, 5e5, None, max_position_embeddings=MAX_POS)
    divided = rope.rope_tables(16, 5e5, None, max_position_embeddings=MAX_POS, freq_factors=divisors)
    np.testing.assert_array_equal(divided.inv_freq, (plain.inv_freq / np.float32(divisors)).astype(np.float32))


def test_unknown_rope_type_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="unsupported rope scaling 'proportional'; supported: default, linear, "
                                         "dynamic, yarn, longrope, llama3"):
        rope.rope_tables(16, 1e4, {"rope_type": "proportional", "factor": 2.0}, max_position_embeddings=MAX_POS)
    # The older `type` spelling picks the type too.
    by_type = rope.rope_tables(16, 1e4, {"type": "linear", "factor": 2.0}, max_position_embeddings=MAX_POS)
    by_rope_type = rope.rope_tables(16, 1e4, {"rope_type": "linear", "factor": 2.0}, max_position_embeddings=MAX_POS)
    np.testing.assert_array_equal(by_type.inv_freq, by_rope_type.inv_freq)


# -- The rotation: apply_rope against HF's apply_rotary_pos_emb, with HF's own cos/sin. --

def _hf_rotated(config, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """HF's rotation of x [T, N, H] at `positions`, through a fresh rotary module (its dynamic
    update sees these positions only) and apply_rotary_pos_emb: Llama's, or Phi-3's where only
    part of each head rotates (Llama's rotates whole heads)."""
    partial = config.rope_parameters.get("partial_rotary_factor", 1.0) < 1.0
    apply_rotary_pos_emb = (modeling_phi3 if partial else modeling_llama).apply_rotary_pos_emb
    q = torch.from_numpy(x).permute(1, 0, 2)[None]  # [1, N, T, H]
    with torch.no_grad():
        cos, sin = _rotary_class(config)(config)(q, torch.from_numpy(positions)[None].long())
        rotated, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return rotated[0].permute(1, 0, 2).float().numpy()


def _ours_rotated(config, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    rotate = jax.jit(rope.apply_rope)  # the tables travel as a pytree argument
    return np.asarray(rotate(jnp.asarray(x), jnp.asarray(positions, jnp.int32), _our_tables(config)))


@pytest.mark.parametrize("name", ["default", "default-partial", "yarn", "yarn-partial", "longrope-short", "llama3"])
def test_apply_rope_matches_transformers(name):
    config = _hf_config(name)
    rng = np.random.default_rng(0)
    positions = rng.permutation(ORIGINAL).astype(np.int32)[:24]  # below the longrope switch
    x = rng.standard_normal((24, 3, _head_dim(config))).astype(np.float32)
    ours, hf = _ours_rotated(config, x, positions), _hf_rotated(config, x, positions)
    np.testing.assert_allclose(ours, hf, rtol=0, atol=1e-6)
    rotary_dim = _our_tables(config).rotary_dim
    np.testing.assert_array_equal(ours[..., rotary_dim:], x[..., rotary_dim:])  # partial: passed through


def test_apply_rope_casts_cos_and_sin_to_the_dtype_like_transformers():
    config = _hf_config("yarn")
    rng = np.random.default_rng(1)
    positions = np.arange(40, dtype=np.int32)
    x = rng.standard_normal((40, 2, 16)).astype(np.float32)
    q = torch.from_numpy(x).to(torch.bfloat16).permute(1, 0, 2)[None]  # [1, N, T, H]
    with torch.no_grad():
        cos, sin = modeling_llama.LlamaRotaryEmbedding(config)(q, torch.from_numpy(positions)[None].long())
        hf, _ = modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)
    hf = hf[0].permute(1, 0, 2).float().numpy()
    ours = rope.apply_rope(jnp.asarray(x, jnp.bfloat16), jnp.asarray(positions), _our_tables(config))
    assert ours.dtype == jnp.bfloat16
    # Bit for bit: cos and sin rounded to bfloat16 before the products, as HF does (rotating in
    # float32 and rounding once differs in ~40% of the elements by a bfloat16 ulp).
    np.testing.assert_array_equal(np.asarray(ours, np.float32), hf)


def test_longrope_switches_per_token_at_the_original_context():
    """Positions below original_max_position_embeddings rotate as HF does for a sequence that
    stays short, those from it on as HF does once a sequence grows long."""
    config = _hf_config("longrope-short")
    rng = np.random.default_rng(2)
    positions = np.arange(ORIGINAL - 6, ORIGINAL + 6, dtype=np.int32)
    x = rng.standard_normal((len(positions), 2, 16)).astype(np.float32)
    ours = _ours_rotated(config, x, positions)
    is_long = positions >= ORIGINAL
    short_hf = _hf_rotated(config, x[~is_long], positions[~is_long])  # max position + 1 == ORIGINAL: short
    long_hf = _hf_rotated(config, x[is_long], positions[is_long])
    np.testing.assert_allclose(ours[~is_long], short_hf, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ours[is_long], long_hf, rtol=0, atol=1e-6)
    # The factors differ, so the switch is seen: the long rows are not what short factors give.
    short_only = rope.RopeTables(_our_tables(config).inv_freq, _our_tables(config).attention_factor)
    as_short = np.asarray(rope.apply_rope(jnp.asarray(x), jnp.asarray(positions), short_only))
    assert not np.allclose(as_short[is_long], ours[is_long], atol=1e-3)
    np.testing.assert_allclose(as_short[~is_long], ours[~is_long], rtol=0, atol=1e-6)


def test_select_tables_picks_by_a_traced_flag():
    local = rope.rope_tables(16, 100.0, None, max_position_embeddings=MAX_POS)
    scaled = rope.rope_tables(16, 1e4, {"rope_type": "yarn", "factor": 4.0}, max_position_embeddings=MAX_POS)
    pick = jax.jit(lambda flag: rope.select_tables(flag, local, scaled))
    for flag, expected in ((True, local), (False, scaled)):
        picked = pick(jnp.asarray(flag))
        np.testing.assert_array_equal(np.asarray(picked.inv_freq), expected.inv_freq)
        assert float(picked.attention_factor) == pytest.approx(expected.attention_factor)
    longrope = _our_tables(_hf_config("longrope-short"))
    with pytest.raises(ValueError, match="cannot be picked per layer"):
        rope.select_tables(jnp.asarray(True), longrope, rope.rope_tables(8, 1e4, None, max_position_embeddings=8))


# -- Reading HF's RoPE config layouts. --

_LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def test_rope_from_hf_reads_every_layout_alike():
    new = hf_config.rope_from_hf({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **_LLAMA3}})
    old = hf_config.rope_from_hf({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **_LLAMA3}})
    older = hf_config.rope_from_hf({"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **_LLAMA3}})
    both = hf_config.rope_from_hf({"rope_theta": 5e5, "rope_scaling": {"type": "llama3", "rope_type": "llama3",
                                                                       **_LLAMA3}})
    assert new == old == older == both == (5e5, tuple(sorted({**_LLAMA3, "rope_type": "llama3"}.items())))
    for plain in ({"rope_theta": 1234.0}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}},
                  {"rope_theta": 1234.0, "rope_scaling": None}, {"rope_theta": 1234.0, "rope_scaling": {"type": None}}):
        assert hf_config.rope_from_hf(plain) == (1234.0, None)


def test_rope_from_hf_keeps_the_whole_dict_hashable():
    """Phi-3's config.json: `type` beside `rope_type`, the factors as lists, theta and the
    partial factor inside the dict, the original context at the top level too."""
    cfg = _hf_config("longrope-attention-factor").to_dict()
    theta, scaling = hf_config.rope_from_hf(cfg)
    hash(scaling)
    assert theta == 10000.0 and dict(scaling) == {
        "rope_type": "longrope", "short_factor": tuple(_SHORT), "long_factor": tuple(_LONG),
        "attention_factor": 1.3, "original_max_position_embeddings": ORIGINAL}
    assert [key for key, _ in scaling] == sorted(dict(scaling))


@pytest.mark.parametrize("cfg, original", [
    # As HF's standardize_rope_params: the dict's, else the top level's (Phi-3), else max_position_embeddings.
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
      "max_position_embeddings": 256, "original_max_position_embeddings": 64}, 32),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "max_position_embeddings": 256,
      "original_max_position_embeddings": 64}, 64),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}, "max_position_embeddings": 256}, 256),
])
def test_rope_from_hf_fills_the_original_context(cfg, original):
    assert dict(hf_config.rope_from_hf(cfg)[1])["original_max_position_embeddings"] == original


def test_rope_from_hf_reads_gemma3_layer_type_layout_and_old_aliases():
    """Gemma 3's new layout nests a dict per layer type: the model's scaling is the full layers'."""
    cfg = _hf_config("default").to_dict()
    gemma = transformers.Gemma3TextConfig(rope_local_base_freq=100.0, rope_theta=1e6,
                                          rope_scaling={"rope_type": "linear", "factor": 8.0}).to_dict()
    assert "sliding_attention" in gemma["rope_parameters"]  # the layout this test is about
    assert hf_config.rope_from_hf(gemma) == (1e6, (("factor", 8.0), ("rope_type", "linear")))
    assert hf_config.rope_from_hf(cfg) == (10000.0, None)
    su = {"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}, "max_position_embeddings": 8}
    assert dict(hf_config.rope_from_hf(su)[1])["rope_type"] == "longrope"  # LongRoPE's first name


@pytest.mark.parametrize("cfg", [
    {"rope_scaling": {"rope_type": "proportional", "factor": 2.0}},
    {"rope_parameters": {"type": "mrope", "rope_theta": 1e4}},
])
def test_rope_from_hf_refuses_unknown_types(cfg):
    rope_type = (cfg.get("rope_scaling") or cfg["rope_parameters"]).get("rope_type") or "mrope"
    with pytest.raises(ValueError, match=f"unsupported rope scaling '{rope_type}'; supported: default, linear, "
                                         "dynamic, yarn, longrope, llama3"):
        hf_config.rope_from_hf(cfg)


@pytest.mark.parametrize("cfg, factor", [
    ({}, 1.0), ({"partial_rotary_factor": 0.5}, 0.5), ({"partial_rotary_factor": None}, 1.0),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}}, 0.75),
    ({"partial_rotary_factor": 0.5, "rope_parameters": {"partial_rotary_factor": 0.75}}, 0.75),  # HF: the dict's
])
def test_partial_rotary_factor_from_hf(cfg, factor):
    assert hf_config.partial_rotary_factor_from_hf(cfg) == factor
    assert hf_config.partial_rotary_factor_from_hf(_hf_config("default-partial").to_dict()) == 0.5
