"""Scheduler + PageAllocator without a model: model steps are simulated with postprocess().

The property tests drive random arrivals, prompt lengths, max_tokens, aborts and tiny page pools
through both policies and check the scheduler's invariants after every schedule() call.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.kv_cache import PADDING_PAGE, PageAllocator
from orca_jax.sampling_params import SamplingParams
from orca_jax.scheduler import Scheduler
from orca_jax.sequence import Sequence, SequenceStatus

MODEL = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
)


def make_scheduler(**kw) -> Scheduler:
    settings_ = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=33, max_model_len=64)
    settings_.update(kw)
    config = EngineConfig(**settings_).resolve(MODEL)
    return Scheduler(config, PageAllocator(config.num_pages, config.page_size))


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(range(3, 3 + prompt_len)),
                    SamplingParams(max_tokens=max_tokens, temperature=0), seed=seq_id)


def run_step(sched: Scheduler, token: int = 7):
    """schedule + a simulated model step (postprocess retires sequences at their length)."""
    scheduled = sched.schedule()
    sched.postprocess(scheduled, [token] * len(scheduled))
    return scheduled


# ---------------------------------------------------------------------------------------------
# Hand-made cases
# ---------------------------------------------------------------------------------------------
def test_chunked_prefill_then_decode():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    seq = make_seq(0, 20, max_tokens=3)
    sched.add(seq)
    chunks = []
    while sched.has_unfinished():
        [(s, n)] = run_step(sched)
        assert s is seq
        chunks.append(n)
    assert chunks == [8, 8, 4, 1, 1], "20-token prompt in chunks of the budget, then one token per step"
    assert seq.output_token_ids == [7, 7, 7] and seq.finish_reason == "length"
    assert sched.allocator.num_free == sched.allocator.num_usable


def test_decodes_first_then_prefill_fills_the_budget():
    """Orca: a decoding request and a newcomer's prefill share one iteration."""
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    a, b = make_seq(0, 3), make_seq(1, 20)
    sched.add(a)
    assert run_step(sched) == [(a, 3)]
    sched.add(b)
    step = run_step(sched)
    assert step == [(a, 1), (b, 7)], "decode first, then the rest of the budget to the prefill"
    assert run_step(sched) == [(a, 1), (b, 7)]
    assert run_step(sched) == [(a, 1), (b, 6)]
    assert run_step(sched) == [(a, 1), (b, 1)]
    assert b.output_token_ids == [7, 7]


def test_max_num_seqs_and_fcfs_admission():
    sched = make_scheduler(max_num_batched_tokens=32, max_num_seqs=2)
    seqs = [make_seq(i, 2, max_tokens=2) for i in range(5)]
    for s in seqs:
        sched.add(s)
    first = run_step(sched)
    assert [s for s, _ in first] == seqs[:2]
    assert list(sched.waiting) == seqs[2:]
    run_step(sched)  # both finish (2 tokens each)
    assert [s.is_finished for s in seqs] == [True, True, False, False, False]
    assert [s for s, _ in run_step(sched)] == seqs[2:4]


def test_head_of_queue_is_not_overtaken():
    """A large request that does not fit blocks smaller later ones (no overtaking)."""
    sched = make_scheduler(page_size=4, num_pages=6, max_num_batched_tokens=32, max_num_seqs=4)  # 5 pages
    small, big, later = make_seq(0, 8, max_tokens=4), make_seq(1, 16, max_tokens=2), make_seq(2, 1, max_tokens=1)
    for s in (small, big, later):
        sched.add(s)
    step = run_step(sched)
    assert [s for s, _ in step] == [small], "big (4 pages) does not fit beside small; later must wait"
    assert list(sched.waiting) == [big, later]


