"""Sampling inside the step: greedy, truncation, penalties, seeded draws, log-probabilities.

Everything runs under jax.jit, as in the engine. The kept sets of the sort-free truncation are
checked against a descending sort in float64 (`sort_oracle_kept`), the algorithm sampling used
before it stopped sorting, and the draws against the exact distribution.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.worker.batch import SamplingInputs
from orca_jax.worker.sampling import (NUM_CANDIDATES, TokenCounts, apply_logit_bias, apply_penalties,
                                apply_token_bitmask, greedy, inverse_cdf, sample, truncates, truncation_cutoffs)

MAX_LOGPROBS = 5
sample_jit = jax.jit(sample, static_argnames=("max_logprobs",))
penalties_jit = jax.jit(apply_penalties)


@jax.jit
def kept_mask(logits, inputs):
    """bool[S, V]: the tokens each truncating row keeps (every token for the others)."""
    cutoffs = truncation_cutoffs(logits, logits.max(axis=-1), inputs, truncates(inputs))
    return logits >= cutoffs[:, None]


def make_inputs(S, **overrides) -> SamplingInputs:
    """Rows default to greedy with every option off; overrides are scalars or per-row lists."""
    fields = dict(
        temperature=(0.0, np.float32), top_k=(0, np.int32), top_p=(1.0, np.float32),
        min_p=(0.0, np.float32), presence_penalty=(0.0, np.float32),
        frequency_penalty=(0.0, np.float32), repetition_penalty=(1.0, np.float32),
        seeds=(0, np.uint32), sample_index=(0, np.int32), want_logprobs=(False, bool),
    )
    arrays = {}
    for name, (default, dtype) in fields.items():
        value = overrides.pop(name, default)
        arrays[name] = np.broadcast_to(np.asarray(value, dtype), (S,)).copy()
    assert not overrides, overrides
    return SamplingInputs(**arrays)


def make_counts(V, prompts, outputs, row_slot=None) -> TokenCounts:
    """The per-slot penalty state as the engine keeps it: slot r's output counts are the
    bincount of outputs[r], its seen set the tokens of prompts[r]; row i reads slot
    row_slot[i] (by default row i reads slot i)."""
    R = len(prompts)
    output_counts = np.zeros((R, V), np.int32)
    prompt_seen = np.zeros((R, V), bool)
    for slot in range(R):
        output_counts[slot] = np.bincount(np.asarray(outputs[slot], int), minlength=V)
        prompt_seen[slot, np.asarray(prompts[slot], int)] = True
    row_slot = np.arange(R) if row_slot is None else row_slot
    return TokenCounts(output_counts, prompt_seen, np.asarray(row_slot, np.int32))


def no_counts(S, V) -> TokenCounts:
    return make_counts(V, [[]] * S, [[]] * S)


def random_logits(seed, S, V, scale=3.0):
    return (np.random.default_rng(seed).standard_normal((S, V)) * scale).astype(np.float32)


def run(logits, inputs, max_logprobs=MAX_LOGPROBS, counts=None):
    counts = no_counts(*logits.shape) if counts is None else counts
    out = sample_jit(jnp.asarray(logits), inputs, max_logprobs=max_logprobs, counts=counts)
    return jax.tree.map(np.asarray, out)


# --------------------------------------------------------------------------------------------
# Greedy and the truncations that collapse to greedy
# --------------------------------------------------------------------------------------------

def test_greedy_rows_return_argmax_next_to_random_rows():
    S, V = 8, 300
    logits = random_logits(0, S, V)
    temperature = [0.0, 1.0, 0.0, 0.7, 0.0, 2.0, 0.0, 0.0]
    out = run(logits, make_inputs(S, temperature=temperature, seeds=np.arange(S), top_k=[0, 5, 0, 0, 0, 0, 3, 0]))
    greedy = np.asarray(temperature) == 0
    np.testing.assert_array_equal(out.tokens[greedy], logits.argmax(-1)[greedy])
    assert out.tokens.dtype == np.int32 and out.tokens.shape == (S,)
    # All-greedy batch (the path without any random draw).
    out = run(logits, make_inputs(S))
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))


@pytest.mark.parametrize("rule", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)],
                         ids=["top_k=1", "top_p=1e-6", "min_p=1"])
def test_truncation_to_one_token_equals_greedy(rule):
    S, V = 64, 200
    logits = random_logits(1, S, V)
    temperature = np.tile([0.1, 0.5, 1.0, 1.7, 5.0, 100.0, 1.0, 3.0], S // 8)
    inputs = make_inputs(S, temperature=temperature, seeds=np.arange(S) * 7 + 3,
                         sample_index=np.arange(S) % 5, **rule)
    out = run(logits, inputs)
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))


def test_tiny_temperature_is_greedy():
    S, V = 16, 300
    logits = random_logits(2, S, V)
    for temperature in (1e-4, 1e-7):
        for rule in ({}, dict(top_p=0.9), dict(min_p=0.1)):
            out = run(logits, make_inputs(S, temperature=temperature, seeds=np.arange(S), **rule))
            np.testing.assert_array_equal(out.tokens, logits.argmax(-1), err_msg=f"{temperature} {rule}")


# --------------------------------------------------------------------------------------------
# truncate: the exact kept sets on hand-made distributions
# --------------------------------------------------------------------------------------------

PROBS = np.array([0.15, 0.05, 0.5, 0.1, 0.2])  # sorted: idx 2 (.5), 4 (.2), 0 (.15), 3 (.1), 1 (.05)
ORDER = [2, 4, 0, 3, 1]

TRUNCATION_CASES = [
    # (rule, number of top tokens kept)
    (dict(), 5),
    (dict(top_k=1), 1), (dict(top_k=2), 2), (dict(top_k=4), 4), (dict(top_k=5), 5), (dict(top_k=50), 5),
    # nucleus: mass before the sorted tokens is 0, .5, .7, .85, .95
    (dict(top_p=0.3), 1), (dict(top_p=0.6), 2), (dict(top_p=0.8), 3), (dict(top_p=0.9), 4),
    (dict(top_p=0.99), 5), (dict(top_p=1.0), 5),
    # min_p relative to the max probability .5: thresholds .45, .175, .125, .04
    (dict(min_p=0.9), 1), (dict(min_p=0.35), 2), (dict(min_p=0.25), 3), (dict(min_p=0.08), 5),
    (dict(min_p=0.0), 5),
    # combinations keep the intersection (the shortest prefix)
    (dict(top_k=3, top_p=0.6), 2), (dict(top_k=2, top_p=0.9), 2), (dict(top_k=4, min_p=0.25), 3),
    (dict(top_k=4, top_p=0.9, min_p=0.35), 2),
]


def test_truncate_keeps_expected_sets():
    S = len(TRUNCATION_CASES)
    logits = np.tile(np.log(PROBS).astype(np.float32) + 1.5, (S, 1))  # shift: softmax-invariant
    columns = {name: [rule.get(name, default) for rule, _ in TRUNCATION_CASES]
               for name, default in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))}
    out = np.asarray(kept_mask(jnp.asarray(logits), make_inputs(S, **columns)))
    for row, (rule, n_keep) in enumerate(TRUNCATION_CASES):
        kept = set(np.flatnonzero(out[row]))
        assert kept == set(ORDER[:n_keep]), (rule, kept)


def test_top_p_one_keeps_whole_vocabulary_next_to_truncating_rows():
    """A row with top_p = 1 (and no other rule) must keep every token even when another row in
    the batch switches truncation on; a float32 cumulative sum that rounds to >= 1 before the
    end of a long vocabulary must not cut the tail."""
    V = 32000
    logits = random_logits(4, 2, V, scale=4.0)
    out = np.asarray(kept_mask(jnp.asarray(logits), make_inputs(2, top_p=[1.0, 0.9])))
    assert np.all(out[0]), f"{np.sum(~out[0])} tokens cut from a top_p=1 row"
    assert 1 < np.sum(out[1]) < V


def sort_oracle_kept(x, top_k, top_p, min_p, tol=0.0):
    """The kept set of one row by the sort sampling used before (float64): sort descending,
    count the prefix each rule keeps, keep every token at or above the shortest prefix's last
    logit. `tol` moves the top-p and min-p thresholds by that much (negative: stricter), to
    bound what float32 rounding may rightly decide either way."""
    V = len(x)
    order = np.argsort(-x.astype(np.float64), kind="stable")
    sorted_x = x[order].astype(np.float64)
    probs = np.exp(sorted_x - sorted_x[0])
    probs /= probs.sum()
    keep = V
    if 0 < top_k < V:
        keep = min(keep, top_k)
    if top_p < 1:
        mass_before = np.cumsum(probs) - probs
        keep = min(keep, int(np.sum(mass_before < top_p + tol)))
    if min_p > 0:
        keep = min(keep, int(np.sum(probs / probs[0] >= min_p * (1 - tol))))
    keep = max(keep, 1)
    return x >= x[order[keep - 1]]


# Rows of (vocabulary, logit scale, rules): small and large kept sets, inside the 256 candidates
# and beyond them (the exact bisection), each rule alone and combined.
ORACLE_ROWS = [
    (dict(top_k=40), 3.0), (dict(top_k=256), 3.0), (dict(top_k=257), 3.0), (dict(top_k=1500), 3.0),
    (dict(top_p=0.9), 3.0), (dict(top_p=0.5), 6.0), (dict(top_p=0.95), 0.5), (dict(top_p=0.999), 1.0),
    (dict(min_p=0.05), 3.0), (dict(min_p=0.5), 0.3), (dict(top_k=1000, top_p=0.97), 0.2),
    (dict(top_k=30, top_p=0.8, min_p=0.01), 2.0), (dict(top_k=300, top_p=0.999), 0.1),
    (dict(top_p=0.3, min_p=0.2), 0.05),
]


@pytest.mark.parametrize("vocab", [4096, 49152])
def test_cutoffs_match_a_descending_sort(vocab):
    """The kept sets equal the sort oracle's in every token whose decision is not within
    float32 rounding of a threshold (tolerance 2e-5 of probability mass / of min_p); most
    rows match it exactly."""
    rng = np.random.default_rng(vocab)
    S = len(ORACLE_ROWS)
    logits = np.stack([(rng.standard_normal(vocab) * scale).astype(np.float32) for _, scale in ORACLE_ROWS])
    columns = {name: [rule.get(name, default) for rule, _ in ORACLE_ROWS]
               for name, default in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))}
    kept = np.asarray(kept_mask(jnp.asarray(logits), make_inputs(S, **columns)))
    exact = 0
    for row, (rule, _) in enumerate(ORACLE_ROWS):
        args = (logits[row], rule.get("top_k", 0), rule.get("top_p", 1.0), rule.get("min_p", 0.0))
        surely_kept, maybe_kept = sort_oracle_kept(*args, tol=-2e-5), sort_oracle_kept(*args, tol=2e-5)
        assert np.all(kept[row] >= surely_kept) and np.all(kept[row] <= maybe_kept), (rule, kept[row].sum())
        exact += np.array_equal(kept[row], sort_oracle_kept(*args))
    assert exact >= S - 2, f"only {exact} of {S} rows match the oracle exactly"
    # The rows meant to leave the candidates did: the bisection was exercised.
    assert max(kept[row].sum() for row in range(S)) > NUM_CANDIDATES


def test_cutoffs_keep_every_tie_at_the_boundary():
    """Tied logits at the cut-off are all kept (the sort's rule: everything at or above the
    last kept logit), inside the candidates and beyond them."""
    V = 2000
    logits = np.full((2, V), -5.0, np.float32)
    logits[:, :10] = 2.0
    logits[:, 10:400] = 1.0  # 390 tied tokens straddling the 256 candidates
    out = np.asarray(kept_mask(jnp.asarray(logits), make_inputs(2, top_k=[12, 300])))
    np.testing.assert_array_equal(out.sum(-1), [400, 400])
    assert not out[:, 400:].any()


def test_greedy_takes_the_first_of_tied_maxima():
    logits = np.zeros((3, 50), np.float32)
    logits[0, [7, 20]] = 1.0
    logits[1, [0, 49]] = 3.0
    logits[2] = -np.arange(50)
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy)(jnp.asarray(logits))), [7, 0, 0])
    # And a sampled batch's greedy rows agree with it, ties included.
    out = run(logits, make_inputs(3, temperature=[0.0, 1.0, 0.0], seeds=[1, 2, 3]))
    np.testing.assert_array_equal(out.tokens[[0, 2]], [7, 0])


def test_inverse_cdf_takes_only_positive_weights_at_the_ends_of_u():
    """u = 0 picks the first positive weight, u just below 1 the last, whatever zeros surround
    them (including whole zero blocks, and a vocabulary not a multiple of the block)."""
    V = 1000
    weights = np.zeros((4, V), np.float32)
    weights[0, [3, 600]] = [1.0, 2.0]
    weights[1, [0, V - 1]] = 1.0
    weights[2, 999] = 1e-30
    weights[3, 511:513] = 5.0
    draw = jax.jit(inverse_cdf)
    np.testing.assert_array_equal(np.asarray(draw(weights, np.zeros(4, np.float32))), [3, 0, 999, 511])
    top = np.full(4, np.nextafter(np.float32(1), np.float32(0)), np.float32)
    np.testing.assert_array_equal(np.asarray(draw(weights, top)), [600, V - 1, 999, 512])


def test_inverse_cdf_frequencies_follow_the_weights():
    """20000 evenly spaced u over one row: each token's share equals its weight share to within
    the spacing (the draw is the exact inverse of the cumulative weights)."""
    rng = np.random.default_rng(3)
    V, N = 700, 20000
    weights = (rng.random(V) ** 4).astype(np.float32)
    weights[rng.random(V) < 0.3] = 0
    u = ((np.arange(N) + 0.5) / N).astype(np.float32)
    tokens = np.asarray(jax.jit(inverse_cdf)(np.tile(weights, (N, 1)), u))
    freq = np.bincount(tokens, minlength=V) / N
    assert np.all(freq[weights == 0] == 0)
    np.testing.assert_allclose(freq, weights / weights.sum(), atol=1.5 / N)


def test_large_nucleus_draws_follow_the_sort_distribution():
    """A flat row whose nucleus is far beyond the candidates (the bisection path): the draws
    stay inside the oracle's kept set and match its renormalised softmax (chi-square over 8
    bins of equal expected count; N = 8000, df 7, bound 30: p < 1e-4 under the null)."""
    V, N = 3000, 8000
    base = (np.random.default_rng(11).standard_normal(V) * 0.4).astype(np.float32)
    expected = sort_oracle_kept(base, 0, 0.9, 0.0)
    assert np.array_equal(expected, sort_oracle_kept(base, 0, 0.9, 0.0, tol=1e-4))  # no token near the edge
    assert expected.sum() > NUM_CANDIDATES
    inputs = make_inputs(N, temperature=1.0, top_p=0.9, seeds=np.arange(N) // 100 + 7, sample_index=np.arange(N) % 100)
    tokens = run(np.tile(base, (N, 1)), inputs, max_logprobs=1).tokens
    assert np.all(expected[tokens])
    probs = np.where(expected, np.exp(base.astype(np.float64) - base.max()), 0)
    probs /= probs.sum()
    order = np.argsort(-probs)
    bins = np.minimum((np.cumsum(probs[order]) * 8).astype(int), 7)  # bin of each token by rank
    token_bin = np.empty(V, int)
    token_bin[order] = bins
    expected_counts = np.bincount(token_bin, weights=probs, minlength=8) * N
    counts = np.bincount(token_bin[tokens], minlength=8)
    chi2 = np.sum((counts - expected_counts) ** 2 / expected_counts)
    assert chi2 < 30, (chi2, counts, expected_counts)


# --------------------------------------------------------------------------------------------
# Penalties
# --------------------------------------------------------------------------------------------

def numpy_penalties(logits, prompts, outputs, rep, freq, pres):
    logits = logits.astype(np.float64).copy()
    for row in range(logits.shape[0]):
        seen = set(prompts[row]) | set(outputs[row])
        for t in seen:
            x = logits[row, t]
            logits[row, t] = x / rep[row] if x > 0 else x * rep[row]
        counts = np.bincount(np.asarray(outputs[row], int), minlength=logits.shape[1])
        logits[row] -= freq[row] * counts
        logits[row] -= pres[row] * (counts > 0)
    return logits


def random_slot_tokens(rng, num_slots, V):
    """Prompt and output tokens per slot; slot 0 holds nothing, slot 1 the edge tokens 0 and
    V - 1 in both, outputs drawn from a small range so that they repeat."""
    prompts = [rng.integers(0, V, rng.integers(0, 12)) for _ in range(num_slots)]
    outputs = [rng.integers(0, V // 2, rng.integers(0, 15)) for _ in range(num_slots)]
    prompts[0], outputs[0] = np.array([], int), np.array([], int)
    prompts[1], outputs[1] = np.array([0, V - 1]), np.array([V - 1, V - 1, 0])
    return prompts, outputs


PENALTY_ROWS = dict(
    repetition_penalty=np.array([1.3, 1.5, 0.8, 1.0, 2.0, 1.0], np.float32),
    frequency_penalty=np.array([0.5, 0.3, -0.4, 0.0, 2.0, 0.7], np.float32),
    presence_penalty=np.array([-0.5, 1.0, 0.2, 1.5, -2.0, 0.0], np.float32),
)


def check_penalties(logits, prompts, outputs, row_slot, params):
    """apply_penalties with row i reading slot row_slot[i] == numpy on that slot's tokens."""
    inputs = make_inputs(logits.shape[0], **params)
    counts = make_counts(logits.shape[1], prompts, outputs, row_slot)
    got = np.asarray(penalties_jit(jnp.asarray(logits), inputs, counts))
    expected = numpy_penalties(logits, [prompts[r] for r in row_slot], [outputs[r] for r in row_slot],
                               params["repetition_penalty"], params["frequency_penalty"],
                               params["presence_penalty"])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-5)
    return got


