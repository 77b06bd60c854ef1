"""Log-probabilities of prompt tokens, inside the step that prefills them (vLLM's prompt_logprobs,
and what an echoed completion with logprobs reports: how lm-evaluation-harness scores a model).

The host marks, per token of the step, the prompt token that follows it (`targets`, -1 where
no row asks). Only then does the step run the head over every token of the step, a chunk of
rows at a time so the [rows, V] logits stay small; a step where no row asks skips it behind a
`lax.cond`, so it costs those rows nothing and the compiled programs are the same ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

# Rows of the head per chunk: [256, V] float32 logits are 50 MB at V = 49,152.
CHUNK_ROWS = 256


@dataclass(frozen=True)
class PromptLogprobs:
    """Per token t of the step, about the token after it (targets[t]); zeros where t has none."""

    target_logprobs: jax.Array  # f32[T]
    top_ids: jax.Array  # i32[T, K]
    top_logprobs: jax.Array  # f32[T, K]


jax.tree_util.register_dataclass(PromptLogprobs, data_fields=[f.name for f in dataclasses.fields(PromptLogprobs)],
                                 meta_fields=[])


def prompt_logprobs(logits_of: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
                    k: int) -> PromptLogprobs:
    """hidden [T, D] (the last layer's output), targets i32[T] -> PromptLogprobs. `logits_of`
    maps [n, D] hidden rows to f32[n, V] logits (final norm and head, as sampling sees them)."""
    T = hidden.shape[0]

    def compute():
        rows = min(CHUNK_ROWS, T)
        pad = -T % rows
        h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, rows, hidden.shape[1])
        t = jnp.pad(targets, (0, pad), constant_values=-1).reshape(-1, rows)

        def chunk(args):
            h_rows, t_rows = args
            logprobs = jax.nn.log_softmax(logits_of(h_rows).astype(jnp.float32), axis=-1)
            target = jnp.take_along_axis(logprobs, jnp.maximum(t_rows, 0)[:, None], axis=-1)[:, 0]
            top_logprobs, top_ids = jax.lax.top_k(logprobs, k)
            wanted = t_rows >= 0
            return (jnp.where(wanted, target, 0.0), jnp.where(wanted[:, None], top_ids, 0).astype(jnp.int32),
                    jnp.where(wanted[:, None], top_logprobs, 0.0))

        outs = jax.lax.map(chunk, (h, t))
        return PromptLogprobs(*(o.reshape((-1,) + o.shape[2:])[:T] for o in outs))

    def skip():
        return PromptLogprobs(jnp.zeros((T,), jnp.float32), jnp.zeros((T, k), jnp.int32),
                              jnp.zeros((T, k), jnp.float32))

    return jax.lax.cond(jnp.any(targets >= 0), compute, skip)