def test_preemption_evicts_the_newest_and_keeps_its_tokens():
    sched = make_scheduler(page_size=2, num_pages=5, max_num_batched_tokens=8, max_num_seqs=2)  # 4 pages
    old, new = make_seq(0, 3, max_tokens=6), make_seq(1, 3, max_tokens=6)
    sched.add(old)
    sched.add(new)
    assert run_step(sched) == [(old, 3), (new, 3)]  # 2 pages each: pool empty
    assert sched.allocator.num_free == 0
    # Position 3 still fits each sequence's second page.
    assert run_step(sched) == [(old, 1), (new, 1)]
    # Position 4 needs a third page for each, and none is free: the newest is evicted.
    step = run_step(sched)
    assert step == [(old, 1)], step
    assert sched.num_preemptions == 1 and new.num_preemptions == 1
    assert new.status is SequenceStatus.WAITING and new.page_ids == [] and new.num_computed_tokens == 0
    assert new.output_token_ids == [7, 7], "generated tokens survive a preemption"
    assert sched.waiting[0] is new, "the victim goes back to the front of the queue"
    while sched.has_unfinished():
        run_step(sched)
    assert old.output_token_ids == new.output_token_ids == [7] * 6
    assert sched.allocator.num_free == sched.allocator.num_usable


def test_abort_waiting_and_running_frees_pages():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=1)
    running, waiting = make_seq(0, 10), make_seq(1, 4)
    sched.add(running)
    sched.add(waiting)
    run_step(sched)
    assert running.status is SequenceStatus.RUNNING and running.page_ids
    sched.finish(waiting, "abort")
    sched.finish(running, "abort")
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert running.page_ids == [] and not sched.has_unfinished()
    assert sched.allocator.num_free == sched.allocator.num_usable


def test_request_level_waits_for_the_whole_batch():
    sched = make_scheduler(scheduling="request", max_num_batched_tokens=16, max_num_seqs=4)
    short, long_ = make_seq(0, 2, max_tokens=1), make_seq(1, 2, max_tokens=5)
    sched.add(short)
    sched.add(long_)
    run_step(sched)
    # Pages for the whole length are reserved up front.
    assert len(long_.page_ids) * 4 >= 2 + 5
    assert short.is_finished
    late = make_seq(2, 2, max_tokens=1)
    sched.add(late)
    for _ in range(4):
        assert [s for s, _ in run_step(sched)] == [long_], "the late request waits for the batch"
    assert long_.is_finished
    assert [s for s, _ in run_step(sched)] == [late]
    assert sched.num_preemptions == 0


def test_postprocess_appends_only_when_the_prompt_is_done():
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq(0, 12)
    sched.add(seq)
    scheduled = sched.schedule()
    assert sched.postprocess(scheduled, [99]).advanced == [] and seq.output_token_ids == []
    assert seq.num_computed_tokens == 8
    scheduled = sched.schedule()
    assert sched.postprocess(scheduled, [42]).advanced == [(0, seq)] and seq.output_token_ids == [42]
    assert seq.num_computed_tokens == 12 and seq.is_decoding


def test_postprocess_applies_the_stop_rule_then_the_length_limit():
    sched = make_scheduler()
    stops, lengths, goes_on = make_seq(0, 4, max_tokens=3), make_seq(1, 4, max_tokens=1), make_seq(2, 4)
    for seq in (stops, lengths, goes_on):
        sched.add(seq)
    scheduled = sched.schedule()
    seen = []

    def stop_on_first_row(seq, token):
        seen.append((seq.seq_id, token))
        return ("stop", token) if seq is stops else None

    update = sched.postprocess(scheduled, [5, 6, 7], stop_on_first_row)
    assert seen == [(0, 5), (1, 6), (2, 7)], "the rule sees every new token, after it is appended"
    assert update.finished == [stops, lengths]
    assert (stops.finish_reason, stops.stop_reason) == ("stop", 5)
    assert (lengths.finish_reason, lengths.stop_reason) == ("length", None)
    assert goes_on.finish_reason is None and sched.running == [goes_on]
    assert stops.page_ids == [] and lengths.page_ids == [], "retired sequences give their pages back"