def test_apply_penalties_matches_numpy():
    rng = np.random.default_rng(5)
    S, V = 6, 40
    logits = random_logits(5, S, V)
    prompts, outputs = random_slot_tokens(rng, S, V)
    got = check_penalties(logits, prompts, outputs, np.arange(S), PENALTY_ROWS)
    np.testing.assert_array_equal(got[0], logits[0], err_msg="a slot without tokens is not penalised")
    assert not np.allclose(got[1:], logits[1:]), "penalties changed nothing"


def test_penalties_read_the_slot_of_each_row():
    """Rows read their slot's counts through row_slot, which may permute slots and repeat one
    (two rows of one slot cannot happen in a step, but the gather must not care)."""
    rng = np.random.default_rng(6)
    S, V = 6, 40
    logits = random_logits(6, S, V)
    prompts, outputs = random_slot_tokens(rng, S, V)
    row_slot = np.array([3, 1, 5, 1, 0, 2])
    got = check_penalties(logits, prompts, outputs, row_slot, PENALTY_ROWS)
    identity = np.asarray(penalties_jit(jnp.asarray(logits), make_inputs(S, **PENALTY_ROWS),
                                        make_counts(V, prompts, outputs)))
    assert not np.allclose(got, identity), "row_slot was ignored"


def test_penalties_with_more_slots_than_rows():
    """The state has R = max_num_seqs + 1 slots and a step S rows; R > S, and the rows read
    slots past S (and the last, the padding sink, for a padding row)."""
    rng = np.random.default_rng(7)
    R, S, V = 11, 6, 40
    logits = random_logits(7, S, V)
    prompts, outputs = random_slot_tokens(rng, R, V)
    row_slot = np.array([9, 1, 4, 7, 2, R - 1])
    prompts[R - 1], outputs[R - 1] = np.array([], int), np.array([], int)  # the sink holds nothing
    check_penalties(logits, prompts, outputs, row_slot, PENALTY_ROWS)


