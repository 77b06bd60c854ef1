"""The acceptance rule of speculative decoding (orca_jax/worker/rejection.py), called
directly under jax.jit with hand-made logits, sampling inputs and verify layouts, no engine.

Greedy rows: the accepted prefix is the longest run of drafts equal to the argmax, the first
rejected position emits the argmax, and all accepted earns the bonus token. Random rows: every
emitted token is distributed exactly as the target's (truncated, renormalised) distribution p,
checked with a chi-square test over 20,000 distinct seeds per case (and a draft outside the
kept set is never accepted); the plain sampler gives p on the same seeds too. Seeded: the same
inputs give the same outputs whatever shares the batch, and a position without a draft draws
exactly `sampling.sample`'s token for its (seed, sample_index).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from orca_jax.worker.batch import SamplingInputs, VerifyLayout
from orca_jax.worker.sampling import TokenCounts, sample
from orca_jax.worker.rejection import verify_drafts

V = 8
MAX_LOGPROBS = 3
# Significance of every chi-square test: a correct rule fails one with probability 0.001
# (and, the seeds being fixed, the outcome is the same on every run).
ALPHA = 1e-3
N = 20_000  # rows (distinct seeds) per statistical case

verify_jit = jax.jit(verify_drafts, static_argnums=(3, 4))
sample_jit = jax.jit(sample, static_argnums=(2,))

# A fixed target distribution over V = 8 tokens, its logits in float32.
P = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
BASE_LOGITS = np.log(P).astype(np.float32)


# ---- building the inputs ----------------------------------------------------------------------
def sampling_inputs(L: int, **fields) -> SamplingInputs:
    """Per-position sampling parameters; each field a scalar or an array of L. Defaults:
    greedy, no truncation, no penalties, seed 0, sample_index 0, no log-probabilities."""
    spec = dict(temperature=(0.0, np.float32), top_k=(0, np.int32), top_p=(1.0, np.float32),
                min_p=(0.0, np.float32), presence_penalty=(0.0, np.float32),
                frequency_penalty=(0.0, np.float32), repetition_penalty=(1.0, np.float32),
                seeds=(0, np.uint32), sample_index=(0, np.int32), want_logprobs=(False, bool))
    arrays = {}
    for name, (default, dtype) in spec.items():
        arrays[name] = np.broadcast_to(np.asarray(fields.pop(name, default), dtype), (L,)).copy()
    assert not fields, fields
    return SamplingInputs(**arrays)


def verify_layout(drafts_per_row: list[list[int]], padding: int = 0) -> VerifyLayout:
    """As `batch_state.verify_layout` lays a step out: row r's 1 + len(drafts) positions back
    to back (its drafts at the first len(drafts), -1 at its last), then `padding` positions
    of the last row with no draft."""
    row_of, offsets, draft_tokens = [], [], []
    for row, drafts in enumerate(drafts_per_row):
        offsets.append(len(row_of))
        row_of += [row] * (1 + len(drafts))
        draft_tokens += list(drafts) + [-1]
    row_of += [len(drafts_per_row) - 1] * padding
    draft_tokens += [-1] * padding
    return VerifyLayout(np.asarray(row_of, np.int32), np.asarray(offsets, np.int32),
                        np.asarray(draft_tokens, np.int32))


def zero_counts(layout: VerifyLayout) -> TokenCounts:
    S = len(layout.offsets)
    return TokenCounts(np.zeros((S, V), np.int32), np.zeros((S, V), bool), layout.row_of.copy())


def within_row_index(layout: VerifyLayout) -> np.ndarray:
    return np.arange(len(layout.row_of)) - layout.offsets[layout.row_of]


def verify(logits, inputs: SamplingInputs, layout: VerifyLayout):
    out = verify_jit(jnp.asarray(logits, jnp.float32), inputs, layout, len(layout.offsets), MAX_LOGPROBS,
                     zero_counts(layout))
    return jax.tree.map(np.asarray, out)


def one_hot_logits(argmaxes: list[int]) -> np.ndarray:
    """Logits whose argmax at position i is argmaxes[i] (a clear margin, no ties)."""
    logits = np.random.default_rng(len(argmaxes)).normal(0, 0.3, (len(argmaxes), V)).astype(np.float32)
    logits[np.arange(len(argmaxes)), argmaxes] = 5.0
    return logits


def emitted(out, layout: VerifyLayout, row: int) -> list[int]:
    """The tokens a row appends: its accepted drafts, then the token at the first position past them."""
    start = int(layout.offsets[row])
    return out.tokens[start:start + int(out.num_accepted[row]) + 1].tolist()


def truncated(p: np.ndarray, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """p restricted to its kept set (by the sort rule: the k largest; the prefix whose mass
    strictly before each token is below top_p; those at least min_p times the largest),
    renormalised."""
    order = np.argsort(-p, kind="stable")
    keep = np.ones_like(p, bool)
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1:
        mass_before = np.cumsum(p[order]) - p[order]
        keep[order[mass_before >= top_p]] = False
    if min_p:
        keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def assert_distributed_as(tokens: np.ndarray, p: np.ndarray, what: str) -> None:
    """Chi-square goodness of fit at significance ALPHA; tokens outside p's support never occur."""
    observed = np.bincount(tokens, minlength=V)
    assert observed.sum() > 1000, f"{what}: too few samples ({observed.sum()}) to test"
    support = p > 0
    assert observed[~support].sum() == 0, f"{what}: tokens outside the kept set drawn: {observed}"
    expected = p[support] * observed.sum()
    chi2, p_value = stats.chisquare(observed[support], expected)
    assert p_value > ALPHA, f"{what}: chi2 {chi2:.1f}, p-value {p_value:.2g}; observed {observed}, expected {expected}"


