"""GPT-2, Qwen2, Qwen3, Mistral and the mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE
against Hugging Face transformers (PyTorch CPU, float32),
through the real engine path, plus the registry (`orca_jax.models`) and the HF config fields
each family reads.

Each family gets a tiny random checkpoint saved by transformers. Parity steps an LLMEngine (its
steps return their logits) with a small token budget (chunked prefill, steps that mix prefill chunks with decodes,
a late arrival; see `drive_engine_against_hf` in conftest) and compares every produced row's
logits with HF's; greedy generation through `LLM` must equal HF `generate` token for token.
HF runs with eager attention, whose sliding-window mask is explicit.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from orca_jax import LLM
from orca_jax.models import ARCHITECTURES, SUPPORTED_MODEL_TYPES, architecture, config_from_hf
from orca_jax.models.gpt2 import GPT2ForCausalLM
from orca_jax.models.llama import LlamaForCausalLM
from orca_jax.models.moe_families import MoEForCausalLM
from orca_jax.loading.loader import load_model

ATOL = 1e-4
MISTRAL_WINDOW = 12  # below most sequence lengths here, and not a multiple of the page size (8)

_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, num_experts_per_tok=2, initializer_range=0.1)

# name -> (transformers config class, its settings, randomise biases). `initializer_range=0.1`:
# HF's default 0.02 makes attention nearly uniform, so position mistakes would hide.
FAMILIES = {
    # Learned positions, LayerNorm with bias, gelu_new MLP, fused c_attn, tied head, MHA.
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=256,
                                initializer_range=0.1), True),
    # Q/K/V biases (randomised), no output bias; GQA 4:2; tied head like the small Qwen2.5s.
    "qwen2": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  tie_word_embeddings=True, initializer_range=0.1), True),
    # Per-head q_norm/k_norm; head_dim 32, so N * H (128) != hidden (64); GQA 4:2.
    "qwen3": ("Qwen3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  max_position_embeddings=256, initializer_range=0.1), False),
    # Sliding window smaller than the sequences; GQA 4:1.
    "mistral": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=256, sliding_window=MISTRAL_WINDOW,
                                      initializer_range=0.1), False),
    # Mixtures of experts (orca_jax/models/moe.py): 8 experts, top-2, so a step of three tokens
    # or fewer leaves at least two experts without a row (decode steps here are one to five).
    "mixtral": ("MixtralConfig", dict(_MOE, intermediate_size=48, num_local_experts=8), False),
    # Q/K/V biases randomised; a sigmoid-gated shared expert wider than the routed ones (as in
    # Qwen1.5-MoE); top-k scores kept unnormalised.
    "qwen2_moe": ("Qwen2MoeConfig", dict(_MOE, intermediate_size=128, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=96, num_experts=8,
                                         norm_topk_prob=False), True),
    # Renormalised top-k; head_dim 32 with per-head Q/K norms.
    "qwen3_moe": ("Qwen3MoeConfig", dict(_MOE, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                         head_dim=32, norm_topk_prob=True), False),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")

# PyTorch is the reference here; run it single-threaded (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _model_dir(factory, name: str) -> Path:
    config_class, settings, random_biases = FAMILIES[name]
    return factory(config_class, seed=1, random_biases=random_biases, **settings)


def _hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def parity_results(tiny_hf_model_factory, engine_parity, make_logits_engine):
    """Run every family once; the tests below assert on the results."""
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
    assert stats["max_diff"] <= ATOL, f"{name}: max abs logit difference {stats['max_diff']:.3e} > {ATOL}"


@pytest.mark.parametrize("name, model_class", [
    ("gpt2", GPT2ForCausalLM), ("qwen2", LlamaForCausalLM), ("qwen3", LlamaForCausalLM), ("mistral", LlamaForCausalLM),
    *((name, MoEForCausalLM) for name in MOE_FAMILIES),
])
def test_engine_runs_the_family_model(parity_results, name, model_class):
    engine = parity_results[name]["engine"]
    assert engine.model_config.model_type == name
    assert type(engine.runner.model) is model_class


def test_mistral_window_changes_the_reference(tiny_hf_model_factory):
    """Guards the Mistral parity case: HF really applies the window on a sequence longer than
    it, so matching HF means our kernel applied it too."""
    directory = _model_dir(tiny_hf_model_factory, "mistral")
    assert load_model(directory).config.sliding_window == MISTRAL_WINDOW
    tokens = torch.tensor([np.random.default_rng(0).integers(3, 512, size=3 * MISTRAL_WINDOW).tolist()])
    windowed = _hf_model(directory)
    full = _hf_model(directory)
    full.config.sliding_window = None
    for layer in full.model.layers:
        layer.self_attn.sliding_window = None
    with torch.no_grad():
        a, b = windowed(tokens).logits[0, -1], full(tokens).logits[0, -1]
    assert (a - b).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------
# Greedy generation through LLM equals HF generate.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_matches_hf_generate(tiny_hf_model_factory, greedy_matches_hf, name):
    directory = _model_dir(tiny_hf_model_factory, name)
    rng = np.random.default_rng(123)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (3, 11, 20, 29)]
    llm = LLM(model=str(directory), max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16, page_size=8,
              num_pages=64, max_model_len=128)
    greedy_matches_hf(llm, _hf_model(directory), prompts, num_new=16)


# ---------------------------------------------------------------------------------------------
# The converter's parameter tree is exactly what the family's model init produces.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FAMILIES))
def test_loader_tree_matches_model_init(tiny_hf_model_factory, assert_tree_matches_model_init, name):
    loaded = load_model(_model_dir(tiny_hf_model_factory, name))
    assert_tree_matches_model_init(loaded)


def test_gpt2_reads_original_openai_names(tiny_hf_model_factory, tmp_path):
    """The OpenAI checkpoints (saved from `GPT2Model`) have no `transformer.` prefix and keep
    the causal-mask buffers `attn.bias`; both load to the same parameters."""
    import shutil

    from safetensors.numpy import save_file

    from orca_jax.loading.loader import read_safetensors

    directory = _model_dir(tiny_hf_model_factory, "gpt2")
    tensors = {k.removeprefix("transformer."): v for k, v in read_safetensors(directory).items()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 256, 256), np.float32))
    original = tmp_path / "gpt2-original"
    original.mkdir()
    for f in directory.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, original / f.name)
    save_file(tensors, str(original / "model.safetensors"))
    expected, got = load_model(directory).params, load_model(original).params
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# Registry and config fields.
# ---------------------------------------------------------------------------------------------
def test_registry_covers_the_supported_model_types():
    assert SUPPORTED_MODEL_TYPES == tuple(ARCHITECTURES) == (
        "llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma2", "gemma3_text", "gemma3", "phi3", "mixtral",
        "qwen2_moe", "qwen3_moe", "gpt_oss")
    with pytest.raises(ValueError, match="bert.*supported: llama, mistral, qwen2, qwen3, gpt2, gemma2, gemma3_text, "
                                         "gemma3, phi3, mixtral, qwen2_moe, qwen3_moe, gpt_oss"):
        architecture("bert")


_LLAMA_LIKE = dict(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


def test_qwen2_fields():
    c = config_from_hf({**_LLAMA_LIKE, "model_type": "qwen2", "tie_word_embeddings": True,
                        "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 1})
    assert (c.qkv_bias, c.o_bias, c.qk_norm, c.sliding_window, c.tie_word_embeddings) == (True, False, False, None, True)
    # use_sliding_window: only layers from max_window_layers on slide; all of them...
    c = config_from_hf({**_LLAMA_LIKE, "model_type": "qwen2", "use_sliding_window": True,
                        "sliding_window": 32, "max_window_layers": 0})
    assert c.sliding_window == 32
    c = config_from_hf({**_LLAMA_LIKE, "model_type": "qwen2", "use_sliding_window": True,
                        "sliding_window": 32, "layer_types": ["full_attention"] * 2})
    assert c.sliding_window is None
    # ... and so is a mix: the first layer full, the second sliding (test_gemma_phi3.py runs one).
    c = config_from_hf({**_LLAMA_LIKE, "model_type": "qwen2", "use_sliding_window": True,
                        "sliding_window": 32, "max_window_layers": 1})
    assert c.layer_windows() == (None, 32)


def test_qwen3_and_mistral_fields():
    c = config_from_hf({**_LLAMA_LIKE, "model_type": "qwen3", "head_dim": 32})
    assert (c.qk_norm, c.qkv_bias, c.o_bias, c.head_dim) == (True, False, False, 32)
    c = config_from_hf({**_LLAMA_LIKE, "model_type": "qwen3", "attention_bias": True})
    assert c.qkv_bias and c.o_bias
    c = config_from_hf({**_LLAMA_LIKE, "model_type": "mistral", "sliding_window": 4096})
    assert (c.sliding_window, c.qk_norm, c.qkv_bias) == (4096, False, False)
    assert config_from_hf({**_LLAMA_LIKE, "model_type": "mistral", "sliding_window": None}).sliding_window is None


def test_gpt2_fields():
    c = config_from_hf(dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12,
                            n_inner=None, n_positions=1024, layer_norm_epsilon=1e-5,
                            activation_function="gelu_new", eos_token_id=50256))
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        768, 3072, 12, 12, 12, 64)
    assert (c.rms_norm_eps, c.max_position_embeddings, c.hidden_act, c.tie_word_embeddings) == (
        1e-5, 1024, "gelu_new", True)
    assert c.qkv_bias and c.o_bias and c.mlp_bias and c.eos_token_ids == (50256,)
    with pytest.raises(ValueError, match="scaled"):
        config_from_hf(dict(model_type="gpt2", vocab_size=10, n_embd=64, n_layer=1, n_head=4,
                            scale_attn_by_inverse_layer_idx=True))


def test_family_from_architectures_when_model_type_is_missing():
    c = config_from_hf({**_LLAMA_LIKE, "architectures": ["Qwen3ForCausalLM"]})
    assert c.model_type == "qwen3" and c.qk_norm
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        config_from_hf({**_LLAMA_LIKE, "hidden_act": "relu"})