def test_penalties_steer_greedy_choice():
    V = 10
    logits = np.zeros((2, V), np.float32)
    logits[:, 3] = 2.0
    logits[:, 7] = 1.5
    counts = make_counts(V, [[], []], [[3, 3], [3, 3]])  # token 3 was generated twice
    out = run(logits, make_inputs(2, frequency_penalty=[0.0, 0.5]), counts=counts)
    np.testing.assert_array_equal(out.tokens, [3, 7])  # 2 - 2 * 0.5 = 1 < 1.5
    out = run(logits, make_inputs(2, repetition_penalty=[1.0, 1.5]), counts=counts)
    np.testing.assert_array_equal(out.tokens, [3, 7])  # 2 / 1.5 = 1.33 < 1.5
    # The repetition penalty also covers prompt tokens; presence and frequency do not.
    prompt_only = make_counts(V, [[3], [3]], [[], []])
    out = run(logits, make_inputs(2, repetition_penalty=[1.0, 1.5]), counts=prompt_only)
    np.testing.assert_array_equal(out.tokens, [3, 7])
    out = run(logits, make_inputs(2, frequency_penalty=[2.0, 2.0], presence_penalty=[2.0, 2.0]),
              counts=prompt_only)
    np.testing.assert_array_equal(out.tokens, [3, 3])


