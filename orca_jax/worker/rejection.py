"""The acceptance rule of speculative decoding, inside the jitted step.

A row that verifies d drafts has d + 1 output positions (orca_jax.worker.batch.VerifyLayout):
position i holds the target's logits after the row's tokens up to draft i, so it judges draft
i (i < d) and, past the last draft, gives the bonus token. At every position the target's
token is drawn exactly as the plain sampler draws it (`sampling.sample`: penalties, mask,
temperature, top-k/p, min-p, one uniform keyed by (seed, output token index)); draft i is
accepted iff it equals the token drawn at position i, and the row keeps its drafts up to the
first that is not, then the token drawn there.

That is the rejection-sampling rule of Leviathan et al. 2023 / Chen et al. 2023 for a proposer
that puts all its mass on its draft x (n-gram lookup, a greedy draft model), coupled to the
plain draw: the standard rule accepts x with probability min(1, p(x) / 1) = p(x) and on a
rejection draws from max(0, p - q) normalised, which is p without x. Here the draw y ~ p equals
x with probability p(x), and given y != x it is distributed as p without x: the same law. The
coupling adds one thing: every token is the very token the plain sampler gives at that output
index, so greedy and seeded requests produce exactly what they produce without speculation,
whatever the proposals, the batch or the engine's history. (Independent uniforms for the
acceptance test, the textbook form, keep the distribution but make a seeded request's tokens
depend on which positions happened to be verified.)

A row accepts its drafts up to the first rejection (`num_accepted`); its new tokens are the
accepted drafts and the token drawn at that position. Log-probabilities, when asked, are the
target's raw ones of each position's token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from orca_jax.worker.batch import SamplingInputs, VerifyLayout
from orca_jax.worker.sampling import SampleOutput, TokenCounts, sample


def verify_drafts(logits: jax.Array, inputs: SamplingInputs, layout: VerifyLayout, num_rows: int,
                  max_logprobs: int, counts: TokenCounts) -> SampleOutput:
    """logits f32[L, V] at the step's output positions, `inputs` per position -> the plain
    sampler's SampleOutput per position, with `num_accepted` i32[num_rows]. (Rows with
    penalties or a grammar get no drafts, so the sampler treats their one position as ever.)"""
    out = sample(logits, inputs, max_logprobs, counts)
    has_draft = layout.draft_tokens >= 0
    num_accepted = accepted_prefix(has_draft, layout.draft_tokens == out.tokens, layout, num_rows)
    return dataclasses.replace(out, num_accepted=num_accepted)


def accepted_prefix(has_draft: jax.Array, accepted: jax.Array, layout: VerifyLayout, num_rows: int) -> jax.Array:
    """i32[num_rows]: per row, its drafts accepted before the first rejected one."""
    index = jnp.arange(has_draft.shape[0], dtype=jnp.int32) - layout.offsets[layout.row_of]
    num_drafts = jax.ops.segment_sum(has_draft.astype(jnp.int32), layout.row_of, num_segments=num_rows)
    first_rejected = jax.ops.segment_min(jnp.where(has_draft & ~accepted, index, jnp.iinfo(jnp.int32).max),
                                         layout.row_of, num_segments=num_rows)
    return jnp.minimum(first_rejected, num_drafts).astype(jnp.int32)
