"""The acceptance rule of speculative decoding, inside the jitted step.

A row that verifies d drafts has d + 1 output positions (orca_jax.batch.VerifyLayout):
position i holds the target's logits after the row's tokens up to draft i, so it judges
draft i (i < d) and, past the last draft, gives the bonus token. Per position, with p the
target's distribution there (temperature, top-k/p, min-p: `sampling.kept_weights`):

    greedy row:  draft x accepted iff x is the target's argmax; the first rejected position
                 emits the argmax, so the tokens are exactly those of greedy decoding.
    random row:  x accepted with probability p(x); at the first rejection the token is drawn
                 from p with x removed (renormalised); after d accepts, from p.

That is the rejection-sampling rule of Leviathan et al. 2023 / Chen et al. 2023 for a proposer
that puts all its mass on its draft (n-gram lookup, a greedy draft model): accepting with
min(1, p(x)/q(x)) = p(x) and drawing the rejection from max(0, p - q) normalised = p without
x. Each emitted token is then distributed exactly as p. Uniform numbers are keyed by (seed,
output token index, stream) as the plain sampler's: the draw uses stream 0, the acceptance
test stream 1, so a seeded request is reproducible, and a row that proposed nothing draws
exactly the token it would draw without speculation.

A row accepts its drafts up to the first rejection (`num_accepted`); its new tokens are the
accepted drafts and the token at that position. Log-probabilities, when asked, are the
target's raw ones of each position's token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from orca_jax.batch import SamplingInputs, VerifyLayout
from orca_jax.sampling import (SampleOutput, TokenCounts, constrained_logits, draw_uniforms, greedy, inverse_cdf,
                               kept_weights, token_logprobs)


def verify_drafts(logits: jax.Array, inputs: SamplingInputs, layout: VerifyLayout, num_rows: int,
                  max_logprobs: int, counts: TokenCounts) -> SampleOutput:
    """logits f32[L, V] at the step's output positions, `inputs` per position -> SampleOutput
    with per-position tokens (an accepted draft, or the token drawn there) and log-probs, and
    `num_accepted` i32[num_rows]."""
    raw_logits = logits.astype(jnp.float32)
    # Rows with penalties or a grammar do not speculate (the scheduler gives them no drafts),
    # so these apply to single positions exactly as in the plain sampler.
    logits = constrained_logits(raw_logits, inputs, counts)
    drafts = layout.draft_tokens
    has_draft = drafts >= 0
    greedy_tokens = greedy(logits)
    emitted, accepted = jax.lax.cond(
        jnp.any(inputs.temperature > 0), _random_positions, lambda *_: (greedy_tokens, drafts == greedy_tokens),
        logits, inputs, drafts, greedy_tokens)
    tokens = jnp.where(has_draft & accepted, drafts, emitted)
    num_accepted = accepted_prefix(has_draft, accepted, layout, num_rows)
    logprobs, top_logprobs, top_ids = token_logprobs(raw_logits, tokens, inputs, max_logprobs)
    return SampleOutput(tokens, logprobs, top_ids, top_logprobs, num_accepted=num_accepted)


def _random_positions(logits, inputs: SamplingInputs, drafts, greedy_tokens):
    """(token drawn at each position, whether its draft is accepted) in a step with random rows;
    greedy rows take their argmax rule."""
    is_random = inputs.temperature > 0
    weights = kept_weights(logits, inputs)
    safe_drafts = jnp.maximum(drafts, 0)[:, None]
    draft_weight = jnp.take_along_axis(weights, safe_drafts, axis=-1)[:, 0]
    # u < p(x) with u uniform in [0, 1): accepted with probability exactly p(x).
    accepted_random = draw_uniforms(inputs, stream=1) * weights.sum(axis=-1) < draft_weight
    # A rejected draft's position draws from the rest of p; a position with no draft from p.
    is_draft = (jnp.arange(weights.shape[1])[None, :] == safe_drafts) & (drafts >= 0)[:, None]
    residual = jnp.where(is_draft, 0.0, weights)
    drawn = inverse_cdf(residual, draw_uniforms(inputs))
    return (jnp.where(is_random, drawn, greedy_tokens),
            jnp.where(is_random, accepted_random, drafts == greedy_tokens))


def accepted_prefix(has_draft: jax.Array, accepted: jax.Array, layout: VerifyLayout, num_rows: int) -> jax.Array:
    """i32[num_rows]: per row, its drafts accepted before the first rejected one."""
    index = jnp.arange(has_draft.shape[0], dtype=jnp.int32) - layout.offsets[layout.row_of]
    num_drafts = jax.ops.segment_sum(has_draft.astype(jnp.int32), layout.row_of, num_segments=num_rows)
    first_rejected = jax.ops.segment_min(jnp.where(has_draft & ~accepted, index, jnp.iinfo(jnp.int32).max),
                                         layout.row_of, num_segments=num_rows)
    return jnp.minimum(first_rejected, num_drafts).astype(jnp.int32)