# --------------------------------------------------------------------------------------------
# Seeded draws
# --------------------------------------------------------------------------------------------

def test_same_seed_and_index_is_batch_invariant():
    V = 500
    target = random_logits(6, 1, V)[0]
    seed, index = 123456789, 7
    target_params = dict(temperature=0.9, top_k=100, top_p=0.95, min_p=0.01)
    plain_params = dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0)

    def batch(S, row, other_seed, params, others_truncate, others_penalise):
        logits = random_logits(other_seed, S, V)
        logits[row] = target
        cols = {name: np.zeros(S, np.float32) for name in ("temperature", "top_p", "min_p")}
        cols["top_p"][:] = 1.0
        cols["top_k"] = np.zeros(S, np.int32)
        cols["temperature"][:] = np.random.default_rng(other_seed).choice([0.0, 0.5, 1.0], S)
        if others_truncate:
            cols["top_k"][:] = 3
            cols["top_p"][:] = 0.5
        rep = np.full(S, 1.2 if others_penalise else 1.0, np.float32)
        seeds = np.random.default_rng(other_seed).integers(0, 2**32, S)
        idx = np.random.default_rng(other_seed + 1).integers(0, 100, S)
        for name, value in params.items():
            cols[name][row] = value
        seeds[row], idx[row], rep[row] = seed, index, 1.0
        # Other slots hold random prompts and outputs; the target's slot (wherever the row
        # maps it) holds none of its own.
        rng = np.random.default_rng(other_seed)
        R = S + 3
        prompts = [rng.integers(0, V, 16) for _ in range(R)]
        outputs = [rng.integers(0, V, 16) for _ in range(R)]
        row_slot = rng.permutation(R)[:S]
        prompts[row_slot[row]] = outputs[row_slot[row]] = np.array([], int)
        inputs = make_inputs(S, seeds=seeds, sample_index=idx, repetition_penalty=rep, **cols)
        return logits, inputs, make_counts(V, prompts, outputs, row_slot)

    for params in (target_params, plain_params):
        tokens = set()
        for S, row, other_seed, trunc, pen in [(1, 0, 10, False, False), (4, 3, 11, True, False),
                                               (8, 0, 12, False, True), (8, 5, 13, True, True)]:
            logits, inputs, counts = batch(S, row, other_seed, params, trunc, pen)
            tokens.add(int(run(logits, inputs, counts=counts).tokens[row]))
        assert len(tokens) == 1, (params, tokens)


