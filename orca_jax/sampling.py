"""Token sampling inside the jitted step, one row per sequence.

Order of operations (as in vLLM): penalties, then greedy argmax or temperature, top-k / top-p /
min-p truncation and a Gumbel-max draw. Optional work (penalties, truncation, random draws,
top log-probabilities) sits behind `lax.cond` on whether any row asks for it, so a batch of
greedy requests pays for an argmax only, without a second compiled program.

Randomness is a pure function of (sequence seed, output index), so a seeded request gives the
same tokens whatever else shares its batch, and after a preemption.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from orca_jax.batch import SamplingInputs


@dataclass(frozen=True)
class SampleOutput:
    tokens: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]: log-probability of the sampled token (raw model distribution)
    top_ids: jax.Array  # i32[S, K]
    top_logprobs: jax.Array  # f32[S, K]
    # f32[S, V], the logits sampled from: only from a runner built with keep_logits (tests).
    logits: jax.Array | None = None
    # i32[]: tokens the step meant to read from the device state but found missing (must be 0;
    # set by the engine's step program, see orca_jax.batch_state.expand).
    unresolved_tokens: jax.Array | None = None


@dataclass(frozen=True)
class TokenCounts:
    """What penalties read (the persistent per-slot state of `orca_jax.batch_state`): token
    counts per slot, and the slot of each row. The [S, V] gather of the rows happens only in
    the branch that applies penalties, so a batch without them pays nothing."""

    output_counts: jax.Array  # i32[R, V]: occurrences of each token in the slot's output so far
    prompt_seen: jax.Array  # bool[R, V]: tokens of the slot's prompt
    row_slot: jax.Array  # i32[S]


for _cls in (SampleOutput, TokenCounts):
    jax.tree_util.register_dataclass(_cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])


def sample(logits: jax.Array, inputs: SamplingInputs, max_logprobs: int, counts: TokenCounts) -> SampleOutput:
    """logits f32[S, V] -> SampleOutput."""
    logits = logits.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)

    uses_penalties = jnp.any(
        (inputs.presence_penalty != 0) | (inputs.frequency_penalty != 0) | (inputs.repetition_penalty != 1)
    )
    logits = jax.lax.cond(uses_penalties, apply_penalties, lambda l, *_: l, logits, inputs, counts)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    is_random = inputs.temperature > 0
    tokens = jax.lax.cond(
        jnp.any(is_random),
        lambda: jnp.where(is_random, _draw(logits, inputs), greedy_tokens),
        lambda: greedy_tokens,
    )

    token_logprobs = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    k = max(1, max_logprobs)
    top_logprobs, top_ids = jax.lax.cond(
        jnp.any(inputs.want_logprobs),
        lambda: tuple(jax.lax.top_k(raw_logprobs, k)),
        lambda: (jnp.zeros((logits.shape[0], k), jnp.float32), jnp.zeros((logits.shape[0], k), jnp.int32)),
    )
    return SampleOutput(tokens, token_logprobs, top_ids.astype(jnp.int32), top_logprobs)


def apply_penalties(logits: jax.Array, inputs: SamplingInputs, counts: TokenCounts) -> jax.Array:
    """Repetition penalty over prompt and output tokens (HF/vLLM rule: divide positive logits,
    multiply negative ones); presence and frequency penalties over output tokens (OpenAI rule)."""
    output_counts = counts.output_counts[counts.row_slot].astype(jnp.float32)  # f32[S, V]
    seen = counts.prompt_seen[counts.row_slot] | (output_counts > 0)

    rep = inputs.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    logits = logits - inputs.frequency_penalty[:, None] * output_counts
    logits = logits - inputs.presence_penalty[:, None] * (output_counts > 0)
    return logits


def _draw(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """Temperature, truncation, then a Gumbel-max draw keyed by (seed, output index)."""
    temperature = jnp.where(inputs.temperature > 0, inputs.temperature, 1.0)
    logits = logits / temperature[:, None]
    needs_truncation = jnp.any((inputs.top_k > 0) | (inputs.top_p < 1) | (inputs.min_p > 0))
    logits = jax.lax.cond(needs_truncation, truncate, lambda l, _: l, logits, inputs)

    def gumbel_row(seed, index, vocab_size=logits.shape[-1]):
        key = jax.random.fold_in(jax.random.key(seed), index)
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)

    noise = jax.vmap(gumbel_row)(inputs.seeds, inputs.sample_index)
    return jnp.argmax(logits + noise, axis=-1).astype(jnp.int32)


def truncate(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """Keep the top-k / top-p (nucleus) / min-p set of each row; the rest goes to -inf.

    Each rule keeps a prefix of the tokens sorted by logit, so their intersection is the
    shortest prefix, found as a count and turned into a logit cut-off (no scatter needed)."""
    S, V = logits.shape
    sorted_logits = -jnp.sort(-logits, axis=-1)  # descending
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    keep_k = jnp.where(inputs.top_k > 0, jnp.minimum(inputs.top_k, V), V)
    # Nucleus: keep a token while the mass before it is below top_p (always keeps the first).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p = 1 must keep everything: a float32 cumsum can reach 1.0 before the last token.
    keep_p = jnp.where(inputs.top_p < 1, jnp.sum(mass_before < inputs.top_p[:, None], axis=-1), V)
    keep_min_p = jnp.sum(probs >= inputs.min_p[:, None] * probs[:, :1], axis=-1)
    keep = jnp.maximum(1, jnp.minimum(jnp.minimum(keep_k, keep_p), keep_min_p))
    cutoff = jnp.take_along_axis(sorted_logits, (keep - 1)[:, None], axis=-1)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)
