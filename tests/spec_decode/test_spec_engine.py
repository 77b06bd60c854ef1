"""Speculative decoding through the engine, on the tiny random Llama: n-gram speculation against
no speculation.

Greedy outputs are identical (tokens, text, finish and stop reasons, log-probabilities to
float32 rounding) for k = 1, 3, 5, with chunked prefills beside verifying rows, preemption,
aborts, stops and length limits inside accepted runs, max_model_len, n > 1, logprobs, and the
request-level policy; seeded sampling is reproducible alone and batched; sequences with
penalties or a grammar never verify drafts (and so give exactly the tokens they give without
speculation); pages and slots all return after runs with many rejected drafts; nothing
compiles after warm-up. Every test asserts that drafts were verified and accepted, or it would
prove nothing.

Two speculating engines with k = 3: the default one (async_scheduling on: it proposes one step
at a time, and goes back to overlapped steps without proposals while speculation gains too
little), and `one_at_a_time` (async_scheduling off: every step proposes), for the tests that
need to know which steps verify drafts.

The tiny model's distribution is almost flat (p ~ 1/512) and its greedy continuations loop, so
greedy runs accept many drafts while sampled ones rarely repeat themselves: the seeded tests
sample with top_k = 2 so that n-gram drafts occur, and the rejection-heavy test adds a proposer
that always proposes.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from orca_jax import SamplingParams
from orca_jax.worker.compile_guard import compile_count, no_compiles
from orca_jax.spec_decode.proposing import NgramSequenceProposer
from orca_jax.structured.structured_outputs import StructuredOutputsParams

SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=32, page_size=8, num_pages=64, max_model_len=256)
FOX = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 5, "prompt_lookup_min": 2}


# Engines that are only references (no speculation) or one test's (the request-level policy)
# compile a single token bucket: each bucket is a program compiled at start-up, the most
# expensive part of these tests. The speculating engines keep every bucket (8, 16, 32), so that
# steps of every size verify drafts and "no compiles after warm-up" covers them all.
ONE_BUCKET = dict(min_token_bucket=32)
EVERY_BUCKET = dict(min_token_bucket=8)


@pytest.fixture(scope="module")
def engines(tiny_engine_factory):
    """engines(k): the engine with n-gram speculation of k tokens (k = 0: none), built once.
    (k = 3 and 5 compile the same programs at these settings, so the second is a cache load,
    and k = 1 shares the two smaller buckets' programs with them.)"""
    built = {}

    def get(k: int, **overrides):
        key = (k, tuple(sorted(overrides.items())))
        if key not in built:
            settings = {**SETTINGS, **(ONE_BUCKET if k == 0 else EVERY_BUCKET), **overrides}
            if k:
                settings["speculative_config"] = ngram(k)
            built[key] = tiny_engine_factory(**settings)
        return built[key]

    return get


def one_at_a_time(engines):
    """The k = 3 engine with async_scheduling=False: every step proposes (the default engine
    goes back to overlapped steps without proposals while speculation gains too little, so
    which steps verify drafts there depends on everything it ran). Same programs as engines(3)."""
    return engines(3, async_scheduling=False)


def greedy(max_tokens=40, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run(engine, requests, abort_at: dict[str, int] | None = None, trace: list | None = None,
        after_step=None) -> dict:
    """Add `requests`, step until idle (aborting request r at step abort_at[r]); the final output
    per request. `trace` collects per completed model step {(request id, sample index): (tokens
    appended, (drafted, accepted) or None)}; `after_step(engine)` runs after each step() call."""
    postprocess = engine.scheduler.postprocess
    if trace is not None:
        def traced(*args, **kwargs):
            update = postprocess(*args, **kwargs)
            appended = Counter((s.request_id, s.index) for _, s in update.advanced)
            verified = {(s.request_id, s.index): (d, a) for s, d, a in update.verified}
            trace.append({key: (appended.get(key, 0), verified.get(key)) for key in appended.keys() | verified.keys()})
            return update

        engine.scheduler.postprocess = traced
    try:
        for request_id, prompt, params in requests:
            engine.add_request(request_id, prompt, params)
        final, steps = {}, 0
        while engine.has_unfinished_requests():
            for request_id, at in (abort_at or {}).items():
                if at == steps:
                    engine.abort(request_id)
            for out in engine.step():
                if out.finished:
                    assert out.request_id not in final
                    final[out.request_id] = [
                        (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs
                    ] + [out.error]
            if after_step is not None:
                after_step(engine)
            steps += 1
            assert steps < 5000
    finally:
        if trace is not None:
            del engine.scheduler.postprocess  # back to the class's method
    assert_idle(engine)
    return final


def assert_idle(engine) -> None:
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.allocator.num_free == engine.allocator.num_usable, "KV pages leaked"
    assert engine.scheduler.slots.num_free == engine.config.max_num_seqs, "batch slots leaked"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine._in_flight, "a step left in flight on an idle engine"


def assert_same_outputs(a: dict, b: dict, logprob_tol: float = 1e-4) -> None:
    """Tokens, text, finish and stop reasons and errors identical; log-probabilities close."""
    assert a.keys() == b.keys()
    for request_id in a:
        *samples_a, error_a = a[request_id]
        *samples_b, error_b = b[request_id]
        assert error_a == error_b and len(samples_a) == len(samples_b), request_id
        for sa, sb in zip(samples_a, samples_b):
            assert sa[:4] == sb[:4], request_id
            if sa[4] is None or sb[4] is None:
                assert sa[4] is sb[4] is None, request_id
                continue
            assert [sorted(d) for d in sa[4]] == [sorted(d) for d in sb[4]], request_id
            for da, db in zip(sa[4], sb[4]):
                for token in da:
                    assert da[token] == pytest.approx(db[token], rel=logprob_tol, abs=logprob_tol), request_id


class SpecCounters:
    """The scheduler's speculation counters since construction: `.drafted`, `.accepted`, `.rows`."""

    def __init__(self, engine):
        self.scheduler = engine.scheduler
        self.start = self._now()

    def _now(self):
        s = self.scheduler
        return s.num_draft_tokens, s.num_accepted_tokens, s.num_spec_rows

    @property
    def drafted(self):
        return self._now()[0] - self.start[0]

    @property
    def accepted(self):
        return self._now()[1] - self.start[1]

    @property
    def rows(self):
        return self._now()[2] - self.start[2]


def accepted_drafts(trace: list, request_id: str, index: int = 0) -> int:
    """Drafts of one sequence accepted over a traced run."""
    return sum(step[(request_id, index)][1][1] for step in trace if step.get((request_id, index), (0, None))[1])


def verified_drafts(trace: list, request_id: str, index: int = 0) -> int:
    """Drafts of one sequence verified over a traced run."""
    return sum(step[(request_id, index)][1][0] for step in trace if step.get((request_id, index), (0, None))[1])


def assert_speculated(counters: SpecCounters) -> None:
    assert counters.drafted > 0 and counters.accepted > 0, \
        f"no speculation happened (drafted {counters.drafted}, accepted {counters.accepted}): the test proves nothing"


class DispatchRecorder:
    """Wraps the runner's dispatch: per step, per row (request id, sample index, start, new
    tokens, drafts, prompt length)."""

    def __init__(self, engine, monkeypatch):
        self.steps = []
        real = engine.runner.dispatch

        def dispatch(scheduled):
            self.steps.append([(s.request_id, s.index, start, n, tuple(d), s.num_prompt_tokens)
                               for s, n, start, d in zip(scheduled.seqs, scheduled.num_new, scheduled.starts,
                                                         scheduled.drafts)])
            return real(scheduled)

        monkeypatch.setattr(engine.runner, "dispatch", dispatch)


def looping_prompt(engines) -> list[int]:
    """The fox prompt followed by 16 tokens of its own greedy continuation: the model goes on
    repeating a loop the prompt already holds, so n-gram drafts are accepted from the first
    decode on, and loop tokens first occur in the output inside accepted runs."""
    engine = engines(0)
    prompt = engine.tokenizer.encode(FOX)
    continuation = run(engine, [("loop-probe", prompt, greedy(16, ignore_eos=True))])["loop-probe"][0][0]
    return prompt + continuation


def mixed_greedy_workload(engines) -> list:
    """Prompts long enough to be chunk-prefilled (> 32 tokens) beside short ones that decode,
    repeating ones (accepted drafts) and random ones; one without ignore_eos."""
    rng = np.random.default_rng(0)
    loop = looping_prompt(engines)
    requests = [
        ("fox", FOX, greedy(48, ignore_eos=True)),
        ("loop", loop, greedy(40, ignore_eos=True)),
        ("pattern", [5, 6, 7, 8] * 10, greedy(40, ignore_eos=True)),
        ("paris", "Paris is the capital of France, and Berlin is the capital of", greedy(30, ignore_eos=True)),
        ("may-stop", "def add(a, b):\n    return a + b\ndef add(a, b):\n", greedy(60)),
    ]
    for i, n in enumerate([3, 9, 40, 70]):
        requests.append((f"random-{n}", rng.integers(3, 434, size=n).tolist(), greedy(36, ignore_eos=True)))
    return requests


@pytest.fixture(scope="module")
def greedy_reference(engines):
    """The mixed greedy workload's outputs without speculation."""
    return run(engines(0), mixed_greedy_workload(engines))


# ---------------------------------------------------------------------------------------------
# Greedy parity
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [3, 5, 1])
def test_greedy_outputs_are_identical_with_ngram_speculation(engines, greedy_reference, k, monkeypatch):
    engine = engines(k)
    counters = SpecCounters(engine)
    recorder = DispatchRecorder(engine, monkeypatch)
    outputs = run(engine, mixed_greedy_workload(engines))
    assert_same_outputs(outputs, greedy_reference)
    assert_speculated(counters)
    rows = [row for step in recorder.steps for row in step]
    assert max(len(row[4]) for row in rows) == k, "a full proposal of k drafts was verified at least once"
    # Verifying rows shared steps with prefill chunks (a row starting inside its prompt).
    assert any(any(r[4] for r in step) and any(r[2] < r[5] for r in step) for step in recorder.steps), \
        "no step had a verifying row beside a prefill chunk"
    assert any(r[2] + r[3] < r[5] for r in rows), "no prompt was chunk-prefilled"
    if k > 1:
        assert counters.accepted > counters.rows, "accepted runs longer than one draft happened"


def test_preemption_with_speculation_gives_identical_greedy_outputs(engines):
    """Eight long sequences need ~144 pages of a 63-page pool: preemptions and recomputes of
    sequences that were speculating."""
    loop = looping_prompt(engines)
    rng = np.random.default_rng(1)
    requests = [(f"long-{i}", (loop if i % 2 else rng.integers(3, 434, size=40).tolist()),
                 greedy(100, ignore_eos=True)) for i in range(8)]
    spec = engines(3)
    preemptions = {k: engines(k).scheduler.num_preemptions for k in (0, 3)}
    counters = SpecCounters(spec)
    reference = run(engines(0), requests)
    outputs = run(spec, requests)
    assert_same_outputs(outputs, reference)
    assert_speculated(counters)
    assert spec.scheduler.num_preemptions > preemptions[3], "the pool was meant to preempt"
    assert engines(0).scheduler.num_preemptions > preemptions[0]


@pytest.mark.parametrize("overlapped", [False, True], ids=["one-at-a-time", "default-async"])
def test_an_abort_mid_run_keeps_a_prefix_of_the_solo_tokens(engines, overlapped):
    engine = engines(3) if overlapped else one_at_a_time(engines)
    loop = looping_prompt(engines)
    solo = run(engine, [("solo", loop, greedy(40, ignore_eos=True))])["solo"][0][0]
    others = [("other-a", [22] * 12, greedy(12, ignore_eos=True)), ("other-b", FOX, greedy(20, ignore_eos=True))]
    reference = run(engines(0), others)
    trace = []
    out = run(engine, [("cut", loop, greedy(40, ignore_eos=True))] + others, abort_at={"cut": 4}, trace=trace)
    tokens, _, reason, *_ = out["cut"][0]
    assert reason == "abort" and 1 <= len(tokens) < 40 and tokens == solo[:len(tokens)]
    if not overlapped:  # (the default engine may be in an overlapped stretch without proposals)
        assert accepted_drafts(trace, "cut") > 0, "the aborted request had accepted drafts before the abort"
    assert {k: out[k] for k in reference} == reference


def test_stops_and_length_limits_inside_accepted_runs(engines):
    """A stop token id, a stop string and max_tokens that fall inside a run of accepted drafts:
    identical to no speculation, nothing past the stop emitted, and the step that stopped had
    verified more accepted drafts than it appended (the run was cut there)."""
    spec, plain = one_at_a_time(engines), engines(0)
    loop = looping_prompt(engines)
    trace = []
    probe = run(spec, [("probe", loop, greedy(32, ignore_eos=True))], trace=trace)["probe"][0][0]
    # Where each step's tokens start in the output, and the runs of more than two tokens.
    runs, at = [], 0
    for step in trace:
        appended, _ = step.get(("probe", 0), (0, None))
        if appended >= 3:
            runs.append(range(at, at + appended))
        at += appended
    assert at == len(probe) == 32 and runs, f"no accepted run of 3+ tokens: {trace}"
    # An interior position of a run whose token occurs there for the first time.
    j = next((i for r in runs for i in r[1:-1] if probe[i] not in probe[:i]), None)
    assert j is not None, f"no run holds a first occurrence: {probe}, runs {runs}"
    # A stop string completed by token j and found nowhere in the output before it: printable
    # ASCII, so the engine's incremental text and a plain decode agree on it.
    tokenizer = spec.tokenizer
    before_j, to_j = tokenizer.decode(probe[:j]), tokenizer.decode(probe[:j + 1])
    stop = next((to_j[-n:] for n in range(1, 8) if to_j[-n:].isascii() and to_j[-n:].strip()
                 and to_j[-n:].isprintable() and to_j[-n:] not in before_j), None)
    assert stop is not None, (before_j, to_j)
    requests = [
        ("stop-id", loop, greedy(32, stop_token_ids=[probe[j]], ignore_eos=True)),
        ("stop-str", loop, greedy(32, stop=[stop], ignore_eos=True)),
        ("stop-str-kept", loop, greedy(32, stop=[stop], include_stop_str_in_output=True, ignore_eos=True)),
        ("length", loop, greedy(j + 1, ignore_eos=True)),
    ]
    traces = {}
    for request_id, *rest in requests:  # one at a time, so each one's steps are its own
        traces[request_id] = []
        got = run(spec, [(request_id, *rest)], trace=traces[request_id])
        assert_same_outputs(got, run(plain, [(request_id, *rest)]))
        tokens, text, reason, stop_reason, _ = got[request_id][0]
        assert tokens == probe[:j + 1], request_id
        assert (reason, stop_reason) == {"stop-id": ("stop", probe[j]), "stop-str": ("stop", stop),
                                         "stop-str-kept": ("stop", stop), "length": ("length", None)}[request_id]
        if request_id == "stop-str":
            assert stop not in text, text
        elif request_id == "stop-str-kept":
            assert text.endswith(stop) and text.count(stop) == 1, text
        appended, verified = traces[request_id][-1][(request_id, 0)]
        assert verified is not None and verified[1] >= 1, f"{request_id}: the last step verified no accepted draft"
        if request_id != "length":
            assert appended < verified[1] + 1, f"{request_id}: the stop did not cut an accepted run"
        else:
            assert appended == verified[1] + 1, "the length limit cut the drafts beforehand"


def test_n_samples_greedy_and_seeded(engines):
    spec = one_at_a_time(engines)
    loop = looping_prompt(engines)
    counters = SpecCounters(spec)
    greedy_n = [("n2-greedy", loop, greedy(30, n=2, ignore_eos=True)),
                ("n2-fox", FOX, greedy(30, n=2, ignore_eos=True))]
    got = run(spec, greedy_n)
    assert_same_outputs(got, run(engines(0), greedy_n))
    assert got["n2-greedy"][0][0] == got["n2-greedy"][1][0]
    assert_speculated(counters)
    seeded = [("n2-seeded", loop, SamplingParams(max_tokens=48, n=2, temperature=0.8, top_p=0.9, top_k=2, seed=21,
                                                 ignore_eos=True))]
    trace = []
    first, again = run(spec, seeded, trace=trace), run(spec, seeded)
    assert first == again
    assert first["n2-seeded"][0][0] != first["n2-seeded"][1][0], "the two samples have their own seeds"
    # Sampled tokens are the plain sampler's (coupled acceptance), so whether this seed follows
    # the loop far enough to accept drafts is the seed's business; drafts were verified.
    assert verified_drafts(trace, "n2-seeded", 0) + verified_drafts(trace, "n2-seeded", 1) > 0, \
        "the seeded samples verified no drafts"


def test_logprobs_are_the_targets(engines):
    """Greedy with logprobs=3: the same tokens and (to float32 rounding) the same log-probability
    dictionaries as without speculation, also for tokens that were accepted drafts."""
    spec = one_at_a_time(engines)
    loop = looping_prompt(engines)
    requests = [("lp-loop", loop, greedy(30, logprobs=3, ignore_eos=True)),
                ("lp-fox", FOX, greedy(30, logprobs=3, ignore_eos=True)),
                ("lp-none", [9, 8, 7] * 5, greedy(20, ignore_eos=True))]
    trace = []
    got = run(spec, requests, trace=trace)
    reference = run(engines(0), requests)
    assert_same_outputs(got, reference, logprob_tol=1e-4)
    assert accepted_drafts(trace, "lp-loop") >= 10, "most of lp-loop's tokens were meant to be accepted drafts"
    for request_id in ("lp-loop", "lp-fox"):
        tokens, *_, logprobs = got[request_id][0]
        assert len(logprobs) == len(tokens)
        for token, top in zip(tokens, logprobs):
            assert token in top and len(top) == 3
            assert max(top.values()) == pytest.approx(top[token], abs=1e-6), "greedy: the token is the most likely"


def test_seeded_sampling_is_reproducible_alone_and_batched(engines):
    """temperature 0.8, top_p 0.9, top_k 2 (so that the flat tiny model repeats itself and drafts
    occur): the same tokens run twice alone and once among other requests (one step at a time,
    every step proposing, k = 3 drafts for at most 8 sequences never cut by the budget)."""
    spec = one_at_a_time(engines)
    loop = looping_prompt(engines)
    params = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, top_k=2, seed=1234, ignore_eos=True)
    traces = [[], [], []]
    alone = run(spec, [("seeded", loop, params)], trace=traces[0])["seeded"]
    again = run(spec, [("seeded", loop, params)], trace=traces[1])["seeded"]
    rng = np.random.default_rng(4)
    others = [(f"other-{i}", rng.integers(3, 434, size=n).tolist(),
               greedy(30, ignore_eos=True) if i % 2 else SamplingParams(max_tokens=30, temperature=0.9, top_k=3,
                                                                       seed=i, ignore_eos=True))
              for i, n in enumerate([5, 40, 12, 33])] + [("other-loop", loop, greedy(30, ignore_eos=True))]
    batched = run(spec, [("seeded", loop, params)] + others, trace=traces[2])["seeded"]
    assert alone == again == batched
    for trace in traces:
        verified = [step[("seeded", 0)][1] for step in trace if step.get(("seeded", 0), (0, None))[1]]
        assert verified and sum(a for _, a in verified) > 0, "the seeded request verified and accepted no drafts"
        assert sum(a for _, a in verified) < sum(d for d, _ in verified), "and had some rejected"


class AlwaysProposer:
    """The n-gram proposal when there is one, else the sequence's last `limit` tokens reversed:
    every decoding sequence verifies drafts every step (most rejected when sampled)."""

    def __init__(self, config):
        self.ngram = NgramSequenceProposer(config)

    def propose(self, seqs, limits):
        proposals = self.ngram.propose(seqs, limits)
        return [p or (s.prompt_token_ids + s.output_token_ids)[-limit:][::-1] for p, s, limit in
                zip(proposals, seqs, limits)]

    def release_finished(self):
        getattr(self.ngram, "release_finished", lambda: None)()


@pytest.mark.parametrize("overlapped", [False, True], ids=["one-at-a-time", "default-async"])
def test_pages_and_slots_return_after_many_rejections(engines, monkeypatch, overlapped):
    """Sampled at temperature 1 with a proposal every step, most drafts are rejected: after every
    step the pages in use are exactly those the sequences hold, no running sequence holds pages
    past its tokens, and at the end every page and slot is free. One step at a time with no
    backoff (every step verifies), and on the default engine, whose backoffs switch between
    verifying steps and overlapped ones."""
    spec = engines(3) if overlapped else one_at_a_time(engines)
    config = spec.speculation.config
    monkeypatch.setattr(spec.speculation, "proposer", AlwaysProposer(config))
    if not overlapped:
        monkeypatch.setattr(spec.speculation, "config", dataclasses.replace(config, backoff_after=10**6))
    loop = looping_prompt(engines)
    rng = np.random.default_rng(2)
    requests = [(f"t1-{i}", rng.integers(3, 434, size=n).tolist(),
                 SamplingParams(max_tokens=40 if not overlapped else 90, temperature=1.0, seed=i, ignore_eos=True))
                for i, n in enumerate([3, 17, 33, 50, 8, 64])]
    requests += [("greedy-loop", loop, greedy(40, ignore_eos=True)), ("greedy-fox", FOX, greedy(40, ignore_eos=True))]
    counters = SpecCounters(spec)
    trims = []

    def check(engine):
        alloc, ps = engine.allocator, engine.config.page_size
        held = Counter(p for s in engine.scheduler.running for p in s.page_ids)
        assert alloc.num_used == len(held), "pages in use differ from the pages running sequences hold"
        assert all(alloc.ref_count(p) == n for p, n in held.items())
        for s in engine.scheduler.running:  # (a token in flight counts, should steps overlap)
            assert -(-s.num_computed_tokens // ps) <= len(s.page_ids) <= -(-(s.num_tokens + s.num_pending) // ps), \
                f"{s.request_id}: {len(s.page_ids)} pages for {s.num_computed_tokens} computed of {s.num_tokens} tokens"
        trims.append(sum(s.pages_trimmed_to is not None for s in engine.scheduler.running))
        assert all(s.page_ids == [] for s in engine.scheduler.waiting)

    outputs = run(spec, requests, after_step=check)
    assert counters.drafted > (20 if overlapped else 100) and 0 < counters.accepted < counters.drafted / 2, \
        (counters.drafted, counters.accepted)
    assert sum(trims) > 0, "no rejected run gave pages back"
    greedy_requests = requests[-2:]
    assert {k: outputs[k] for k in ("greedy-loop", "greedy-fox")} == run(engines(0), greedy_requests)
    assert_idle(spec)


@pytest.mark.parametrize("overlapped", [False, True], ids=["one-at-a-time", "default-async"])
def test_no_compiles_after_warmup_with_speculation(engines, overlapped):
    spec = engines(3) if overlapped else one_at_a_time(engines)
    loop = looping_prompt(engines)
    rng = np.random.default_rng(3)
    requests = [
        ("c-greedy", loop, greedy(24, ignore_eos=True)),
        ("c-logprobs", loop, greedy(16, logprobs=3, ignore_eos=True)),
        ("c-seeded", loop, SamplingParams(max_tokens=24, temperature=0.8, top_k=3, top_p=0.9, seed=5,
                                          ignore_eos=True)),
        ("c-seeded-logprobs", FOX, SamplingParams(max_tokens=16, temperature=0.8, top_k=3, seed=6, logprobs=2,
                                                  ignore_eos=True)),
        ("c-penalties", FOX, SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.2, seed=7,
                                            ignore_eos=True)),
        ("c-n2", loop, greedy(12, n=2, ignore_eos=True)),
        ("c-long", rng.integers(3, 434, size=70).tolist(), greedy(12, ignore_eos=True)),
    ]
    compile_count()
    counters = SpecCounters(spec)
    with no_compiles("serving with n-gram speculation"):
        run(spec, requests)
    if not overlapped:  # (the default engine may be in an overlapped stretch without proposals)
        assert_speculated(counters)


def test_penalised_and_constrained_sequences_never_verify_drafts(engines, monkeypatch):
    """Penalties and grammars are judged one token at a time: their rows carry no drafts even
    on a looping prompt, and so give exactly the tokens they give without speculation, seeded
    sampling included. A free greedy request beside them does speculate."""
    spec = one_at_a_time(engines)
    loop = looping_prompt(engines)
    requests = [
        ("pen-greedy", loop, greedy(30, presence_penalty=0.5, ignore_eos=True)),
        ("pen-seeded", loop, SamplingParams(max_tokens=30, temperature=0.8, top_k=3, repetition_penalty=1.2, seed=3,
                                            ignore_eos=True)),
        ("pen-frequency", loop, SamplingParams(max_tokens=30, temperature=0.0, frequency_penalty=0.2,
                                               ignore_eos=True)),
        ("guided", loop, greedy(20, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{20,80}"))),
        ("free", loop, greedy(30, ignore_eos=True)),
    ]
    counters = SpecCounters(spec)
    recorder = DispatchRecorder(spec, monkeypatch)
    got = run(spec, requests)
    assert_same_outputs(got, run(engines(0), requests))
    drafts = {}
    for step in recorder.steps:
        for request_id, _, _, _, d, _ in step:
            drafts.setdefault(request_id, []).append(len(d))
    for request_id in ("pen-greedy", "pen-seeded", "pen-frequency", "guided"):
        assert len(drafts[request_id]) >= 3 and not any(drafts[request_id]), f"{request_id} verified drafts"
    assert any(drafts["free"]), "the free request did not speculate"
    assert_speculated(counters)


def test_request_level_policy_with_speculation(engines, greedy_reference):
    engine = engines(3, scheduling="request", **ONE_BUCKET)
    counters = SpecCounters(engine)
    outputs = run(engine, mixed_greedy_workload(engines))
    assert_same_outputs(outputs, greedy_reference)
    assert_speculated(counters)


def test_delta_outputs_add_up_to_the_final_output(engines):
    """output_kind="delta" with several tokens per step: the deltas concatenate to the whole."""
    spec = one_at_a_time(engines)
    loop = looping_prompt(engines)
    spec.add_request("delta", loop, greedy(30, ignore_eos=True, output_kind="delta"))
    tokens, text, per_step = [], "", []
    while spec.has_unfinished_requests():
        for out in spec.step():
            tokens += out.outputs[0].token_ids
            text += out.outputs[0].text
            per_step.append(len(out.outputs[0].token_ids))
    whole = run(spec, [("whole", loop, greedy(30, ignore_eos=True))])["whole"][0]
    assert tokens == whole[0] and text == whole[1]
    assert max(per_step) >= 3, "deltas of several tokens (accepted runs) happened"


def test_max_model_len_inside_speculation(engines):
    """A sequence that reaches max_model_len (not max_tokens) with drafts accepted up to it."""
    spec = one_at_a_time(engines)
    loop = looping_prompt(engines)
    # The loop prompt and its own greedy continuation up to 7 tokens short of max_model_len.
    length = SETTINGS["max_model_len"] - 7 - len(loop)
    prompt = loop + run(spec, [("lead", loop, greedy(length, ignore_eos=True))])["lead"][0][0]
    requests = [("model-len", prompt, greedy(100, ignore_eos=True))]
    trace = []
    got = run(spec, requests, trace=trace)
    assert_same_outputs(got, run(engines(0), requests))
    tokens, _, reason, *_ = got["model-len"][0]
    assert len(tokens) == 7 and reason == "length"
    assert accepted_drafts(trace, "model-len") >= 2


@pytest.mark.parametrize("overlapped", [False, True], ids=["one-at-a-time", "default-async"])
def test_a_seeded_request_gives_the_same_tokens_whatever_ran_before(engines, overlapped):
    """The same seeded request, alone, before and after other work (which, on the default
    engine, moves it between verifying and overlapped steps). Seeds are keyed per output token
    so that a seeded request is reproducible; with the accept (stream 1) / redraw (stream 0)
    rule a token's value depends on whether its index was verified as a draft or sampled
    plainly, so this holds only if whether a sequence proposes depends on that request alone."""
    # The default engine of this test alone (seed=1 only tells it apart; same programs), so that
    # its first run starts from a new engine's state, as a user's first request would.
    spec = engines(3, seed=1) if overlapped else one_at_a_time(engines)
    loop = looping_prompt(engines)
    params = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, top_k=2, seed=99, ignore_eos=True)
    first_trace = []
    first = run(spec, [("seeded", loop, params)], trace=first_trace)["seeded"]
    rng = np.random.default_rng(8)
    run(spec, [(f"noise-{i}", rng.integers(3, 434, size=20).tolist(),
                SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True)) for i in range(6)])
    second_trace = []
    second = run(spec, [("seeded", loop, params)], trace=second_trace)["seeded"]
    assert accepted_drafts(first_trace, "seeded") + accepted_drafts(second_trace, "seeded") > 0, \
        "the seeded request accepted no drafts in either run: the test proves nothing"
    assert first == second, "a seeded request's tokens changed with what the engine ran before"


# ---------------------------------------------------------------------------------------------
# Seeded parity, and disable_by_batch_size
# ---------------------------------------------------------------------------------------------
def seeded_workload(engines) -> list:
    """Seeded requests on looping prompts (top_k 2 or 3, so that drafts occur and some are
    rejected): temperature with top-p, top-k alone, n = 2; a greedy loop beside them keeps the
    default engine's proposing steps paying."""
    loop = looping_prompt(engines)
    return [
        ("top-p", loop, SamplingParams(max_tokens=48, temperature=0.8, top_p=0.9, top_k=2, seed=1234, ignore_eos=True)),
        ("top-k", loop, SamplingParams(max_tokens=48, temperature=1.0, top_k=2, seed=7, ignore_eos=True)),
        ("n2", loop, SamplingParams(max_tokens=32, n=2, temperature=0.7, top_k=3, seed=21, ignore_eos=True)),
        ("fox", FOX, SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, top_k=2, seed=5, ignore_eos=True)),
        ("greedy-loop", loop, greedy(40, ignore_eos=True)),
    ]


