"""Llama parity with Hugging Face transformers (PyTorch CPU, float32), through the real engine path.

Every parity case builds an LLMEngine on a tiny random checkpoint saved with transformers, then
steps it (each step returning its logits, through the runner seam) with a small token
budget, so prompts are chunk-prefilled and steps mix prefill chunks with decodes of other
requests. Each row whose scheduled tokens reach the end of its sequence is compared with HF's
last-position logits on the same full token sequence.

The random checkpoints use `initializer_range=0.1` (HF's default 0.02 makes q.k so small that
attention is nearly uniform and RoPE mistakes hide below the tolerance); biases, which HF
initialises to zero, are randomised so a mishandled bias shows.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from orca_jax import LLM
from orca_jax.models import rope
from orca_jax.models.layers import model_rope_tables
from orca_jax.loading.loader import load_model

ATOL = 1e-4
VOCAB = 512  # conftest.TINY_VOCAB

LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=64, rope_theta=10000.0,
)

# name -> LlamaConfig overrides for `tiny_llama_factory` (on top of conftest's defaults:
# hidden 64, 2 layers, vocab 512).
PARITY_CONFIGS = {
    # GQA 4 query heads over 2 KV heads; head_dim 32, so N * H (128) != hidden (64).
    "gqa-untied-hd32": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # MHA, tied embeddings, head_dim 64.
    "mha-tied-hd64": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
    # Llama 3.1 RoPE scaling. With head_dim 16 and original_max_position_embeddings 64 the eight
    # wavelengths (6.3 .. 19869) fall in all three regimes: kept (< 16), blended (16..64),
    # slowed by `factor` (> 64). GQA 4:1.
    "gqa-llama3-rope": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_parameters=LLAMA3_ROPE),
    # Biases on q/k/v/o and on the MLP (randomised below), MHA 4 heads.
    "mha-bias": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, attention_bias=True, mlp_bias=True),
}

# Prompt lengths: with max_num_batched_tokens=16 the long ones are split into several chunks,
# and while they prefill the short ones are already decoding.
PROMPT_LENGTHS = (5, 23, 12, 37)
LATE_PROMPT_LENGTH = 9  # arrives after a few steps: joins a running batch
MAX_TOKENS = 5


# PyTorch is the reference here; run it single-threaded (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _model_dir(factory, tmp_path_factory, name: str) -> Path:
    overrides = dict(PARITY_CONFIGS[name], initializer_range=0.1)
    directory = factory(seed=1, **overrides)
    if overrides.get("attention_bias") or overrides.get("mlp_bias"):
        directory = _with_random_biases(directory, tmp_path_factory.mktemp(f"{name}-biased"))
    return directory


def _with_random_biases(src: Path, dst: Path) -> Path:
    """Copy of the checkpoint at `src` with every bias set to random values."""
    from transformers import LlamaForCausalLM as HFLlama

    model = HFLlama.from_pretrained(src, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    count = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
                count += 1
    assert count == model.config.num_hidden_layers * 7, count  # q, k, v, o, gate, up, down
    model.save_pretrained(dst, safe_serialization=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, dst / f.name)
    return dst


def _hf_model(directory: Path):
    from transformers import LlamaForCausalLM as HFLlama

    return HFLlama.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def parity_results(tiny_llama_factory, tmp_path_factory, engine_parity, make_logits_engine):
    """Run every parity config once; tests below assert on the results."""
    results = {}
    for i, name in enumerate(PARITY_CONFIGS):
        directory = _model_dir(tiny_llama_factory, tmp_path_factory, name)
        engine = make_logits_engine(
            model=str(directory), warmup=False, page_size=8, max_num_batched_tokens=16, min_token_bucket=16,
            max_num_seqs=4, num_pages=64, max_model_len=128, attention_impl="reference",
        )
        results[name] = engine_parity(
            engine, _hf_model(directory), np.random.default_rng(i), prompt_lengths=PROMPT_LENGTHS,
            late_prompt_length=LATE_PROMPT_LENGTH, max_tokens=MAX_TOKENS,
        )
        results[name]["engine"] = engine
        results[name]["dir"] = directory
    return results


@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_logits_match_transformers_through_engine(parity_results, name):
    stats = parity_results[name]
    print(f"{name}: max |logit diff| = {stats['max_diff']:.3e} over {stats['compared_rows']} rows, "
          f"{stats['steps']} steps ({stats['mixed_steps']} mixed)")
    assert stats["max_diff"] <= ATOL, f"{name}: max abs logit difference {stats['max_diff']:.3e} > {ATOL}"


def test_llama3_rope_config_is_applied(parity_results):
    """The llama3 case really runs with scaled frequencies (guards the parity case above from
    silently testing plain RoPE on both sides)."""
    engine = parity_results["gqa-llama3-rope"]["engine"]
    cfg = engine.model_config
    assert cfg.rope_scaling_dict == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    plain = rope.rope_tables(cfg.head_dim, cfg.rope_theta, None, max_position_embeddings=64).inv_freq
    scaled = model_rope_tables(cfg).inv_freq  # what the model's layers fold into the step
    assert np.allclose(scaled[:1], plain[:1])  # short wavelength kept
    assert np.allclose(scaled[-1], plain[-1] / 8.0)  # long wavelength slowed by `factor`
    assert not np.allclose(scaled, plain)

    # The same frequencies as transformers computes.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _hf_model(parity_results["gqa-llama3-rope"]["dir"])
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    np.testing.assert_allclose(scaled, hf_inv_freq.numpy(), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# Greedy generation through LLM / LLMEngine.step equals HF generate.
# ---------------------------------------------------------------------------------------------
def test_greedy_generation_matches_hf_generate(tiny_llama_dir, greedy_matches_hf):
    rng = np.random.default_rng(123)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (3, 11, 20, 29, 6)]
    llm = LLM(model=str(tiny_llama_dir), max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16,
              page_size=8, num_pages=64, max_model_len=128)
    greedy_matches_hf(llm, _hf_model(tiny_llama_dir), prompts, num_new=16)
    assert llm.engine.allocator.num_used == 0


# ---------------------------------------------------------------------------------------------
# The loader's parameter tree is exactly what the model's init produces.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_loader_tree_matches_model_init(tiny_llama_factory, tmp_path_factory, assert_tree_matches_model_init,
                                        name):
    loaded = load_model(_model_dir(tiny_llama_factory, tmp_path_factory, name))
    assert_tree_matches_model_init(loaded)
    has_bias = "bias" in loaded.params["params"]["layers"]["attn"]["q_proj"]
    assert has_bias == PARITY_CONFIGS[name].get("attention_bias", False)
    assert ("lm_head" in loaded.params["params"]) != PARITY_CONFIGS[name].get("tie_word_embeddings", False)


# ---------------------------------------------------------------------------------------------
# The model's attention soft cap reaches the kernel.
# ---------------------------------------------------------------------------------------------
def test_attention_soft_cap_reaches_the_kernel():
    """`ModelConfig.attn_logit_softcapping` changes the logits when it bites (a cap of 0.5 on
    scores of a weight scale of 0.5), and a cap far above every score changes nothing: so the
    value travels config -> PagedAttention -> kernel and is applied as c * tanh(s / c)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from orca_jax.worker.batch import build_batch
    from orca_jax.config import EngineConfig, ModelConfig
    from orca_jax.core.kv_cache import PageAllocator
    from orca_jax.models import architecture
    from orca_jax.core.sampling_params import SamplingParams
    from orca_jax.core.sequence import Sequence

    base = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    engine_config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, page_size=8, num_pages=8,
                                 max_model_len=64).resolve(base)
    seq = Sequence(0, "r0", 0, list(range(3, 15)), SamplingParams(max_tokens=1), 0)
    seq.page_ids = PageAllocator(8, 8).allocate(2)
    batch = jax.tree.map(jnp.asarray, build_batch(engine_config, [(seq, 12)]))
    kv_cache = jnp.zeros((2, 8, 8, 4, 8), jnp.float32)

    model_class = architecture("llama").model_class
    params = jax.jit(model_class(base).init)(jax.random.key(0), batch.input_ids, kv_cache, batch.metadata,
                                             batch.logits_indices)
    params = jax.tree.map(lambda w: w * 25.0, params)  # the cap adds no parameter

    def logits(cap):
        model = model_class(dataclasses.replace(base, attn_logit_softcapping=cap))
        out, _ = jax.jit(model.apply)(params, batch.input_ids, kv_cache, batch.metadata, batch.logits_indices)
        return np.asarray(out[0])

    uncapped = logits(None)
    np.testing.assert_allclose(logits(1e6), uncapped, rtol=1e-5, atol=1e-5)
    assert np.abs(logits(0.5) - uncapped).max() > 1e-2