def test_different_index_or_seed_gives_different_draws():
    S, V = 64, 1000
    logits = np.zeros((S, V), np.float32)  # uniform
    by_index = run(logits, make_inputs(S, temperature=1.0, seeds=42, sample_index=np.arange(S))).tokens
    by_seed = run(logits, make_inputs(S, temperature=1.0, seeds=np.arange(S), sample_index=3)).tokens
    # 64 uniform draws from 1000 tokens: ~2 collisions expected.
    assert len(set(by_index.tolist())) >= 56
    assert len(set(by_seed.tolist())) >= 56
    # And a repeated call is deterministic.
    again = run(logits, make_inputs(S, temperature=1.0, seeds=42, sample_index=np.arange(S))).tokens
    np.testing.assert_array_equal(by_index, again)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("temperature,rule,kept", [
    (0.7, {}, 6),
    (1.0, {}, 6),
    (2.5, {}, 6),
    (1.0, dict(top_k=3), 3),
    (1.0, dict(top_p=0.75), None),  # kept counts computed below
    (1.5, dict(min_p=0.3), None),
])
def test_empirical_distribution_matches_softmax(temperature, rule, kept):
    """N draws with distinct (seed, index) pairs; the empirical frequencies must match
    softmax(logits / T) restricted to the kept set and renormalised. Bounds: total variation
    < 0.015 and Pearson chi-square < 30 (df <= 5; p < 1e-5 under the null), N = 40000."""
    N = 40000
    base = np.array([1.0, 0.2, -0.5, 1.4, 0.0, -1.2], np.float32)
    target = _softmax(base.astype(np.float64) / temperature)
    order = np.argsort(-target)
    if "top_p" in rule:
        mass_before = np.cumsum(target[order]) - target[order]
        kept = int(np.sum(mass_before < rule["top_p"]))
    if "min_p" in rule:
        kept = int(np.sum(target >= rule["min_p"] * target.max()))
    mask = np.zeros_like(target, bool)
    mask[order[:kept]] = True
    target = np.where(mask, target, 0)
    target /= target.sum()

    seeds = np.arange(N) // 200 + 1000
    index = np.arange(N) % 200
    logits = np.tile(base, (N, 1))
    out = run(logits, make_inputs(N, temperature=temperature, seeds=seeds, sample_index=index, **rule),
              max_logprobs=1)
    freq = np.bincount(out.tokens, minlength=len(base)) / N
    assert np.all(freq[~mask] == 0), freq
    tv = 0.5 * np.abs(freq - target).sum()
    chi2 = N * np.sum((freq[mask] - target[mask]) ** 2 / target[mask])
    assert tv < 0.015, (tv, freq, target)
    assert chi2 < 30, (chi2, freq, target)


