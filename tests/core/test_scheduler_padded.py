"""The "request_padded" policy (FasterTransformer as Orca measured it): static batches run as
a rectangle. Scheduler alone with a fake model (hand-made cases, then a hypothesis property
test over random arrivals, lengths, stops and aborts, one step at a time and overlapped), then
the engine on the tiny random Llama (greedy tokens as iteration-level's, the token bucket
holding the padding), then the benchmark's rules for the policy (batch returns, the headline).

The rectangle: a static batch is admitted only while members x longest prompt fits the token
budget, and prefills in one step; every step computes members x the step's longest row
(`num_tokens + num_padding_tokens`), finished members included, until the last one ends.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_jax.worker.batch import token_bucket
from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.core.kv_cache import PageAllocator
from orca_jax.core.sampling_params import SamplingParams
from orca_jax.core.scheduler import Scheduler
from orca_jax.core.sequence import Sequence, SequenceStatus
from orca_jax.engine.step import recompute_running

MODEL = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
)


def make_scheduler(**kw) -> Scheduler:
    settings_ = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=65, max_model_len=64,
                     enable_prefix_caching=False, scheduling="request_padded")
    settings_.update(kw)
    config = EngineConfig(**settings_).resolve(MODEL)
    return Scheduler(config, PageAllocator(config.num_pages, config.page_size))


def _sibling(name: str):
    """A module of this directory by path (pytest imports tests in importlib mode), registered
    under its own name so that the dataclasses it defines resolve."""
    spec = importlib.util.spec_from_file_location(f"_orca_jax_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# The scheduler tests' own sequence maker and one-step driver.
_scheduler_tests = _sibling("test_scheduler")
make_seq, run_step = _scheduler_tests.make_seq, _scheduler_tests.run_step


def computed(scheduled) -> int:
    """Tokens the step really computes: its rows' and the rectangle's padding."""
    return scheduled.num_tokens + scheduled.num_padding_tokens


# ---------------------------------------------------------------------------------------------
# Hand-made cases
# ---------------------------------------------------------------------------------------------
def test_the_batch_prefills_as_one_padded_rectangle_then_decodes_every_slot():
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    a, b, c = make_seq(0, 2, max_tokens=1), make_seq(1, 5, max_tokens=4), make_seq(2, 3, max_tokens=2)
    for s in (a, b, c):
        sched.add(s)
    prefill = run_step(sched)
    assert prefill == [(a, 2), (b, 5), (c, 3)], "whole prompts, all in one step"
    assert prefill.num_padding_tokens == 3 * 5 - 10, "every prompt padded to the longest"
    assert a.is_finished
    late = make_seq(3, 1, max_tokens=1)
    sched.add(late)
    decodes = [run_step(sched) for _ in range(3)]
    assert [list(d) for d in decodes] == [[(b, 1), (c, 1)], [(b, 1)], [(b, 1)]], "the late one waits"
    # The finished members' slots are computed until the batch ends.
    assert [d.num_padding_tokens for d in decodes] == [1, 2, 2]
    assert all(computed(d) == 3 for d in decodes)
    assert b.is_finished and c.is_finished
    assert run_step(sched) == [(late, 1)]
    assert sched.allocator.num_free == sched.allocator.num_usable


def test_admission_stops_where_the_padded_prefill_passes_the_budget():
    """FCFS: a short prompt behind one that does not fit does not overtake it."""
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    seqs = [make_seq(0, 5), make_seq(1, 5), make_seq(2, 6), make_seq(3, 1)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert [s for s, _ in step] == seqs[:2], "3 x 6 = 18 tokens would pass the budget of 16"
    assert computed(step) == 2 * 5 and list(sched.waiting) == seqs[2:]
    # Pages for each member's whole length are reserved up front, as "request" does.
    assert all(len(s.page_ids) * 4 >= sched.max_len(s) for s in seqs[:2])


def test_a_lone_prompt_longer_than_the_budget_prefills_in_chunks():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    long_, short = make_seq(0, 20, max_tokens=2), make_seq(1, 2, max_tokens=1)
    sched.add(long_)
    sched.add(short)
    steps = []
    while not long_.is_finished:
        step = run_step(sched)
        assert [s for s, _ in step] == [long_], "nobody joins a batch whose prefill passes the budget"
        steps.append((step.num_tokens, step.num_padding_tokens))
    assert steps == [(8, 0), (8, 0), (4, 0), (1, 0)]
    assert run_step(sched) == [(short, 2)]


def test_a_recomputed_batch_is_admitted_again_as_a_rectangle():
    """After a lost cache every member recomputes its prompt and outputs: the batch is admitted
    anew (as far as its rectangle fits) and the outputs continue."""
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    a, b = make_seq(0, 3, max_tokens=6), make_seq(1, 4, max_tokens=6)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    run_step(sched)
    recompute_running(sched)
    assert sched.static_batch_size == 2 and not sched.running
    step = run_step(sched)
    assert step == [(a, 5), (b, 6)] and step.num_padding_tokens == 1
    while sched.has_unfinished():
        assert computed(run_step(sched)) == 2
    assert a.output_token_ids == b.output_token_ids == [7] * 6
    assert sched.allocator.num_free == sched.allocator.num_usable


def test_speculative_decoding_is_refused():
    """FasterTransformer did not speculate: the baseline refuses a speculative config."""
    with pytest.raises(ValueError, match="request_padded"):
        make_scheduler(speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def test_the_request_policy_stays_unpadded():
    sched = make_scheduler(scheduling="request")
    a, b = make_seq(0, 2, max_tokens=1), make_seq(1, 5, max_tokens=3)
    sched.add(a)
    sched.add(b)
    steps = [run_step(sched) for _ in range(3)]
    assert [s.num_padding_tokens for s in steps] == [0, 0, 0]


# ---------------------------------------------------------------------------------------------
# Property test
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Req:
    arrival: int
    prompt_len: int
    max_tokens: int
    abort_at: int | None


@st.composite
def workloads(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 48))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 40))
    reqs = []
    for _ in range(draw(st.integers(1, 12))):
        arrival = draw(st.integers(0, 12))
        abort_at = draw(st.one_of(st.none(), st.none(), st.integers(arrival, arrival + 25)))
        reqs.append(Req(arrival, draw(st.integers(1, max_model_len - 1)), draw(st.integers(1, 16)), abort_at))
    # The engine rejects requests that cannot fit the pool at full length.
    full = max(-(-min(r.prompt_len + r.max_tokens, max_model_len) // page_size) for r in reqs)
    num_usable = full + draw(st.integers(0, full * 4))
    return dict(page_size=page_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget, num_pages=num_usable + 1, enable_prefix_caching=False), reqs


# The fake model: a sequence's k-th output token is fixed by (sequence, k); one in eleven stops it.
def fake_token(seq_id: int, index: int) -> int:
    return (seq_id * 7919 + index * 104729 + (seq_id * index) % 97) % 500 + 1


def stop_on_multiples_of_11(seqs, tokens):
    return [("stop", t) if t % 11 == 0 else None for t in tokens]


def fake_step(scheduled) -> list[int]:
    return [fake_token(s.seq_id, len(s.output_token_ids) + s.num_pending - 1) if samples else 0
            for s, samples in zip(scheduled.seqs, scheduled.samples)]


def expected_output(req: Req, seq_id: int, max_model_len: int) -> list[int]:
    out = []
    while len(out) < min(req.max_tokens, max_model_len - req.prompt_len):
        out.append(fake_token(seq_id, len(out)))
        if out[-1] % 11 == 0:
            break
    return out


class Rectangle:
    """What the test knows of the running static batch: its members and their prompts."""

    def __init__(self, members: list[Sequence]):
        self.members = members
        self.longest = max(s.num_tokens for s in members)

    def check_step(self, sched: Scheduler, scheduled, first: bool, done_before: set[int]) -> None:
        budget = sched.config.max_num_batched_tokens
        rows = {id(s): n for s, n in scheduled}
        assert set(rows) <= {id(s) for s in self.members}, "a row outside the static batch"
        live = [s for s in self.members if id(s) not in done_before]
        assert all(id(s) in rows for s in live), "a member with work left was not scheduled"
        if not scheduled:
            assert scheduled.num_padding_tokens == 0
            return
        if len(self.members) == 1:  # alone: nothing to pad to; a prompt past the budget is chunked
            assert scheduled.num_padding_tokens == 0
            if first:
                assert list(rows.values()) == [min(self.longest, budget)]
        elif first:
            assert rows == {id(s): s.num_tokens for s in self.members}, "prompts chunked"
            assert computed(scheduled) == len(self.members) * self.longest
        else:
            assert all(n == 1 for n in rows.values()), "a multi-member batch decodes after its prefill"
            assert computed(scheduled) == len(self.members), "one token per member, finished ones too"


def drive(config_kw: dict, reqs: list[Req], overlapped: bool) -> None:
    config = EngineConfig(scheduling="request_padded", **config_kw).resolve(MODEL)
    alloc = PageAllocator(config.num_pages, config.page_size)
    sched = Scheduler(config, alloc)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    seqs: dict[int, Sequence] = {}
    rectangle, in_flight, step = None, None, 0
    while step <= 13 or sched.has_unfinished() or in_flight:
        assert step < 5000, "no progress: livelock"
        for i in order:
            if reqs[i].arrival == step:
                seqs[i] = Sequence(len(seqs), f"r{i}", 0, [5] * reqs[i].prompt_len,
                                   SamplingParams(max_tokens=reqs[i].max_tokens, temperature=0), seed=i)
                sched.add(seqs[i])
        for i, seq in seqs.items():
            if reqs[i].abort_at == step and not seq.is_finished:
                sched.finish(seq, "abort")

        running_before = list(sched.running)
        # Members done: finished, or their last token in flight takes them to their length.
        done_before = {id(s) for s in seqs.values()
                       if s.is_finished or s.num_tokens + s.num_pending >= sched.max_len(s)}
        waiting_before = list(sched.waiting)
        scheduled = sched.schedule()
        admitted = [s for s in waiting_before if s.status is SequenceStatus.RUNNING]
        assert not (admitted and running_before), "a running static batch was joined"
        assert admitted == waiting_before[:len(admitted)], "admission skipped the head of the queue"
        if admitted:
            rectangle = Rectangle(admitted)
            assert len(admitted) == 1 or len(admitted) * rectangle.longest <= config.max_num_batched_tokens
        assert computed(scheduled) <= config.max_num_batched_tokens, "the rectangle passes the budget"
        assert sched.num_preemptions == 0
        assert all(len(s.page_ids) * config.page_size >= sched.max_len(s) for s in sched.running)
        if rectangle is not None:
            rectangle.check_step(sched, scheduled, bool(admitted), done_before)

        dispatched = (scheduled, fake_step(scheduled)) if scheduled else None
        done, in_flight = (in_flight, dispatched) if overlapped else (dispatched, None)
        if done is not None:
            sched.postprocess(*done, stop_on_multiples_of_11)
        step += 1

    assert not sched.running and not sched.waiting
    assert alloc.num_free == alloc.num_usable, "pages did not all come back"
    assert sched.slots.num_free == config.max_num_seqs
    for i, seq in seqs.items():
        full = expected_output(reqs[i], seq.seq_id, config.max_model_len)
        assert seq.is_finished and seq.page_ids == [] and seq.slot is None
        if seq.finish_reason == "abort":
            assert seq.output_token_ids == full[:len(seq.output_token_ids)]
        else:
            assert seq.output_token_ids == full
            assert seq.finish_reason == ("stop" if full[-1] % 11 == 0 else "length")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.booleans())
def test_padded_rectangle_invariants(case, overlapped):
    config_kw, reqs = case
    drive(config_kw, reqs, overlapped)


# ---------------------------------------------------------------------------------------------
# The engine on the tiny random Llama
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    """Buckets 8, 16, 32; a pool that holds four sequences at full length."""
    return tiny_engine_factory(max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=8, page_size=8,
                               num_pages=33, max_model_len=64)


def run(engine, requests) -> dict[str, list[int]]:
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert engine.num_free_pages == engine.allocator.num_usable, "KV pages leaked"
    return final


def test_engine_request_padded_gives_iteration_levels_tokens_and_computes_its_padding(engine, monkeypatch):
    # 3 + 7 + 5 = 15 real prompt tokens, a 3 x 7 = 21 rectangle: bucket 32, not 16. The fourth
    # prompt does not fit beside them (4 x 9 > 32); the fifth, longer than the budget, prefills alone.
    lengths, max_tokens = (3, 7, 5, 9, 40), (2, 6, 4, 5, 3)
    requests = [(f"r{i}", [(11 * i + 5 * k) % 400 + 3 for k in range(n)],
                 SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
                for i, (n, m) in enumerate(zip(lengths, max_tokens))]
    expected = run(engine, requests)

    monkeypatch.setattr(engine.scheduler, "config",
                        dataclasses.replace(engine.scheduler.config, scheduling="request_padded"))
    steps = []
    real = engine.runner.dispatch

    def recording_dispatch(scheduled):
        pending = real(scheduled)
        steps.append((scheduled.num_tokens, scheduled.num_padding_tokens, engine.runner.last_bucket))
        return pending

    monkeypatch.setattr(engine.runner, "dispatch", recording_dispatch)
    assert run(engine, requests) == expected
    config = engine.config
    for real_tokens, padding, bucket in steps:
        assert bucket == token_bucket(config, real_tokens + padding), "the bucket holds the padding"
    assert steps[0] == (15, 6, 32)
    # Then r0 is done after its second token, and every decode step of the batch until r1's last
    # still computes its slot (and r2's, once r2 is done): three tokens each.
    assert Counter(t + p for t, p, _ in steps if p) == Counter({21: 1, 3: 4}), steps


# ---------------------------------------------------------------------------------------------
# The benchmark's rules for the policy
# ---------------------------------------------------------------------------------------------
def test_request_padded_returns_with_its_batch_like_request():
    from orca_jax.bench.driver import holds_until_batch_ends

    assert holds_until_batch_ends("request_padded", "batch") and holds_until_batch_ends("request", "batch")
    assert not holds_until_batch_ends("request_padded", "early") and not holds_until_batch_ends("iteration", "batch")


def test_analyze_reports_iteration_over_each_baseline():
    from orca_jax.bench.orca import SweepSettings, analyze, format_report

    def run_of(policy, rate, throughput, latency):
        return {"policy": policy, "rate": rate, "engine_steps": 1, "xla_compiles_during_run": 0,
                "summary": {"requests_per_s": throughput, "output_tokens_per_s": 1.0,
                            "normalized_latency_ms": {"p50": latency, "p90": latency},
                            "ttft_ms": {"p50": 1.0, "p99": 1.0}, "tpot_ms": {"p50": None, "p99": None}}}

    runs = [run_of("iteration", 1.0, 1.0, 10.0), run_of("iteration", 4.0, 4.0, 30.0),
            run_of("request", 1.0, 1.0, 15.0), run_of("request", 4.0, 2.0, 40.0),
            run_of("request_padded", 1.0, 1.0, 18.0), run_of("request_padded", 4.0, 1.5, 60.0)]
    policies = ("iteration", "request", "request_padded")
    assert SweepSettings(policies=policies).policies == policies  # `--policies` accepts it
    result = analyze(runs, policies, None)
    assert result["headline"]["ratio"] > 1 and result["headline_padded"]["ratio"] > result["headline"]["ratio"]
    assert len(result["ratios_padded"]) == len(result["ratios"])
    only_padded = analyze([r for r in runs if r["policy"] != "request"], ("iteration", "request_padded"), None)
    assert "headline" not in only_padded and only_padded["headline_padded"] == result["headline_padded"]
    report = format_report({"model": "m", "trace": "t", "decode_step_ms_by_batch_size": {}, "runs": runs,
                            **result})
    assert "HEADLINE: iteration-level / request-level throughput" in report
    assert "HEADLINE: iteration-level / padded request-level (FasterTransformer) throughput" in report


def test_the_cli_offers_the_policy():
    from orca_jax.cli.commands import _engine_config, build_parser

    args = build_parser().parse_args(["serve", "--scheduling", "request_padded"])
    assert _engine_config(args).scheduling == "request_padded"
