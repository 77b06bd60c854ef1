"""Token sampling inside the jitted step, one row per sequence, at the cost each row asks for.

Order of operations (as in vLLM): logit bias, penalties, the grammar's bitmask, then greedy argmax or temperature, top-k / top-p /
min-p truncation and a draw. Every optional piece sits behind a `lax.cond` on whether any row
asks for it, so one compiled program serves every mix:

    rows in the batch           work on the logits f32[S, V]
    all greedy                  a max and a first-index-of-max: two vectorised reductions
    any temperature > 0         one exp pass over [S, V] and a blocked inverse-CDF draw
    any min-p                   + a max
    any logit_bias row          + a scatter-add of the rows' (token, bias) pairs, [S, 300]
    any guided row              + the rows' grammar bitmask unpacked and applied (a where)
    any top-k / top-p           + a top-256 candidate search, row by row or for the batch
                                  (an exact bisection for a row whose kept set is larger);
                                  never a sort
    any logprobs                + a log-softmax and a top-k, of the asking rows

Truncation keeps, in each row, every token whose logit is at or above a cut-off: the k-th
largest logit (top-k), the smallest logit whose strictly-greater mass is below top_p (top-p),
`max + log(min_p)` (min-p); the row keeps the intersection, so the highest cut-off. That
value-defined set is the one a descending sort and a prefix count give (ties included), so the
distribution is the sort's; tests check it against one.

The draw is inverse-CDF sampling with one uniform number per row, a pure function of
(sequence seed, output index): a seeded request gives the same tokens whatever else shares its
batch, and after a preemption. (A Gumbel-max draw needs a random number per vocabulary entry;
on XLA:CPU that alone cost more than the model's dense layers at batch 32.)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from orca_jax.models.prompt_logprobs import PromptLogprobs
from orca_jax.worker.batch import SamplingInputs

# Candidates a truncating row takes with lax.top_k before falling back to a bisection: enough
# for common top-k values and for the nucleus of all but the flattest distributions.
NUM_CANDIDATES = 256
# Vocabulary entries per block of the inverse-CDF draw: the draw finds its block from the
# [S, V / block] block sums, then its token inside one gathered block.
DRAW_BLOCK = 256


@dataclass(frozen=True)
class SampleOutput:
    tokens: jax.Array  # i32[S]
    # f32[S]: log-probability of the sampled token (raw model distribution); zeros in the rows
    # that did not ask for log-probabilities (as top_ids / top_logprobs).
    logprobs: jax.Array
    top_ids: jax.Array  # i32[S, K]
    top_logprobs: jax.Array  # f32[S, K]
    # f32[S, V], the logits sampled from: only from a runner built with keep_logits (tests).
    logits: jax.Array | None = None
    # i32[]: tokens the step meant to read from the device state but found missing (must be 0;
    # set by the engine's step program, see orca_jax.worker.batch_state.expand).
    unresolved_tokens: jax.Array | None = None
    # i32[S]: speculative decoding, the drafts each row accepted (tokens, logprobs and logits are
    # then per output position, orca_jax.worker.batch.VerifyLayout); None without speculation.
    num_accepted: jax.Array | None = None
    # The prompt tokens' log-probabilities (orca_jax.models.prompt_logprobs): from a runner that
    # computes them, and only sent to the host for a step that asked (else None there).
    prompt: PromptLogprobs | None = None


@dataclass(frozen=True)
class TokenCounts:
    """What penalties read (the persistent per-slot state of `orca_jax.worker.batch_state`): token
    counts per slot, and the slot of each row. The [S, V] gather of the rows happens only in
    the branch that applies penalties, so a batch without them pays nothing."""

    output_counts: jax.Array  # i32[R, V]: occurrences of each token in the slot's output so far
    prompt_seen: jax.Array  # bool[R, V]: tokens of the slot's prompt
    row_slot: jax.Array  # i32[S]


for _cls in (SampleOutput, TokenCounts):
    jax.tree_util.register_dataclass(_cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])


def sample(logits: jax.Array, inputs: SamplingInputs, max_logprobs: int, counts: TokenCounts) -> SampleOutput:
    """logits f32[S, V] -> SampleOutput."""
    raw_logits = logits.astype(jnp.float32)
    logits = raw_logits
    if inputs.bias_ids is not None:
        logits = jax.lax.cond(jnp.any(inputs.biased), apply_logit_bias, lambda l, *_: l, logits,
                              inputs.bias_ids, inputs.bias_values)
    uses_penalties = jnp.any(
        (inputs.presence_penalty != 0) | (inputs.frequency_penalty != 0) | (inputs.repetition_penalty != 1)
    )
    logits = jax.lax.cond(uses_penalties, apply_penalties, lambda l, *_: l, logits, inputs, counts)
    if inputs.token_bitmask is not None:
        logits = jax.lax.cond(jnp.any(inputs.guided), apply_token_bitmask, lambda l, *_: l, logits,
                              inputs.token_bitmask, inputs.guided)
    tokens = jax.lax.cond(jnp.any(inputs.temperature > 0), draw, lambda l, _: greedy(l), logits, inputs)
    k = max(1, max_logprobs)
    token_logprobs, top_logprobs, top_ids = jax.lax.cond(
        jnp.any(inputs.want_logprobs), functools.partial(_logprobs, k=k), functools.partial(_no_logprobs, k=k),
        raw_logits, tokens, inputs.want_logprobs)
    return SampleOutput(tokens, token_logprobs, top_ids, top_logprobs)


def greedy(logits: jax.Array) -> jax.Array:
    """The first index of each row's maximum, as jnp.argmax, from two plain reductions: XLA:CPU's
    fused (value, index) argmax reduction ran 2-4x slower than a max and a second max."""
    V = logits.shape[-1]
    row_max = logits.max(axis=-1, keepdims=True)
    minus_index = jnp.where(logits == row_max, -jnp.arange(V, dtype=jnp.float32), -jnp.inf)
    return jnp.clip(-minus_index.max(axis=-1), 0, V - 1).astype(jnp.int32)  # clip: a NaN row


def apply_logit_bias(logits: jax.Array, bias_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    """OpenAI's logit_bias: each row's biases added to its logits. Unbiased rows and the unused
    entries of a biased row hold (token 0, bias 0), which add nothing, so no mask is needed; a
    request's token ids are distinct (dict keys), so no entry is added twice."""
    rows = jnp.arange(logits.shape[0], dtype=jnp.int32)[:, None]
    return logits.at[rows, bias_ids].add(bias_values)