# --------------------------------------------------------------------------------------------
# Log-probabilities
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("want", [[True, False, True, True, False, True], [False, False, False, True, False, False]],
                         ids=["most-rows-batched", "one-row-looped"])
def test_logprobs_are_of_the_raw_distribution(want):
    """The asking rows get the raw distribution's log-probabilities (whether the batch computes
    them for all rows at once or row by row); the others get zeros."""
    S, V = 6, 80
    logits = random_logits(8, S, V)
    counts = make_counts(V, [[]] * S, [[1, 2, 3]] * S)  # penalties change the sampled set only
    inputs = make_inputs(S, temperature=[0.0, 0.8, 1.5, 0.0, 1.0, 0.3], top_k=[0, 10, 0, 0, 3, 0],
                         repetition_penalty=[1.0, 1.4, 1.0, 1.2, 1.0, 1.0], frequency_penalty=0.5,
                         seeds=np.arange(S) + 9, sample_index=4, want_logprobs=want)
    out = run(logits, inputs, counts=counts)
    want = np.asarray(want)
    assert out.top_logprobs.shape == (S, MAX_LOGPROBS) and out.top_ids.shape == (S, MAX_LOGPROBS)
    assert out.top_ids.dtype == np.int32
    assert not out.logprobs[~want].any() and not out.top_logprobs[~want].any() and not out.top_ids[~want].any()
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))[want]
    tokens, top_ids, top_logprobs = out.tokens[want], out.top_ids[want], out.top_logprobs[want]
    rows = np.arange(len(tokens))
    np.testing.assert_allclose(out.logprobs[want], raw[rows, tokens], rtol=1e-6, atol=1e-6)
    assert np.all(np.diff(top_logprobs, axis=-1) <= 0), "top log-probabilities not sorted"
    ref_vals, ref_ids = jax.lax.top_k(jnp.asarray(raw), MAX_LOGPROBS)
    np.testing.assert_array_equal(top_ids, np.asarray(ref_ids))
    np.testing.assert_allclose(top_logprobs, np.asarray(ref_vals), rtol=1e-6, atol=1e-6)
    # Float64 cross-check of the log-softmax itself.
    x = logits.astype(np.float64)[want]
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    np.testing.assert_allclose(out.logprobs[want], x[rows, tokens] - lse, rtol=1e-5, atol=1e-5)