def softmax64(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    x = logits.astype(np.float64) / temperature
    e = np.exp(x - x.max())
    return e / e.sum()


# ---- greedy -----------------------------------------------------------------------------------
@pytest.mark.parametrize("with_random_row", [False, True], ids=["all-greedy", "next-to-a-random-row"])
def test_greedy_accepts_the_longest_prefix_equal_to_the_argmax(with_random_row):
    rows = [
        # (argmax at each position, drafts)
        ([3, 5, 1, 6], [3, 5, 2]),  # two accepted, the third rejected: emits 3 5 then the argmax 1
        ([4, 7, 2], [4, 7]),  # all accepted: the bonus position's argmax follows
        ([0], []),  # no draft: the argmax
        ([2, 1, 3], [1, 1]),  # the first rejected: a later match does not count
        ([6, 6, 6, 6], [6, 6, 6]),  # a repeated token, all accepted
    ]
    argmaxes = [a for argmax, _ in rows for a in argmax]
    drafts = [d for _, d in rows]
    if with_random_row:  # a random row (its own lax.cond branch) must not change the greedy rows
        argmaxes += [5, 5]
        drafts.append([5])
    layout = verify_layout(drafts, padding=3)
    L = len(layout.row_of)
    logits = one_hot_logits(argmaxes + [0] * 3)
    temperature = np.zeros(L, np.float32)
    if with_random_row:
        temperature[layout.row_of == len(rows)] = 1.0
        temperature[-3:] = 0.0  # padding positions belong to the last row; keep them greedy
    out = verify(logits, sampling_inputs(L, temperature=temperature, seeds=7), layout)

    assert out.num_accepted[:len(rows)].tolist() == [2, 2, 0, 0, 3]
    assert [emitted(out, layout, r) for r in range(len(rows))] == [[3, 5, 1], [4, 7, 2], [0], [2], [6, 6, 6, 6]]
    # Every greedy position holds its draft where accepted, else its argmax.
    greedy_positions = np.flatnonzero(temperature[:len(argmaxes)] == 0)
    assert np.array_equal(out.tokens[greedy_positions], np.asarray(argmaxes)[greedy_positions])


def test_log_probabilities_are_the_targets_at_every_position():
    """Each position's log-probability is that of its token (accepted draft or emitted) under
    the raw target logits there, and its top ids are the target's."""
    drafts = [[3, 5, 2], [4]]
    layout = verify_layout(drafts)
    L = len(layout.row_of)
    logits = np.random.default_rng(3).normal(0, 2.0, (L, V)).astype(np.float32)
    logits[[0, 1], [3, 5]] += 10.0  # drafts 3 and 5 are the argmax: accepted
    logits[4, 4] += 10.0
    out = verify(logits, sampling_inputs(L, want_logprobs=True), layout)
    assert out.num_accepted.tolist() == [2, 1]
    logprobs = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    np.testing.assert_allclose(out.logprobs, np.take_along_axis(np.asarray(logprobs), out.tokens[:, None], -1)[:, 0],
                               rtol=1e-5, atol=1e-5)
    assert np.array_equal(out.top_ids[:, 0], np.argmax(logits, axis=-1))
    np.testing.assert_allclose(out.top_logprobs[:, 0], np.asarray(logprobs).max(axis=-1), rtol=1e-5, atol=1e-5)


# ---- random rows: the distribution is preserved ---------------------------------------------------
def case_seeds(case: str, n: int) -> np.ndarray:
    """n random 32-bit sequence seeds, their own for each case: cases that shared one set of
    uniform numbers would fail together when that set happens to be unlucky."""
    return np.random.default_rng(zlib.crc32(case.encode())).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)


