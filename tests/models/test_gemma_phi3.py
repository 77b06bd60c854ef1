"""Gemma 2, Gemma 3 (text), Phi-3/4 and the per-layer attention and RoPE scalings of the Llama
families against Hugging Face transformers (PyTorch CPU, float32), through the real engine.

Each family gets a tiny random checkpoint saved by transformers with every feature of the
family switched on: sliding and full layers mixed, windows (12) shorter than the longer
prompts (up to 42 tokens) so that they matter, soft caps small enough to bite, Gemma 3's local
RoPE base beside its linearly scaled global one, Phi's LongRoPE with partial rotary, Qwen2's
`max_window_layers`, YaRN on Llama. As in test_model_families.py: an LLMEngine with a small
token budget (chunked prefill, mixed prefill/decode steps, a late arrival) compared row by
row with HF's logits, and greedy `LLM.generate` equal to HF `generate`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from orca_jax import LLM
from orca_jax.loading.loader import load_model
from orca_jax.models import config_from_hf
from orca_jax.models.gemma import GemmaForCausalLM
from orca_jax.models.llama import LlamaForCausalLM
from orca_jax.worker.compile_guard import compile_count, no_compiles

ATOL = 1e-4
WINDOW = 12  # below most sequence lengths here, and not a multiple of the page size (8)

_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, initializer_range=0.1)

# name -> (transformers config class, its settings, model class here).
FAMILIES = {
    # Alternating sliding/full layers, soft-capped scores and logits, query_pre_attn_scalar
    # other than head_dim, sandwich norms, GeGLU, scaled tied embeddings.
    "gemma2": ("Gemma2Config", dict(_SMALL, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0), GemmaForCausalLM),
    # Two sliding layers per full one, Q/K norms, a local RoPE base on the sliding layers and
    # linear scaling on the full ones.
    "gemma3_text": ("Gemma3TextConfig", dict(_SMALL, num_hidden_layers=3, sliding_window=WINDOW,
                                             sliding_window_pattern=3, query_pre_attn_scalar=16,
                                             rope_local_base_freq=100.0, rope_theta=10000.0,
                                             rope_scaling={"rope_type": "linear", "factor": 4.0}), GemmaForCausalLM),
    # LongRoPE (short factors below original_max_position_embeddings, which the prompts stay
    # under: HF's reference forward switches whole sequences) with partial rotary and a window.
    "phi3": ("Phi3Config", dict(_SMALL, num_hidden_layers=2, head_dim=None, sliding_window=WINDOW, pad_token_id=0,
                                partial_rotary_factor=0.5, original_max_position_embeddings=64,
                                rope_scaling={"type": "longrope",
                                              "short_factor": [1.0, 1.2, 1.5, 2.0],
                                              "long_factor": [1.0, 2.0, 4.0, 8.0]}), LlamaForCausalLM),
    # Qwen2's sliding window on the layers from max_window_layers on: a mixed model.
    "qwen2": ("Qwen2Config", dict(_SMALL, num_hidden_layers=3, head_dim=None, use_sliding_window=True,
                                  sliding_window=WINDOW, max_window_layers=1), LlamaForCausalLM),
    # YaRN with its attention factor.
    "llama": ("LlamaConfig", dict(_SMALL, num_hidden_layers=2,
                                  rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 64}), LlamaForCausalLM),
}

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _model_dir(factory, name: str) -> Path:
    config_class, settings, _ = FAMILIES[name]
    settings = {k: v for k, v in settings.items() if v is not None}
    return factory(config_class, seed=3, **settings)


def _hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def parity_results(tiny_hf_model_factory, engine_parity, make_logits_engine):
    results = {}
    for i, name in enumerate(FAMILIES):
        directory = _model_dir(tiny_hf_model_factory, name)
        engine = make_logits_engine(
            model=str(directory), warmup=False, page_size=8, max_num_batched_tokens=16, min_token_bucket=16,
            max_num_seqs=4, num_pages=64, max_model_len=128, attention_impl="reference",
        )
        results[name] = engine_parity(engine, _hf_model(directory), np.random.default_rng(i))
        results[name]["engine"] = engine
    return results


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers_through_engine(parity_results, name):
    stats = parity_results[name]
    print(f"{name}: max |logit diff| = {stats['max_diff']:.3e} over {stats['compared_rows']} rows, "
          f"{stats['steps']} steps ({stats['mixed_steps']} mixed)")
    assert stats["mixed_steps"] > 0
    assert stats["max_diff"] <= ATOL, f"{name}: max abs logit difference {stats['max_diff']:.3e} > {ATOL}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_engine_runs_the_family_model(parity_results, name):
    engine = parity_results[name]["engine"]
    assert engine.model_config.model_type == name
    assert type(engine.runner.model) is FAMILIES[name][2]


# Through the default (CPU) kernel and a warmed-up engine, one family per model class and
# kernel feature: Gemma 2 (windows on alternate layers, soft caps), Gemma 3 (per-layer RoPE
# tables), Phi-3 (LongRoPE, partial rotary, a window on every layer). Qwen2's mix and YaRN
# change nothing the kernel sees that these do not; their logits are checked above.
GREEDY_FAMILIES = ["gemma2", "gemma3_text", "phi3"]


@pytest.mark.parametrize("name", GREEDY_FAMILIES)
def test_greedy_generation_matches_hf_generate_compiling_nothing_after_warmup(tiny_hf_model_factory,
                                                                             greedy_matches_hf, name):
    """Greedy tokens equal HF `generate`'s, and serving them (mixed sliding and full layers,
    each layer's window and RoPE as data) builds no program after the engine's warm-up."""
    directory = _model_dir(tiny_hf_model_factory, name)
    rng = np.random.default_rng(123)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (3, 11, 20, 29)]
    llm = LLM(model=str(directory), max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16, page_size=8,
              num_pages=64, max_model_len=128)
    hf_model = _hf_model(directory)
    compile_count()
    with no_compiles(f"serving {name}"):
        greedy_matches_hf(llm, hf_model, prompts, num_new=16)


@pytest.mark.parametrize("name, quantization", [(name, None) for name in FAMILIES]
                         + [("phi3", "int8"), ("gemma3_text", "int8")])  # the phi-4-mini-cpu preset's weights
def test_loader_tree_matches_model_init(tiny_hf_model_factory, assert_tree_matches_model_init, name, quantization):
    loaded = load_model(_model_dir(tiny_hf_model_factory, name), quantization=quantization)
    assert loaded.config.quantization == quantization
    assert_tree_matches_model_init(loaded)


def test_the_mixed_families_mix(tiny_hf_model_factory):
    """Guards the parity cases: the configs really mix sliding and full layers as HF does."""
    windows = {name: load_model(_model_dir(tiny_hf_model_factory, name)).config.layer_windows()
               for name in ("gemma2", "gemma3_text", "qwen2")}
    assert windows == {"gemma2": (WINDOW, None, WINDOW, None), "gemma3_text": (WINDOW, WINDOW, None),
                       "qwen2": (None, WINDOW, WINDOW)}


@pytest.mark.parametrize("name, feature, off", [
    ("gemma2", "attn_logit_softcapping", None), ("gemma2", "final_logit_softcapping", None),
    ("gemma2", "sliding_window", 4096), ("gemma3_text", "rope_local_base_freq", 10000.0),
    ("phi3", "rope_scaling", None),
])
def test_each_feature_changes_hf_logits(tiny_hf_model_factory, name, feature, off):
    """Guards the parity cases: each feature switched on above changes HF's own logits on a
    prompt longer than the window, so matching HF means it was applied here too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = _model_dir(tiny_hf_model_factory, name)
    tokens = torch.tensor([np.random.default_rng(0).integers(3, 512, size=3 * WINDOW).tolist()])
    config = AutoConfig.from_pretrained(directory)
    config_off = AutoConfig.from_pretrained(directory, **{feature: off})
    if feature == "rope_local_base_freq" and "sliding_attention" in (config_off.rope_parameters or {}):
        config_off.rope_parameters["sliding_attention"]["rope_theta"] = off
    if feature == "rope_scaling":  # transformers 5 keeps the scaling in rope_parameters
        config_off.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"],
                                      "partial_rotary_factor": config.rope_parameters.get("partial_rotary_factor")}
    logits = []
    for cfg in (config, config_off):
        model = AutoModelForCausalLM.from_pretrained(directory, config=cfg, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        with torch.no_grad():
            logits.append(model(tokens).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 1e-3


_LLAMA_LIKE = dict(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2)


def test_layer_types_from_every_hf_spelling():
    # Qwen2/3: use_sliding_window + max_window_layers, or layer_types spelled out.
    c = config_from_hf({**_LLAMA_LIKE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32,
                        "max_window_layers": 2})
    assert c.layer_windows() == (None, None, 32, 32) and c.mixes_attention_types
    c = config_from_hf({**_LLAMA_LIKE, "model_type": "qwen3", "use_sliding_window": True, "sliding_window": 32,
                        "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert c.layer_windows() == (32, None, 32, None)
    # Gemma 3: sliding_window_pattern.
    c = config_from_hf({**_LLAMA_LIKE, "model_type": "gemma3_text", "head_dim": 16, "sliding_window": 8,
                        "sliding_window_pattern": 2})
    assert c.layer_windows() == (8, None, 8, None)
    # Alike on every layer: a static window, no mix.
    c = config_from_hf({**_LLAMA_LIKE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32,
                        "max_window_layers": 0})
    assert c.layer_windows() == (32,) * 4 and not c.mixes_attention_types
    with pytest.raises(ValueError, match="layer_types"):
        config_from_hf({**_LLAMA_LIKE, "model_type": "qwen3", "sliding_window": 32, "use_sliding_window": True,
                        "layer_types": ["chunked_attention"] * 4})


def test_gemma3_vision_checkpoint_config_reads_its_text_tower():
    text = {**_LLAMA_LIKE, "model_type": "gemma3_text", "head_dim": 16, "sliding_window": 8}
    c = config_from_hf({"model_type": "gemma3", "text_config": text, "vision_config": {}, "eos_token_id": [1, 106]})
    assert (c.model_type, c.num_layers, c.qk_norm, c.eos_token_ids) == ("gemma3", 4, True, (1, 106))


@pytest.mark.parametrize("model_type, config_class", [("gemma2", "Gemma2Config"), ("gemma3_text", "Gemma3TextConfig")])
def test_gemma_defaults_are_transformers_own(model_type, config_class):
    """A key left out of config.json means what transformers' config class says it means."""
    import transformers

    from orca_jax.models.gemma import HF_DEFAULTS

    hf = getattr(transformers, config_class)()
    rope = getattr(hf, "rope_parameters", None) or {}
    for key, value in HF_DEFAULTS[model_type].items():
        if key == "rope_theta":  # transformers 5 keeps it in rope_parameters (by layer type for Gemma 3)
            actual = getattr(hf, "rope_theta", None) or rope.get("full_attention", rope).get("rope_theta")
        elif key == "rope_local_base_freq":
            actual = getattr(hf, key, None) or rope["sliding_attention"]["rope_theta"]
        elif key == "sliding_window_pattern":  # transformers 5 derives layer_types from it
            actual = next(i + 1 for i, kind in enumerate(hf.layer_types) if kind == "full_attention")
        else:
            actual = getattr(hf, key)
        assert actual == value, key


def test_the_hubs_sparse_gemma3_config_builds_the_model_transformers_builds():
    """google/gemma-3-4b-it's config.json (its text_config as on the hub: only what differs from
    the defaults): the head counts, vocabulary and global RoPE base come from the defaults."""
    from transformers import Gemma3Config

    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
           "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}
    c, hf = config_from_hf(hub), Gemma3Config(**hub).text_config
    assert (c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim, c.query_pre_attn_scalar) == (
        hf.vocab_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.query_pre_attn_scalar)
    assert c.rope_theta == 1_000_000.0 and c.rope_local_theta == 10000.0
    assert dict(c.rope_scaling)["factor"] == 8.0
    assert c.layer_windows() == tuple(None if t == "full_attention" else 1024 for t in hf.layer_types)
    assert c.eos_token_ids == (1, 106) and c.max_position_embeddings == 131072
