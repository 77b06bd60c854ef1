"""The perplexity evaluator (orca_jax.bench.perplexity) is right: on a tiny random Llama its
NLL is Hugging Face transformers' (PyTorch CPU, float32) on the same tokens, whatever the
chunk size, in one window or in sliding windows; it refuses what it cannot score."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from orca_jax import LLM
from orca_jax.bench.perplexity import perplexity, sliding_windows

# Mean NLL (nats) against transformers': both float32, summed in float64. Measured: 2e-8 (one
# window), 3e-9 (sliding windows).
NLL_ATOL = 1e-4
# Mean NLL across chunk sizes: the same model on the same cache contents, chunked differently.
# Measured: 6e-8 (64 against 37), 0 (64 against 512).
CHUNK_ATOL = 1e-5
NUM_TOKENS = 300  # several chunks of CHUNK_SIZE, so later chunks read what earlier ones cached
CHUNK_SIZE = 64

# PyTorch is the reference here; run it single-threaded (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_llama_factory):
    # initializer_range 0.1: HF's default 0.02 gives logits so flat that every NLL is near log(V).
    return tiny_llama_factory(seed=3, initializer_range=0.1)


@pytest.fixture(scope="module")
def llm(model_dir):
    # One token bucket (8): the engine's programs are not what is tested here.
    return LLM(str(model_dir), max_num_seqs=4, max_num_batched_tokens=8, page_size=8, num_pages=32,
               max_model_len=128)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokens(llm):
    rng = np.random.default_rng(0)
    return rng.integers(3, llm.engine.model_config.vocab_size, size=NUM_TOKENS).tolist()


def hf_token_nll(hf_model, tokens: list[int]) -> np.ndarray:
    """NLL (float64) of tokens[1:], each given all tokens before it, from one full forward."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0].double()
    log_probs = torch.log_softmax(logits[:-1], dim=-1)
    return -log_probs.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()


def test_nll_matches_transformers_on_the_full_sequence(llm, hf_model, tokens):
    ref = hf_token_nll(hf_model, tokens)
    result = perplexity(llm, tokens, chunk_size=CHUNK_SIZE)
    assert result.num_tokens == NUM_TOKENS - 1
    assert abs(result.mean_nll - ref.mean()) < NLL_ATOL, (result.mean_nll, ref.mean())
    assert result.perplexity == pytest.approx(math.exp(result.mean_nll))
    # The model is far from uniform, so a wrong position or cache read would show.
    assert abs(ref.mean() - math.log(llm.engine.model_config.vocab_size)) > 0.1


def test_sliding_windows_match_transformers_window_by_window(llm, hf_model, tokens):
    window, stride = 128, 48
    ref = []
    for start, end, first in sliding_windows(len(tokens), window, stride):
        ref.append(hf_token_nll(hf_model, tokens[start:end])[first - start - 1:])
    ref = np.concatenate(ref)
    assert ref.size == NUM_TOKENS - 1  # every token but the first scored once
    result = perplexity(llm, tokens, window=window, stride=stride, chunk_size=CHUNK_SIZE)
    assert result.num_tokens == ref.size
    assert abs(result.mean_nll - ref.mean()) < NLL_ATOL, (result.mean_nll, ref.mean())
    # Shorter contexts than the full sequence's: a different number.
    assert abs(result.mean_nll - hf_token_nll(hf_model, tokens).mean()) > 10 * NLL_ATOL


def test_chunk_size_does_not_change_the_result(llm, tokens):
    results = [perplexity(llm, tokens, chunk_size=size) for size in (CHUNK_SIZE, 37, 512)]
    for r in results[1:]:
        assert r.num_tokens == results[0].num_tokens
        assert abs(r.mean_nll - results[0].mean_nll) < CHUNK_ATOL, [r.mean_nll for r in results]


def test_the_engines_own_cache_is_left_alone(llm, tokens):
    runner = llm.engine.runner
    cache = runner.kv_cache
    perplexity(llm, tokens, chunk_size=CHUNK_SIZE)
    assert runner.kv_cache is cache and not cache.is_deleted()


@pytest.mark.parametrize("tokens_", [[], [5]])
def test_fewer_than_two_tokens_are_refused(llm, tokens_):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(llm, tokens_)


def test_bad_settings_are_refused(llm, tokens):
    context = llm.engine.model_config.max_position_embeddings
    with pytest.raises(ValueError, match="window"):
        perplexity(llm, tokens, window=context + 1)
    with pytest.raises(ValueError, match="stride"):
        perplexity(llm, tokens, window=64, stride=65)
    with pytest.raises(ValueError, match="token ids"):
        perplexity(llm, [1, llm.engine.model_config.vocab_size])


def test_tensor_parallel_runners_are_refused():
    sharded = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(mesh=object())))
    with pytest.raises(ValueError, match="tensor-parallel"):
        perplexity(sharded, [1, 2, 3])


@pytest.mark.parametrize("num_tokens,window,stride", [(300, 128, 48), (300, 128, 128), (100, 128, 64), (257, 2, 1),
                                                      (1000, 300, 299)])
def test_sliding_windows_score_each_token_once_with_enough_context(num_tokens, window, stride):
    windows = sliding_windows(num_tokens, window, stride)
    scored = [t for _, end, first in windows for t in range(first, end)]
    assert len(scored) == len(set(scored))
    expected = set(range(1, num_tokens)) - ({start for start, _, _ in windows[1:]} if stride == window else set())
    assert set(scored) == expected
    assert windows[-1][1] == num_tokens
    for start, end, first in windows:
        assert end - start <= window and first > start
        if start > 0:
            assert first - start >= window - stride  # context of every scored token
