"""Perplexity of a token sequence under an engine's own model, weights and KV cache format.

    result = perplexity(llm, token_ids)      # PerplexityResult(num_tokens, mean_nll, perplexity)

What quantization changes must show here, so the text goes through what serving runs: the
runner's Flax module and parameters (quantized weights, if the engine quantized them) and a
KV cache of the runner's dtype (`create_kv_cache`, so an 8-bit cache stores and reads 8-bit
values). The text is fed as one sequence in prefill chunks of `chunk_size` tokens, the way the
engine chunks a long prompt: every chunk after the first attends to the keys and values the
earlier chunks wrote into the cache. The cache is this function's own; the engine's is not
touched, and nothing is sampled.

Each token is scored given every token before it in its window (log-softmax of the logits at
the position before it). A text longer than `window` tokens is scored in windows of `window`
tokens, started every `stride` tokens (each a fresh sequence from position 0); a window scores
only the tokens the windows before it did not, so every token is scored once, with at least
`window - stride` tokens of context once past the first window (the usual sliding-window
perplexity). With stride == window the first token of each later window has no context and is
not scored.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.kernels.metadata import AttentionMetadata
from orca_jax.core.kv_cache import create_kv_cache

DEFAULT_CHUNK_SIZE = 256


@dataclass(frozen=True)
class PerplexityResult:
    num_tokens: int  # tokens scored (each given the tokens before it in its window)
    mean_nll: float  # mean negative log-likelihood per scored token, in nats
    perplexity: float  # exp(mean_nll)


def perplexity(llm, token_ids: Sequence[int], *, window: int | None = None, stride: int | None = None,
               chunk_size: int = DEFAULT_CHUNK_SIZE) -> PerplexityResult:
    """Perplexity of `token_ids` under the model of `llm` (an `LLM` or an `LLMEngine`).

    `window`: most tokens of one sequence (default: the model's context length);
    `stride`: tokens between window starts (default: window // 2), 1 <= stride <= window;
    `chunk_size`: tokens per model call (a prefill chunk; the last one is padded)."""
    runner = _runner_of(llm)
    tokens = np.asarray(token_ids, dtype=np.int32).reshape(-1)
    if tokens.size < 2:
        raise ValueError(f"perplexity needs at least 2 tokens (the first is never scored), got {tokens.size}")
    window = runner.model_config.max_position_embeddings if window is None else window
    stride = max(1, window // 2) if stride is None else stride
    _check_settings(runner, tokens, window, stride, chunk_size)
    page_size = runner.config.page_size
    window_pages = -(-min(window, tokens.size) // page_size)
    # Page 0 is the padding sink; the window's tokens fill pages 1.. in order.
    page_table = np.arange(1, window_pages + 1, dtype=np.int32)[None, :]
    kv_cache = create_kv_cache(runner.model_config, window_pages + 1, page_size, runner.kv_dtype)
    total_nll, scored = 0.0, 0
    for start, end, first_scored in sliding_windows(tokens.size, window, stride):
        nll, kv_cache = _window_nll(runner.model, runner.params, kv_cache, tokens[start:end],
                                    first_scored - start, page_table, page_size, chunk_size)
        total_nll += float(nll.sum(dtype=np.float64))
        scored += nll.size
    mean_nll = total_nll / scored
    return PerplexityResult(num_tokens=scored, mean_nll=mean_nll, perplexity=math.exp(mean_nll))


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored token) of each window over `num_tokens` tokens: windows of at
    most `window` tokens every `stride` tokens, until one reaches the end; each scores the
    tokens from where the one before it stopped (never its own first token)."""
    windows, scored_to = [], 1
    for start in range(0, num_tokens, stride):
        end = min(start + window, num_tokens)
        first = max(scored_to, start + 1)
        if first < end:
            windows.append((start, end, first))
        scored_to = max(scored_to, end)
        if end == num_tokens:
            break
    return windows


def _runner_of(llm):
    """The ModelRunner of an LLM or an LLMEngine, refused under tensor parallelism."""
    runner = getattr(llm, "engine", llm).runner
    if getattr(runner, "mesh", None) is not None:
        raise ValueError("perplexity runs on one device: this engine is tensor-parallel "
                         "(tensor_parallel_size > 1 or several processes); build one with tensor_parallel_size=1")
    return runner


def _check_settings(runner, tokens: np.ndarray, window: int, stride: int, chunk_size: int) -> None:
    context = runner.model_config.max_position_embeddings
    if not 2 <= window <= context:
        raise ValueError(f"window must be in [2, {context}] (the model's context), got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    vocab = runner.model_config.vocab_size
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}), got ids in [{tokens.min()}, {tokens.max()}]")


def _window_nll(model, params, kv_cache, tokens: np.ndarray, first_scored: int, page_table: np.ndarray,
                page_size: int, chunk_size: int) -> tuple[np.ndarray, jax.Array]:
    """NLL (nats, float64) of tokens[first_scored:] of one window, fed as one sequence from
    position 0 in chunks of `chunk_size`; and the cache, for the next window to reuse."""
    # targets[i] is the token the logits at position i predict; -1 past the window's end.
    targets = np.full(tokens.size, -1, np.int32)
    targets[:-1] = tokens[1:]
    nll = np.empty(tokens.size, np.float64)
    for start in range(0, tokens.size - 1, chunk_size):  # the last token predicts nothing here
        end = min(start + chunk_size, tokens.size)
        metadata = chunk_metadata(start, end - start, chunk_size, page_table, page_size)
        chunk_nll, kv_cache = _chunk_nll(model, params, kv_cache, _padded(tokens[start:end], chunk_size), metadata,
                                          _padded(targets[start:end], chunk_size))
        nll[start:end] = np.asarray(chunk_nll, np.float64)[: end - start]
    # Position p's row is the NLL of token p + 1.
    return nll[first_scored - 1: tokens.size - 1], kv_cache


def _padded(values: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, np.int32)
    out[: values.size] = values
    return out


def chunk_metadata(start: int, num_real: int, chunk_size: int, page_table: np.ndarray,
                   page_size: int) -> AttentionMetadata:
    """One sequence's prefill chunk: its tokens at positions start .. start + num_real - 1,
    with `start` tokens already in the cache, padded to `chunk_size` tokens (padding at
    position 0, writing into page 0)."""
    positions = np.zeros(chunk_size, np.int32)
    positions[:num_real] = np.arange(start, start + num_real, dtype=np.int32)
    slot_mapping = np.arange(chunk_size, dtype=np.int32) % page_size  # padding: page 0
    pos = positions[:num_real]
    slot_mapping[:num_real] = page_table[0, pos // page_size] * page_size + pos % page_size
    return AttentionMetadata(
        positions=positions, slot_mapping=slot_mapping, page_table=page_table,
        kv_lens=np.array([start + num_real], np.int32), cu_q_lens=np.array([0, num_real], np.int32),
        num_seqs=np.array([1], np.int32))


# Compiled once per model and chunk shape (a model is a hashable Flax module: its config and dtype).
@functools.partial(jax.jit, static_argnames="model", donate_argnames="kv_cache")
def _chunk_nll(model, params, kv_cache, input_ids, metadata: AttentionMetadata, targets):
    """The model on one chunk: per token, -log p(target) = logsumexp(logits) - logits[target]
    at its position (float32, on the device), and the updated cache. Targets < 0 give 0."""
    logits, kv_cache = model.apply(params, input_ids, kv_cache, metadata, jnp.arange(input_ids.shape[0]))
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    nll = jax.nn.logsumexp(logits, axis=-1) - picked
    return jnp.where(targets >= 0, nll, 0.0), kv_cache