def test_no_logprob_work_without_a_row_asking():
    """A step where no row wants log-probabilities returns zeros of the right shapes (the
    log-softmax and top-k over [S, V] do not run)."""
    S, V = 4, 120
    logits = random_logits(9, S, V)
    out = run(logits, make_inputs(S, temperature=[0.0, 1.0, 0.0, 0.5], seeds=np.arange(S)))
    assert out.logprobs.shape == (S,) and out.top_ids.shape == (S, MAX_LOGPROBS)
    assert not out.logprobs.any() and not out.top_logprobs.any() and not out.top_ids.any()


# --------------------------------------------------------------------------------------------
# Constrained decoding: the grammar's token bitmask
# --------------------------------------------------------------------------------------------

def pack_bitmask(allowed: np.ndarray) -> np.ndarray:
    """bool[S, V] -> i32[S, ceil(V / 32)], bit v % 32 of word v // 32 (llguidance's layout),
    written independently of the code under test (numpy's packbits)."""
    S, V = allowed.shape
    W = -(-V // 32)
    padded = np.zeros((S, W * 32), bool)
    padded[:, :V] = allowed
    return np.packbits(padded.reshape(S, W, 32), axis=-1, bitorder="little").view("<i4").reshape(S, W)


def random_allowed(seed, S, V, density=0.1):
    rng = np.random.default_rng(seed)
    allowed = rng.random((S, V)) < density
    allowed[:, rng.integers(0, V, S)] = True  # never an empty row
    allowed[0, 31] = allowed[0, 63 % V] = True  # bit 31: the sign bit of an int32 word
    return allowed


@pytest.mark.parametrize("V", [100, 128, 4099])
def test_bitmask_sets_minus_inf_exactly_where_a_guided_row_disallows(V):
    S = 6
    logits = random_logits(20, S, V)
    allowed = random_allowed(21, S, V)
    guided = np.array([True, True, False, True, False, True])
    masked = np.asarray(jax.jit(apply_token_bitmask)(logits, pack_bitmask(allowed), guided))
    expected = np.where(allowed | ~guided[:, None], logits, -np.inf)
    np.testing.assert_array_equal(masked, expected)  # exact: kept logits untouched, the rest -inf


def guided_inputs(S, guided, allowed, **overrides) -> SamplingInputs:
    inputs = make_inputs(S, **overrides)
    return dataclasses.replace(inputs, guided=np.asarray(guided), token_bitmask=pack_bitmask(allowed))


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.8), dict(temperature=1.0, top_k=5, top_p=0.9),
                                    dict(temperature=0.7, min_p=0.05, repetition_penalty=1.3)],
                         ids=["greedy", "temperature", "top-k-p", "min-p-penalty"])