def one_draft_rows(draft: int, logits_row: np.ndarray, case: str, **sampling):
    """N rows, each [the draft's position, the bonus position], both with the same logits,
    distinct seeds; sample_index as expand gives it (0 at the draft, 1 at the bonus)."""
    layout = verify_layout([[draft]] * N)
    L = 2 * N
    inputs = sampling_inputs(L, seeds=case_seeds(case, N)[layout.row_of], sample_index=within_row_index(layout),
                             **sampling)
    return np.tile(logits_row, (L, 1)), inputs, layout


TRUNCATION_CASES = {
    "plain": (dict(temperature=1.0), dict()),
    "temperature-0.6": (dict(temperature=0.6), dict()),
    "top-k-4": (dict(temperature=1.0, top_k=4), dict(top_k=4)),
    "top-p-0.7": (dict(temperature=1.0, top_p=0.7), dict(top_p=0.7)),
    "min-p-0.3": (dict(temperature=1.0, min_p=0.3), dict(min_p=0.3)),
    "top-k-top-p": (dict(temperature=0.8, top_k=5, top_p=0.8), dict(top_k=5, top_p=0.8)),
}


@pytest.mark.parametrize("case", list(TRUNCATION_CASES))
@pytest.mark.parametrize("draft", [1, 0], ids=["draft-p0.2", "draft-argmax"])
def test_the_first_emitted_token_is_distributed_as_the_target(case, draft):
    sampling, rule = TRUNCATION_CASES[case]
    p = truncated(softmax64(BASE_LOGITS, sampling["temperature"]), **rule)
    logits, inputs, layout = one_draft_rows(draft, BASE_LOGITS, f"{case}-{draft}", **sampling)
    out = verify(logits, inputs, layout)

    accepted = out.num_accepted == 1
    assert set(np.unique(out.num_accepted)) <= {0, 1}
    first = out.tokens[layout.offsets]
    assert np.all(first[accepted] == draft)
    assert np.all(first[~accepted] != draft), "a rejected draft is drawn again"
    # Accepted with probability p(draft): a binomial count within 4.5 standard deviations.
    expected = N * p[draft]
    assert abs(accepted.sum() - expected) < 4.5 * np.sqrt(expected * (1 - p[draft])), (accepted.sum(), expected)
    assert_distributed_as(first, p, f"{case}: first token")
    # After an accepted draft the bonus position draws from p (its own seeded index).
    assert_distributed_as(out.tokens[layout.offsets + 1][accepted], p, f"{case}: bonus token")


@pytest.mark.parametrize("sampling,rule,draft", [
    (dict(temperature=1.0, top_k=3), dict(top_k=3), 6),
    (dict(temperature=1.0, top_p=0.6), dict(top_p=0.6), 4),
    (dict(temperature=1.0, min_p=0.6), dict(min_p=0.6), 7),  # keeps p >= 0.18: tokens 0 and 1
])
def test_a_draft_outside_the_kept_set_is_never_accepted(sampling, rule, draft):
    p = truncated(softmax64(BASE_LOGITS), **rule)
    assert p[draft] == 0
    logits, inputs, layout = one_draft_rows(draft, BASE_LOGITS, f"outside-{rule}", **sampling)
    out = verify(logits, inputs, layout)
    assert not out.num_accepted.any()
    assert_distributed_as(out.tokens[layout.offsets], p, "emitted after an impossible draft")