def test_seeded_outputs_are_identical_with_ngram_speculation(engines):
    """rejection.py's promise: each position draws the plain sampler's token (same seed, same
    output index) and a draft is accepted iff it equals it, so seeded requests give the very
    tokens they give without speculation, drafts accepted or not. The other seeded tests
    compare speculation only with itself, which a draw keyed differently at drafted positions
    (right in distribution, reproducible) would pass. One step at a time, every step
    proposing: the default engine's backoffs leave sampled requests few verified drafts."""
    spec = one_at_a_time(engines)
    requests = seeded_workload(engines)
    trace = []
    got = run(spec, requests, trace=trace)
    assert_same_outputs(got, run(engines(0), requests))
    sampled = [(request_id, index) for request_id, _, params in requests if params.temperature > 0
               for index in range(params.n)]
    verified = [step[key][1] for step in trace for key in sampled if step.get(key, (0, None))[1]]
    drafted, accepted = sum(d for d, _ in verified), sum(a for _, a in verified)
    assert accepted > 0, f"the seeded requests accepted no drafts ({drafted} verified): the test proves nothing"
    assert accepted < drafted, "and had none rejected"


def test_disable_by_batch_size_stops_proposals_above_it(engines, monkeypatch):
    """vLLM's disable_by_batch_size=2: while more than two sequences run no step verifies a
    draft (they decode as without speculation); once two remain, proposals resume and are
    accepted. Four looping requests, two of them short; the same tokens as without speculation."""
    spec = one_at_a_time(engines)
    monkeypatch.setattr(spec.speculation, "config", dataclasses.replace(spec.speculation.config,
                                                                        disable_by_batch_size=2))
    loop = looping_prompt(engines)
    requests = [(f"short-{i}", loop, greedy(12, ignore_eos=True)) for i in range(2)]
    requests += [(f"long-{i}", loop, greedy(48, ignore_eos=True)) for i in range(2)]
    steps = []  # per step: (sequences running before it was scheduled, decoding rows, drafts verified)
    schedule = spec.scheduler.schedule

    def recording_schedule():
        running = len(spec.scheduler.running)
        scheduled = schedule()
        decoding = sum(start >= seq.num_prompt_tokens for seq, start in zip(scheduled.seqs, scheduled.starts))
        steps.append((running, decoding, sum(len(d) for d in scheduled.drafts)))
        return scheduled

    monkeypatch.setattr(spec.scheduler, "schedule", recording_schedule)
    counters = SpecCounters(spec)
    got = run(spec, requests)
    assert_same_outputs(got, run(engines(0), requests))
    above = [(decoding, drafts) for running, decoding, drafts in steps if running > 2]
    at_or_below = [(decoding, drafts) for running, decoding, drafts in steps if 0 < running <= 2]
    assert all(drafts == 0 for _, drafts in above), f"drafts verified with more than 2 running: {steps}"
    assert sum(decoding for decoding, _ in above) >= 20, f"few decodes ran above the limit: {steps}"
    assert sum(drafts for _, drafts in at_or_below) > 0, f"no drafts once 2 or fewer ran: {steps}"
    assert counters.accepted > 0