def apply_token_bitmask(logits: jax.Array, token_bitmask: jax.Array, guided: jax.Array) -> jax.Array:
    """-inf for every token a guided row's grammar forbids (bit v of word v // 32 clear), the
    logits unchanged elsewhere. Applied after penalties, so neither can bring a forbidden token
    back; log-probabilities stay those of the model's raw distribution, as vLLM reports them."""
    S, V = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (token_bitmask[:, :, None] >> shifts) & 1  # i32[S, W, 32]; the sign bit shifts in but & 1 drops it
    allowed = bits.reshape(S, -1)[:, :V] != 0
    return jnp.where(allowed | ~guided[:, None], logits, -jnp.inf)


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


def draw(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """Tokens of a batch with at least one random row. Random rows draw from softmax(logits / T)
    over their kept set; greedy rows keep only their maximum and draw at u = 0, which picks its
    first occurrence, so they get exactly `greedy`'s token."""
    is_random = inputs.temperature > 0
    scaled = logits / jnp.where(is_random, inputs.temperature, 1.0)[:, None]
    row_max = scaled.max(axis=-1)
    truncating = is_random & truncates(inputs)  # a greedy row ignores its truncation rules
    cutoffs = jax.lax.cond(jnp.any(truncating), truncation_cutoffs,
                           lambda x, *_: jnp.full(x.shape[:1], -jnp.inf), scaled, row_max, inputs, truncating)
    cutoffs = jnp.where(is_random, jnp.minimum(cutoffs, row_max), row_max)
    weights = jnp.where(scaled >= cutoffs[:, None], jnp.exp(scaled - row_max[:, None]), 0.0)
    u = jnp.where(is_random, jax.vmap(_uniform)(inputs.seeds, inputs.sample_index), 0.0)
    return inverse_cdf(weights, u)


def _uniform(seed: jax.Array, index: jax.Array) -> jax.Array:
    return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), index), (), jnp.float32)


def inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Per row, the first token whose cumulative weight (in vocabulary order) exceeds u times
    the row's total: a draw with probability weight / total, from one uniform u in [0, 1).

    weights f32[S, V] >= 0 with a positive entry per row. Two levels, so nothing scans the
    whole vocabulary serially: block sums locate the block, a cumulative sum inside that one
    gathered block locates the token. The chosen token always has a positive weight: the
    cumulative sum rises past the target exactly there."""
    S, V = weights.shape
    block = min(DRAW_BLOCK, V)
    num_blocks = -(-V // block)
    padded = jnp.pad(weights, ((0, 0), (0, num_blocks * block - V))).reshape(S, num_blocks, block)
    block_cum = jnp.cumsum(padded.sum(axis=-1), axis=-1)  # [S, num_blocks]
    total = block_cum[:, -1]
    # u * total may round up to total when u is within 2^-24 of 1; the target must stay below.
    target = jnp.minimum(u * total, jnp.nextafter(total, 0.0))
    chosen = jnp.minimum(jnp.sum(block_cum <= target[:, None], axis=-1), num_blocks - 1)
    before = jnp.where(chosen > 0, jnp.take_along_axis(block_cum, jnp.maximum(chosen - 1, 0)[:, None], -1)[:, 0], 0.0)
    in_block = jnp.take_along_axis(padded, chosen[:, None, None], axis=1)[:, 0]  # [S, block]
    in_cum = jnp.cumsum(in_block, axis=-1)
    # The block's own running sum may round below its block sum: keep the target inside it.
    offset = jnp.minimum(target - before, jnp.nextafter(in_cum[:, -1], 0.0))
    within = jnp.minimum(jnp.sum(in_cum <= offset[:, None], axis=-1), block - 1)
    return (chosen * block + within).astype(jnp.int32)


def truncates(inputs: SamplingInputs) -> jax.Array:
    """bool[S]: rows with a top-k, top-p or min-p rule."""
    return (inputs.top_k > 0) | (inputs.top_p < 1) | (inputs.min_p > 0)


def truncation_cutoffs(scaled: jax.Array, row_max: jax.Array, inputs: SamplingInputs, rows: jax.Array) -> jax.Array:
    """f32[S]: the logit cut-off of each of `rows` (bool[S]) kept set, -inf elsewhere (keeps
    everything). `row_max` f32[S]: each row's largest logit, which the caller already has.

    min-p is a vectorised max. Top-k and top-p take the top-256 candidates: of the whole batch
    at once when more than a quarter of its rows need them (one [S, V] top-k then costs less
    than a loop), else of those rows one at a time, so that one top-p request does not make the
    whole batch pay. The few rows whose kept set the candidates cannot decide take an exact
    bisection, one at a time."""
    S, V = scaled.shape
    by_min_p = jnp.where(rows & (inputs.min_p > 0), row_max + jnp.log(inputs.min_p), -jnp.inf)
    ranked = rows & (_wants_top_k(inputs.top_k, V) | (inputs.top_p < 1))
    num_ranked = jnp.sum(ranked)

    def all_rows():
        cutoffs, inexact = candidate_cutoffs(scaled, inputs.top_k, inputs.top_p)
        return jnp.where(ranked, cutoffs, -jnp.inf), inexact & ranked

    def row_by_row():
        order = jnp.nonzero(ranked, size=S, fill_value=0)[0]

        def one_row(i, carry):
            r = order[i]
            cutoff, inexact = candidate_cutoffs(scaled[r][None], inputs.top_k[r][None], inputs.top_p[r][None])
            return carry[0].at[r].set(cutoff[0]), carry[1].at[r].set(inexact[0])

        init = (jnp.full((S,), -jnp.inf, jnp.float32), jnp.zeros((S,), bool))
        return jax.lax.fori_loop(0, num_ranked, one_row, init)

    by_rank, inexact = jax.lax.cond(num_ranked * 4 > S, all_rows, row_by_row)
    exact_order = jnp.nonzero(inexact, size=S, fill_value=0)[0]

    def exact_row(i, cutoffs):
        r = exact_order[i]
        return cutoffs.at[r].set(exact_cutoff(scaled[r], inputs.top_k[r], inputs.top_p[r]))

    by_rank = jax.lax.fori_loop(0, jnp.sum(inexact), exact_row, by_rank)
    return jnp.maximum(by_rank, by_min_p)


def _wants_top_k(top_k: jax.Array, vocab_size: int) -> jax.Array:
    return (top_k > 0) & (top_k < vocab_size)


def candidate_cutoffs(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows x f32[n, V] -> (the highest of each row's top-k and top-p cut-offs, whether the
    row's kept set reaches past the top-256 candidates, which then cannot decide it)."""
    V = x.shape[-1]
    k = min(NUM_CANDIDATES, V)
    candidates = jax.lax.top_k(x, k)[0]  # [n, k], descending
    log_total = _log_total(x)

    wants_k = _wants_top_k(top_k, V)
    k_fits = top_k <= k
    by_k = jnp.take_along_axis(candidates, jnp.clip(top_k - 1, 0, k - 1)[:, None], axis=-1)[:, 0]

    probs = jnp.exp(candidates - log_total[:, None])
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_p = jnp.sum(mass_before < top_p[:, None], axis=-1)  # a prefix: mass_before rises
    wants_p = top_p < 1
    p_fits = keep_p < k
    by_p = jnp.take_along_axis(candidates, jnp.clip(keep_p - 1, 0, k - 1)[:, None], axis=-1)[:, 0]

    cutoff = jnp.maximum(jnp.where(wants_k, by_k, -jnp.inf), jnp.where(wants_p, by_p, -jnp.inf))
    return cutoff, (wants_k & ~k_fits) | (wants_p & ~p_fits)