def test_a_certain_draft_is_always_accepted():
    """top_k = 1 at temperature > 0 keeps one token: a draft of it has p = 1 (and the residual
    it would draw from on a rejection is empty)."""
    logits, inputs, layout = one_draft_rows(0, BASE_LOGITS, "certain", temperature=1.0, top_k=1)
    out = verify(logits, inputs, layout)
    assert out.num_accepted.all()
    assert np.all(out.tokens == 0)


def plain_sample(logits: np.ndarray, inputs: SamplingInputs) -> np.ndarray:
    M = logits.shape[0]
    counts = TokenCounts(np.zeros((M, V), np.int32), np.zeros((M, V), bool), np.arange(M, dtype=np.int32))
    return np.asarray(sample_jit(jnp.asarray(logits), inputs, MAX_LOGPROBS, counts).tokens)


def test_the_plain_sampler_gives_the_same_distribution_on_the_same_seeds():
    """Non-speculative sampling over the same seeds and the verified first token: both follow
    p. Where the draft has p = 0 (cut by top-k) the rejection draw is the plain draw itself:
    the very same tokens."""
    for case, (sampling, rule) in TRUNCATION_CASES.items():
        p = truncated(softmax64(BASE_LOGITS, sampling["temperature"]), **rule)
        logits, inputs, layout = one_draft_rows(1, BASE_LOGITS, f"plain-{case}", **sampling)
        first = verify(logits, inputs, layout).tokens[layout.offsets]
        plain = plain_sample(logits[layout.offsets], jax.tree.map(lambda x: x[layout.offsets], inputs))
        assert_distributed_as(plain, p, f"plain sampler {sampling}")
        assert_distributed_as(first, p, f"verified {sampling}")
    logits, inputs, layout = one_draft_rows(6, BASE_LOGITS, "plain-impossible-draft", temperature=1.0, top_k=3)
    first = verify(logits, inputs, layout).tokens[layout.offsets]
    plain = plain_sample(logits[layout.offsets], jax.tree.map(lambda x: x[layout.offsets], inputs))
    assert np.array_equal(first, plain)


def test_two_drafts_each_position_follows_its_own_distribution():
    """One row, two drafts, a different target distribution at each of its three positions:
    the first token follows p1; given the first draft accepted, the second follows p2; given
    both, the bonus follows p3."""
    p1 = np.array([0.05, 0.5, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05])
    p2 = np.array([0.1, 0.1, 0.1, 0.4, 0.1, 0.1, 0.05, 0.05])
    p3 = np.array([0.02, 0.08, 0.1, 0.2, 0.3, 0.2, 0.05, 0.05])
    drafts = [1, 3]
    layout = verify_layout([drafts] * N)
    logits = np.log(np.tile(np.stack([p1, p2, p3]), (N, 1))).astype(np.float32)
    inputs = sampling_inputs(3 * N, temperature=1.0, seeds=case_seeds("two-drafts", N)[layout.row_of],
                             sample_index=within_row_index(layout) + 5)
    out = verify(logits, inputs, layout)
    first, second, third = (out.tokens[layout.offsets + i] for i in range(3))
    a = out.num_accepted
    assert np.array_equal(a >= 1, first == 1)
    assert np.array_equal(a == 2, (first == 1) & (second == 3))
    assert_distributed_as(first, p1 / p1.sum(), "position 0")
    assert_distributed_as(second[a >= 1], p2 / p2.sum(), "position 1 after an accepted draft")
    assert_distributed_as(third[a == 2], p3 / p3.sum(), "bonus after two accepted drafts")
    # Acceptances: p1(1) = 0.5 first, then p2(3) = 0.4.
    assert abs((a >= 1).mean() - 0.5) < 0.02 and abs((a == 2).sum() / (a >= 1).sum() - 0.4) < 0.02