def test_guided_rows_sample_as_from_masked_logits_and_free_rows_are_untouched(params):
    """A guided row draws exactly what it would draw from logits that were -inf outside its
    allowed set (same seed and index); free rows in the same batch draw what they draw with
    no mask at all; log-probabilities stay those of the raw logits."""
    S, V = 8, 700
    logits = random_logits(30, S, V)
    allowed = random_allowed(31, S, V, density=0.05)
    guided = np.array([True, False, True, True, False, True, False, True])
    seeds = np.arange(S, dtype=np.uint32) * 977 + 5
    common = dict(seeds=seeds, sample_index=np.arange(S) % 3, want_logprobs=True, **params)
    counts = make_counts(V, [np.arange(0, V, 7)] * S, [np.arange(3, V, 11)] * S)

    out = run(logits, guided_inputs(S, guided, allowed, **common), counts=counts)
    pre_masked = np.where(allowed | ~guided[:, None], logits, -np.inf).astype(np.float32)
    reference = run(pre_masked, make_inputs(S, **common), counts=counts)
    unmasked = run(logits, make_inputs(S, **common), counts=counts)

    tokens = out.tokens
    assert allowed[guided, tokens[guided]].all(), "a guided row drew a forbidden token"
    # Penalties move only allowed logits: -inf stays -inf, so masking before or after is the same.
    np.testing.assert_array_equal(tokens[guided], reference.tokens[guided])
    np.testing.assert_array_equal(tokens[~guided], unmasked.tokens[~guided])
    np.testing.assert_allclose(out.top_logprobs, unmasked.top_logprobs, rtol=1e-6)


def test_a_batch_without_guided_rows_ignores_the_bitmask():
    S, V = 4, 300
    logits = random_logits(40, S, V)
    nothing_allowed = np.zeros((S, V), bool)
    out = run(logits, guided_inputs(S, [False] * S, nothing_allowed, temperature=0.9, seeds=np.arange(S)))
    plain = run(logits, make_inputs(S, temperature=0.9, seeds=np.arange(S)))
    np.testing.assert_array_equal(out.tokens, plain.tokens)


def biased_inputs(S, biases: dict[int, dict[int, float]], width: int = 300, **overrides) -> SamplingInputs:
    """Sampler inputs whose rows in `biases` carry those (token -> bias) maps, as batch_state lays them out."""
    ids, values, biased = np.zeros((S, width), np.int32), np.zeros((S, width), np.float32), np.zeros(S, bool)
    for row, bias in biases.items():
        biased[row] = True
        ids[row, :len(bias)], values[row, :len(bias)] = list(bias), list(bias.values())
    return dataclasses.replace(make_inputs(S, **overrides), biased=biased, bias_ids=ids, bias_values=values)


def test_logit_bias_adds_each_rows_biases_and_nothing_else():
    S, V = 4, 500
    logits = random_logits(50, S, V)
    inputs = biased_inputs(S, {1: {0: 3.5, 7: -100.0, 499: 2.0}, 3: {250: 0.25}})
    added = np.asarray(jax.jit(apply_logit_bias)(logits, inputs.bias_ids, inputs.bias_values))
    expected = np.array(logits, np.float32)
    expected[1, [0, 7, 499]] += [3.5, -100.0, 2.0]
    expected[3, 250] += 0.25
    np.testing.assert_array_equal(added, expected)  # exact: untouched entries keep their bits


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.8, seeds=np.arange(6, dtype=np.uint32)),
                                    dict(temperature=0.7, top_k=20, repetition_penalty=1.3)],
                         ids=["greedy", "temperature", "top-k-penalty"])
def test_biased_rows_sample_as_from_biased_logits_and_free_rows_are_untouched(params):
    """The bias comes before penalties and truncation (vLLM's order): a biased row draws what it
    draws from logits that had the bias added; others draw as with no bias; the log-probabilities
    stay the raw model's."""
    S, V = 6, 400
    logits = random_logits(51, S, V)
    rng = np.random.default_rng(52)
    biases = {row: {int(t): float(b) for t, b in zip(rng.choice(V, 40, replace=False), rng.uniform(-8, 8, 40))}
              for row in (0, 2, 5)}
    common = dict(want_logprobs=True, **params)
    counts = make_counts(V, [np.arange(0, V, 9)] * S, [np.arange(4, V, 13)] * S)
    out = run(logits, biased_inputs(S, biases, **common), counts=counts)
    pre_biased = np.array(logits, np.float32)
    for row, bias in biases.items():
        pre_biased[row, list(bias)] += list(bias.values())
    reference = run(pre_biased, make_inputs(S, **common), counts=counts)
    plain = run(logits, make_inputs(S, **common), counts=counts)
    rows = np.array([row in biases for row in range(S)])
    np.testing.assert_array_equal(out.tokens[rows], reference.tokens[rows])
    np.testing.assert_array_equal(out.tokens[~rows], plain.tokens[~rows])
    np.testing.assert_allclose(out.top_logprobs, plain.top_logprobs, rtol=1e-6)