def _log_total(x: jax.Array) -> jax.Array:
    """log sum exp over the last axis."""
    row_max = x.max(axis=-1)
    return row_max + jnp.log(jnp.sum(jnp.exp(x - row_max[..., None]), axis=-1))


def exact_cutoff(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The highest of one row's (x f32[V]) top-k and top-p cut-offs, by bisection over its logits."""
    V = x.shape[0]
    by_k = jax.lax.cond(_wants_top_k(top_k, V), lambda: kth_largest(x, top_k), lambda: jnp.float32(-jnp.inf))
    by_p = jax.lax.cond(top_p < 1, lambda: nucleus_cutoff(x, _log_total(x), top_p), lambda: jnp.float32(-jnp.inf))
    return jnp.maximum(by_k, by_p)


# Bisection over float32 values in order: a float's bits, flipped for negatives, sort as int32.
def _order_key(x: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _from_order_key(key: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ jnp.int32(0x7FFFFFFF), key), jnp.float32)


def _lowest_key_where(holds, low: jax.Array, high: jax.Array) -> jax.Array:
    """The lowest int32 key in [low, high] where the monotone predicate `holds` (false below,
    true from some key on) is true; `holds(high)` must be true. 32 halvings at most."""
    def halve(bounds):
        lo, hi = bounds
        # floor((lo + hi) / 2) without overflow: the keys span the whole int32 range.
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
        ok = holds(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, _ = jax.lax.while_loop(lambda b: b[0] < b[1], halve, (low, high))
    return lo


def kth_largest(x: jax.Array, k: jax.Array) -> jax.Array:
    """The k-th largest entry of x (ties counted), for a k too large for the candidates: the
    highest value with at least k entries at or above it."""
    keys = _order_key(x)
    # "fewer than k entries above key" is monotone in key; its lowest key is the answer.
    key = _lowest_key_where(lambda key: jnp.sum(keys > key) < k, keys.min(), keys.max())
    return _from_order_key(key)


def nucleus_cutoff(x: jax.Array, log_total: jax.Array, top_p: jax.Array) -> jax.Array:
    """The lowest logit c such that the probability of the tokens strictly above c is below
    top_p: every token at or above it is in the nucleus, every token below it is not."""
    keys = _order_key(x)
    probs = jnp.exp(x - log_total)
    key = _lowest_key_where(lambda key: jnp.sum(jnp.where(keys > key, probs, 0.0)) < top_p, keys.min(), keys.max())
    # The lowest such key may fall between two logits: the cut-off is the next logit up.
    return jnp.min(jnp.where(keys >= key, x, jnp.inf))


def _logprobs(raw_logits: jax.Array, tokens: jax.Array, want: jax.Array, k: int):
    """The sampled token's log-probability and the top-k of the raw distribution, for the rows
    that want them (zeros elsewhere): of the whole batch at once when over a quarter of its
    rows want them, else row by row."""
    S = raw_logits.shape[0]

    def rows_logprobs(logits, rows_tokens):
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        top_logprobs, top_ids = jax.lax.top_k(logprobs, k)
        return jnp.take_along_axis(logprobs, rows_tokens[:, None], axis=-1)[:, 0], top_logprobs, top_ids.astype(jnp.int32)

    def all_rows():
        out = rows_logprobs(raw_logits, tokens)
        return tuple(jnp.where(want.reshape((S,) + (1,) * (o.ndim - 1)), o, 0) for o in out)

    def row_by_row():
        order = jnp.nonzero(want, size=S, fill_value=0)[0]

        def one_row(i, outs):
            r = order[i]
            row = rows_logprobs(raw_logits[r][None], tokens[r][None])
            return tuple(o.at[r].set(v[0]) for o, v in zip(outs, row))

        return jax.lax.fori_loop(0, jnp.sum(want), one_row, _no_logprobs(raw_logits, tokens, want, k))

    return jax.lax.cond(jnp.sum(want) * 4 > S, all_rows, row_by_row)


def _no_logprobs(raw_logits: jax.Array, tokens: jax.Array, want: jax.Array, k: int):
    S = raw_logits.shape[0]
    return jnp.zeros((S,), jnp.float32), jnp.zeros((S, k), jnp.float32), jnp.zeros((S, k), jnp.int32)