# ---- seeds --------------------------------------------------------------------------------------
def mixed_random_case():
    """Eight rows of every kind (greedy and random, with and without drafts, truncating),
    several drafts each, per-position logits."""
    drafts = [[1, 2, 3], [], [0], [4, 4], [], [7, 1, 2, 5], [3], []]
    layout = verify_layout(drafts, padding=2)
    L = len(layout.row_of)
    logits = np.random.default_rng(11).normal(0, 1.0, (L, V)).astype(np.float32)
    row = layout.row_of
    inputs = sampling_inputs(
        L, temperature=np.where(np.isin(row, [2, 4]), 0.0, 0.9), top_k=np.where(row == 3, 4, 0),
        top_p=np.where(row == 5, 0.8, 1.0), seeds=100 + row, sample_index=3 * row + within_row_index(layout))
    return logits, inputs, layout


def test_same_inputs_same_outputs_whatever_shares_the_batch():
    logits, inputs, layout = mixed_random_case()
    first = verify(logits, inputs, layout)
    again = verify(logits, inputs, layout)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        assert np.array_equal(a, b)
    # Each random row with drafts, alone (its positions, seeds and indices), verifies to the same tokens.
    for r, drafts in ((0, [1, 2, 3]), (3, [4, 4]), (5, [7, 1, 2, 5])):
        positions = np.flatnonzero(layout.row_of == r)[:1 + len(drafts)]
        alone = verify_layout([drafts])
        solo = verify(logits[positions], jax.tree.map(lambda x: x[positions], inputs), alone)
        assert solo.num_accepted[0] == first.num_accepted[r]
        assert emitted(solo, alone, 0) == emitted(first, layout, r)


def mixed_rows(M: int, seed: int) -> tuple[np.ndarray, SamplingInputs]:
    """M rows of random logits, a quarter each greedy, plain, top-k and top-p, with random
    seeds and sample indices."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 1.5, (M, V)).astype(np.float32)
    kind = np.arange(M) % 4
    inputs = sampling_inputs(M, temperature=np.where(kind == 0, 0.0, 0.7 + 0.2 * kind),
                             top_k=np.where(kind == 2, 3, 0), top_p=np.where(kind == 3, 0.75, 1.0),
                             seeds=rng.integers(0, 2**32, M, dtype=np.uint64).astype(np.uint32),
                             sample_index=rng.integers(0, 500, M))
    return logits, inputs


def test_a_position_without_a_draft_draws_the_plain_samplers_token():
    """Rows with no draft: the verified token is exactly `sample`'s for the same seed and
    sample_index (greedy, plain and truncated rows, 2,000 seeds)."""
    M = 2000
    layout = verify_layout([[]] * M)
    logits, inputs = mixed_rows(M, seed=5)
    verified = verify(logits, inputs, layout)
    assert np.array_equal(verified.tokens, plain_sample(logits, inputs))
    assert not verified.num_accepted.any()


def test_every_position_draws_the_plain_samplers_token_whatever_its_draft():
    """The coupling: with drafts (some right, some wrong) every position's token is still
    exactly `sample`'s for its seed and index, and a draft is accepted iff it equals that token.
    So a seeded request's tokens do not depend on what was proposed."""
    M = 2000
    logits, inputs = mixed_rows(M, seed=6)
    rng = np.random.default_rng(7)
    plain = plain_sample(logits, inputs)
    # One draft per row (two positions each): half the drafts are the plain token.
    drafts = np.where(rng.random(M) < 0.5, plain, (plain + 1) % V)
    layout = verify_layout([[int(d)] for d in drafts])
    rows = np.asarray(layout.row_of)
    first = np.asarray(layout.offsets)
    per_position = jax.tree.map(lambda x: np.asarray(x)[rows], inputs)
    per_position = dataclasses.replace(per_position, sample_index=per_position.sample_index
                                       + (np.arange(rows.shape[0]) - first[rows]))
    position_logits = logits[rows]
    verified = verify(position_logits, per_position, layout)
    assert np.array_equal(verified.tokens, plain_sample(position_logits, per_position))
    assert np.array_equal(verified.num_accepted, (drafts == plain).astype(np.int32))