# ---------------------------------------------------------------------------------------------
# Property tests
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
    # The engine rejects requests that cannot fit the pool at full length; beyond that, pools
    # are tiny so that preemption is common.
    full = max(-(-min(r.prompt_len + r.max_tokens, max_model_len) // page_size) for r in reqs)
    num_usable = full + draw(st.one_of(st.integers(0, 2), st.integers(0, full * 3)))
    return dict(page_size=page_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget, num_pages=num_usable + 1), reqs


def check_pages(sched: Scheduler, live: list[Sequence], finished: list[Sequence]) -> None:
    alloc = sched.allocator
    owned = [p for s in live for p in s.page_ids]
    assert len(owned) == len(set(owned)), "a page is owned by two sequences"
    assert PADDING_PAGE not in owned, "the padding page was handed out"
    assert all(1 <= p < alloc.num_pages for p in owned)
    free = list(alloc._free)
    assert len(free) == len(set(free)) and not set(free) & set(owned)
    assert len(owned) + alloc.num_free == alloc.num_usable, "pages leaked or double-counted"
    assert all(s.page_ids == [] for s in finished)
    assert all(len(s.page_ids) <= sched.config.max_pages_per_seq for s in live), "page table overflow"


def simulate(config_kw: dict, reqs: list[Req], policy: str) -> Scheduler:
    config = EngineConfig(scheduling=policy, **config_kw).resolve(MODEL)
    alloc = PageAllocator(config.num_pages, config.page_size)
    sched = Scheduler(config, alloc)
    ps, budget = config.page_size, config.max_num_batched_tokens
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    seqs: dict[int, Sequence] = {}
    next_id = 0
    step = 0
    while step <= 13 or sched.has_unfinished():
        assert step < 5000, "no progress: livelock"
        # Arrivals (seq_id = arrival order) and aborts at this step.
        for i in order:
            if reqs[i].arrival == step:
                seq = Sequence(next_id, f"r{i}", 0, [5] * reqs[i].prompt_len,
                               SamplingParams(max_tokens=reqs[i].max_tokens, temperature=0), seed=i)
                next_id += 1
                seqs[i] = seq
                sched.add(seq)
        for i, seq in seqs.items():
            if reqs[i].abort_at == step and not seq.is_finished:
                sched.finish(seq, "abort")

        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        decoding_before = [s for s in running_before if s.is_decoding]
        scheduled = sched.schedule()

        # Batch limits.
        assert sum(n for _, n in scheduled) <= budget, "token budget exceeded"
        assert len(scheduled) <= config.max_num_seqs and len(sched.running) <= config.max_num_seqs
        assert len({id(s) for s, _ in scheduled}) == len(scheduled), "a sequence scheduled twice"
        for seq, n_new in scheduled:
            assert seq.status is SequenceStatus.RUNNING and seq in sched.running
            assert 1 <= n_new <= seq.num_uncomputed_tokens
            assert len(seq.page_ids) * ps >= seq.num_computed_tokens + n_new, "pages do not cover the step"
        live = list(sched.running) + list(sched.waiting)
        finished = [s for s in seqs.values() if s.is_finished]
        check_pages(sched, live, finished)
        assert all(s.status is SequenceStatus.WAITING for s in sched.waiting)
        assert all(s.status is SequenceStatus.RUNNING for s in sched.running)

        # FCFS: admission in arrival order, and nothing that arrived later runs ahead of a
        # waiting request (preemption victims are the newest, so they stay in order too).
        ids_running = [s.seq_id for s in sched.running]
        ids_waiting = [s.seq_id for s in sched.waiting]
        assert ids_waiting == sorted(ids_waiting), "waiting queue out of arrival order"
        assert ids_running == sorted(ids_running), "admitted out of arrival order"
        assert not ids_waiting or not ids_running or max(ids_running) < min(ids_waiting), \
            "a later request was admitted before an earlier waiting one"
        admitted = [s for s in waiting_before if s.status is SequenceStatus.RUNNING]
        assert admitted == waiting_before[: len(admitted)], "admission skipped the head of the queue"

        if policy == "request":
            assert sched.num_preemptions == 0, "request-level scheduling preempted"
            new = [s for s in sched.running if s not in running_before]
            assert not new or not running_before, "admitted while a batch was still running"
            assert all(len(s.page_ids) * ps >= sched.max_len(s) for s in sched.running), \
                "full-length pages not reserved"
            assert all(s.page_ids == [] for s in sched.waiting)
        else:
            assert all(s.page_ids == [] for s in sched.waiting), "a waiting sequence holds pages"
            # Iteration-level: every sequence that was decoding and is still running gets its token.
            in_step = {id(s) for s, _ in scheduled}
            for s in decoding_before:
                if s.status is SequenceStatus.RUNNING:
                    assert id(s) in in_step, "a running decode was skipped"

        # The simulated model step.
        before = {id(s): (s.num_computed_tokens, len(s.output_token_ids)) for s, _ in scheduled}
        update = sched.postprocess(scheduled, [100 + step] * len(scheduled))
        advanced = [seq for _, seq in update.advanced]
        for seq, n_new in scheduled:
            computed, n_out = before[id(seq)]
            assert seq.num_computed_tokens == computed + n_new
            reached_end = computed + n_new == seq.num_prompt_tokens + n_out
            assert (seq in advanced) == reached_end
            assert len(seq.output_token_ids) == n_out + reached_end
            at_length = len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= config.max_model_len
            assert (seq in update.finished) == (reached_end and at_length), "retired exactly at its length"
        step += 1

    # Every request finished or aborted, and the pool is whole again.
    assert len(seqs) == len(reqs)
    assert not sched.running and not sched.waiting
    assert alloc.num_free == alloc.num_usable
    assert sorted(alloc._free) == list(range(1, config.num_pages))
    for i, seq in seqs.items():
        assert seq.is_finished and seq.page_ids == []
        expected_len = min(reqs[i].max_tokens, config.max_model_len - reqs[i].prompt_len)
        if seq.finish_reason == "length":
            assert len(seq.output_token_ids) == expected_len
        else:
            assert seq.finish_reason == "abort" and reqs[i].abort_at is not None
            assert len(seq.output_token_ids) < expected_len
    return sched


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_iteration_level_invariants(case):
    config_kw, reqs = case
    simulate(config_kw, reqs, "iteration")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_request_level_invariants(case):
    config_kw, reqs = case
    simulate(config_kw, reqs, "request")


@pytest.mark.parametrize("page_size", [1, 4])
def test_tiny_pool_forces_preemption(page_size):
    """The property workloads include pools this tight; here preemption is certain."""
    max_len = 24
    reqs = [Req(arrival=i % 3, prompt_len=5 + (3 * i) % 11, max_tokens=8, abort_at=None) for i in range(10)]
    reqs[4].abort_at = 6
    full = max(-(-min(r.prompt_len + r.max_tokens, max_len) // page_size) for r in reqs)
    config_kw = dict(page_size=page_size, max_model_len=max_len, max_num_seqs=4,
                     max_num_batched_tokens=12, num_pages=full + 2)
    sched = simulate(config_kw, reqs, "iteration")
    assert sched.num_preemptions > 0
    sched = simulate(config_kw, reqs, "request")
    assert sched.num_preemptions == 0


def test_preemption_never_evicts_a_sequence_already_in_the_step():
    """An older sequence still in prefill needs pages while a newer one has already been given
    its decode token: the victim must be the older one itself, never the scheduled one."""
    sched = make_scheduler(num_pages=4, page_size=4, max_num_batched_tokens=16)
    prefilling = Sequence(0, "old", 0, list(range(12)), SamplingParams(temperature=0, max_tokens=4), 0)
    decoding = Sequence(1, "new", 0, [1, 2, 3], SamplingParams(temperature=0, max_tokens=4), 0)
    prefilling.page_ids = sched.allocator.allocate(1)   # 4 of 12 prompt tokens cached
    prefilling.num_computed_tokens = 4
    decoding.page_ids = sched.allocator.allocate(2)     # room for its next token
    decoding.output_token_ids = [7]
    decoding.num_computed_tokens = 3
    for seq in (prefilling, decoding):
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
    assert sched.allocator.num_free == 0

    scheduled = sched.schedule()

    assert [(s.request_id, n) for s, n in scheduled] == [("new", 1)]
    assert decoding.status is SequenceStatus.RUNNING and len(decoding.page_ids) == 2
    assert prefilling.status is SequenceStatus.WAITING and prefilling.page_ids == []
    assert list(sched.waiting) == [prefilling]
