"""Scheduler + PageAllocator without a model: model steps are simulated with postprocess().

The property tests drive random arrivals, prompts (often sharing a prefix), max_tokens, aborts,
failed steps and tiny page pools through both policies, with prefix caching on and off, and
check the scheduler's invariants after every schedule() call. A fake KV cache records which
token prefix each page slot holds K/V for, so that every step's reads are checked against what
an earlier (or the same) step wrote, and every published page against its hash.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.core.kv_cache import PADDING_PAGE, PageAllocator
from orca_jax.core.sampling_params import SamplingParams
from orca_jax.core.scheduler import Scheduler
from orca_jax.core.sequence import Sequence, SequenceStatus

MODEL = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
)


def make_scheduler(**kw) -> Scheduler:
    """The hand-made cases below are about the policies: their prompts overlap, so prefix
    caching is off unless a case turns it on (tests/core/test_prefix_cache.py has its own)."""
    settings_ = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=33, max_model_len=64,
                     enable_prefix_caching=False)
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
    """Tokens are counted when scheduled: schedule() advances num_computed_tokens (and counts
    the sampling row's token as pending), postprocess() only appends."""
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq(0, 12)
    sched.add(seq)
    scheduled = sched.schedule()
    assert seq.num_computed_tokens == 8 and seq.num_pending == 0 and scheduled.samples == [False]
    assert sched.postprocess(scheduled, [99]).advanced == [] and seq.output_token_ids == []
    assert seq.num_computed_tokens == 8, "postprocess does not advance the cached count"
    scheduled = sched.schedule()
    assert scheduled.starts == [8] and scheduled.samples == [True]
    assert seq.num_computed_tokens == 12 and seq.num_pending == 1
    assert sched.postprocess(scheduled, [42]).advanced == [(0, seq)] and seq.output_token_ids == [42]
    assert seq.num_computed_tokens == 12 and seq.num_pending == 0 and seq.is_decoding


def test_postprocess_applies_the_stop_rule_then_the_length_limit():
    sched = make_scheduler()
    stops, lengths, goes_on = make_seq(0, 4, max_tokens=3), make_seq(1, 4, max_tokens=1), make_seq(2, 4)
    for seq in (stops, lengths, goes_on):
        sched.add(seq)
    scheduled = sched.schedule()
    calls = []

    def stop_first(seqs, tokens):
        calls.append([(seq.seq_id, token, seq.output_token_ids[-1]) for seq, token in zip(seqs, tokens)])
        return [("stop", token) if seq is stops else None for seq, token in zip(seqs, tokens)]

    update = sched.postprocess(scheduled, [5, 6, 7], stop_first)
    assert calls == [[(0, 5, 5), (1, 6, 6), (2, 7, 7)]], "one call for the step, each token already appended"
    assert update.finished == [stops, lengths]
    assert (stops.finish_reason, stops.stop_reason) == ("stop", 5)
    assert (lengths.finish_reason, lengths.stop_reason) == ("length", None)
    assert goes_on.finish_reason is None and sched.running == [goes_on]
    assert stops.page_ids == [] and lengths.page_ids == [], "retired sequences give their pages back"
    assert stops.slot is None and lengths.slot is None and sched.slots.num_free == 3
    # A step whose only sampling row is of a finished sequence: nothing for the rule to see.
    calls.clear()
    sched.finish(goes_on, "abort")
    assert sched.postprocess(scheduled, [5, 6, 7], stop_first).advanced == [] and calls == []


def test_unschedule_restores_the_counts():
    """A step that could not be dispatched is taken back: no cached count advanced, nothing
    pending, but admitted sequences keep their slot and pages, so the next schedule() makes
    the same step."""
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b = make_seq(0, 3), make_seq(1, 10)
    sched.add(a)
    sched.postprocess(sched.schedule(), [7])  # a decodes from now on
    sched.add(b)
    first = sched.schedule()  # a's decode, the first chunk of b
    assert first == [(a, 1), (b, 7)] and a.num_pending == 1
    # Overlapped: the next step is scheduled while the first is in flight, then fails.
    second = sched.schedule()
    assert second == [(a, 1), (b, 3)] and second.samples == [True, True]
    assert (a.num_pending, b.num_pending, b.num_computed_tokens) == (2, 1, 10)
    state = [(s.num_computed_tokens, s.num_pending, list(s.page_ids), s.slot) for s in (a, b)]
    sched.unschedule(second)
    assert [(s.num_computed_tokens, s.num_pending) for s in (a, b)] == [(4, 1), (7, 0)]
    assert [(list(s.page_ids), s.slot) for s in (a, b)] == [st[2:] for st in state], "pages and slots kept"
    again = sched.schedule()
    assert again == second and again.starts == second.starts and again.samples == second.samples
    sched.unschedule(again)
    sched.unschedule(first)
    assert [(s.num_computed_tokens, s.num_pending) for s in (a, b)] == [(3, 0), (0, 0)]
    assert b.status is SequenceStatus.RUNNING and sched.running == [a, b] and sched.num_running_requests == 2
    assert sched.schedule() == first


# ---------------------------------------------------------------------------------------------
# Prefix caching, hand-made
# ---------------------------------------------------------------------------------------------
def caching_scheduler(**kw) -> Scheduler:
    return make_scheduler(enable_prefix_caching=True, **kw)


def finish_alone(sched: Scheduler, seq: Sequence) -> None:
    sched.add(seq)
    while not seq.is_finished:
        run_step(sched)


def test_admission_starts_after_the_cached_prefix():
    """A 14-token prompt leaves 3 full pages of 4 cached; a later prompt sharing 13 tokens finds
    them, is scheduled from token 12, and the counters say so."""
    sched = caching_scheduler(max_num_batched_tokens=32)
    first = make_seq(0, 14, max_tokens=2)
    finish_alone(sched, first)
    assert sched.allocator.num_cached == 3 and sched.allocator.num_used == 0
    later = Sequence(1, "r1", 0, first.prompt_token_ids[:13] + [99, 98], SamplingParams(max_tokens=2), seed=1)
    sched.add(later)
    scheduled = sched.schedule()
    assert scheduled == [(later, 3)] and scheduled.starts == [12]
    assert later.num_cached_tokens == 12 and later.page_ids[:3] == sched.allocator.lookup(later.page_hashes[:3])
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (14 + 15, 12)
    assert all(sched.allocator.ref_count(p) == 1 for p in later.page_ids)


def test_penalties_and_the_request_policy_do_not_look_up():
    for kw, params in (({}, SamplingParams(max_tokens=2, repetition_penalty=1.1)),
                       ({"scheduling": "request"}, SamplingParams(max_tokens=2))):
        sched = caching_scheduler(**kw)
        finish_alone(sched, make_seq(0, 14, max_tokens=2))
        again = Sequence(1, "r1", 0, make_seq(0, 14).prompt_token_ids, params, seed=1)
        sched.add(again)
        assert sched.schedule().starts == [0] and again.num_cached_tokens == 0


def test_cached_pages_per_step_are_bounded():
    """At most `cached_pages_per_step` cached pages join one step (the page writes it carries):
    a second sequence that would pass the bound waits a step, though budget is left."""
    sched = caching_scheduler(max_num_batched_tokens=16, max_model_len=64, num_pages=40)
    assert sched.config.cached_pages_per_step == 16
    first = make_seq(0, 60, max_tokens=1)
    finish_alone(sched, first)
    b, c = (Sequence(i, f"r{i}", 0, list(first.prompt_token_ids), SamplingParams(max_tokens=2), seed=i) for i in (1, 2))
    sched.add(b)
    sched.add(c)
    step = sched.schedule()
    assert step == [(b, 4)] and step.starts == [56], "14 cached pages; 14 more would pass 16"
    sched.postprocess(step, [7])
    step = sched.schedule()
    assert step == [(b, 1), (c, 4)] and step.starts == [60, 56]
    assert [sched.allocator.ref_count(p) for p in c.page_ids[:14]] == [2] * 14, "b and c share 14 pages"


def test_a_preempted_sequence_finds_its_own_pages_again():
    """Preempted, its full pages stay cached while nobody needs them, and its recompute
    starts after them."""
    sched = caching_scheduler(page_size=2, num_pages=6, max_num_batched_tokens=8, max_num_seqs=2)  # 5 pages
    old, new = make_seq(0, 3, max_tokens=4), Sequence(1, "r1", 0, [40, 41, 42], SamplingParams(max_tokens=4), 1)
    sched.add(old)
    sched.add(new)
    run_step(sched)
    run_step(sched)
    # Position 4 needs a third page each and one is free: the newest is preempted.
    assert run_step(sched) == [(old, 1)] and new.status is SequenceStatus.WAITING
    assert sched.allocator.num_cached == 2 + 2, "both sequences' two full pages are cached"
    while new.status is SequenceStatus.WAITING:
        scheduled = run_step(sched)
    row = scheduled.seqs.index(new)
    assert scheduled.starts[row] > 0, "the recompute starts after its own cached pages"
    while sched.has_unfinished():
        run_step(sched)
    assert old.output_token_ids == new.output_token_ids == [7] * 4
    assert sched.allocator.num_free == sched.allocator.num_usable


# ---------------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Req:
    arrival: int
    prompt_len: int
    max_tokens: int
    abort_at: int | None
    tokens: tuple[int, ...] | None = None  # the prompt; None: prompt_len fives

    @property
    def prompt(self) -> list[int]:
        return list(self.tokens) if self.tokens is not None else [5] * self.prompt_len


# Two "documents" prompts start from, so that prefixes are shared in whole pages and in part.
DOCUMENTS = [[(7 * i + 3) % 13 + 1 for i in range(48)], [(5 * i + 1) % 11 + 1 for i in range(48)]]


@st.composite
def prompts(draw, length: int) -> tuple[int, ...]:
    shared = draw(st.integers(0, length))
    document = DOCUMENTS[draw(st.integers(0, 1))]
    tail = draw(st.lists(st.integers(1, 3), min_size=length - shared, max_size=length - shared))
    return tuple(document[:shared] + tail)


@st.composite
def workloads(draw, failures: bool = True):
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 48))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 40))
    reqs = []
    for _ in range(draw(st.integers(1, 12))):
        arrival = draw(st.integers(0, 12))
        abort_at = draw(st.one_of(st.none(), st.none(), st.integers(arrival, arrival + 25)))
        prompt_len = draw(st.integers(1, max_model_len - 1))
        reqs.append(Req(arrival, prompt_len, draw(st.integers(1, 16)), abort_at, draw(prompts(prompt_len))))
    # The engine rejects requests that cannot fit the pool at full length; beyond that, pools
    # are tiny so that preemption is common.
    full = max(-(-min(r.prompt_len + r.max_tokens, max_model_len) // page_size) for r in reqs)
    num_usable = full + draw(st.one_of(st.integers(0, 2), st.integers(0, full * 3)))
    # Steps whose dispatch fails (the engine then fails the requests in them).
    failing = draw(st.frozensets(st.integers(0, 30), max_size=2)) if failures else frozenset()
    return dict(page_size=page_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget, num_pages=num_usable + 1,
                enable_prefix_caching=draw(st.booleans()), failing_steps=failing), reqs


# The fake model: the k-th output token of a sequence is a fixed function of (sequence, k), so
# runs that schedule differently (overlapped or not, other preemptions) must end with the same
# tokens. About one token in eleven is a stop token.
def fake_token(seq_id: int, index: int) -> int:
    return (seq_id * 7919 + index * 104729 + (seq_id * index) % 97) % 500 + 1


def is_stop_token(token: int) -> bool:
    return token % 11 == 0


def stop_on_multiples_of_11(seqs, tokens):
    assert [s.output_token_ids[-1] for s in seqs] == tokens, "the rule sees each token after it is appended"
    return [("stop", t) if is_stop_token(t) else None for t in tokens]


def expected_output(req: Req, seq_id: int, max_model_len: int) -> list[int]:
    """A request's whole output when nothing aborts it: up to its first stop token or its length."""
    out = []
    while len(out) < min(req.max_tokens, max_model_len - req.prompt_len):
        out.append(fake_token(seq_id, len(out)))
        if is_stop_token(out[-1]):
            break
    return out


NOT_SAMPLED = 10**6  # what the fake model returns for a row that samples nothing: never appended


def fake_step(scheduled) -> list[int]:
    """The tokens the fake model samples, fixed at dispatch: a sampling row's token is the
    sequence's output number len(output) + num_pending - 1 (its tokens still in flight come
    first), as the device draws it."""
    return [fake_token(s.seq_id, len(s.output_token_ids) + s.num_pending - 1) if samples else NOT_SAMPLED
            for s, samples in zip(scheduled.seqs, scheduled.samples)]


@dataclasses.dataclass(frozen=True)
class Before:
    status: SequenceStatus
    computed: int
    pending: int
    num_tokens: int
    preemptions: int
    decoding: bool


def snapshot(sched: Scheduler) -> dict[int, Before]:
    return {id(s): Before(s.status, s.num_computed_tokens, s.num_pending, s.num_tokens, s.num_preemptions,
                          s.is_decoding)
            for s in list(sched.running) + list(sched.waiting)}


def check_pages(sched: Scheduler, live: list[Sequence], finished: list[Sequence]) -> None:
    """Every page is held (as often as sequences hold it), free, or cached and evictable; never
    two of these. Without prefix caching no page is shared."""
    alloc = sched.allocator
    holders = Counter(p for s in live for p in s.page_ids)
    assert all(len(set(s.page_ids)) == len(s.page_ids) for s in live), "a page twice in one page table"
    assert PADDING_PAGE not in holders, "the padding page was handed out"
    assert all(1 <= p < alloc.num_pages for p in holders)
    assert [alloc.ref_count(p) for p in range(alloc.num_pages)] == [holders[p] for p in range(alloc.num_pages)], \
        "reference counts differ from the page tables holding each page"
    free, evictable = list(alloc._free), list(alloc._evictable)
    published = alloc.published()
    assert len(free) + len(evictable) == len(set(free) | set(evictable)), "a page listed twice as free"
    assert not (set(free) | set(evictable)) & set(holders), "a held page is on a free list"
    assert set(evictable) <= set(published.values()) and not set(free) & set(published.values())
    assert len(holders) + alloc.num_free == alloc.num_usable, "pages leaked or double-counted"
    assert all(s.page_ids == [] for s in finished)
    assert all(len(s.page_ids) <= sched.config.max_pages_per_seq for s in live), "page table overflow"
    if not sched.config.enable_prefix_caching:
        assert not published and max(holders.values(), default=0) <= 1, "pages shared with caching off"


def true_tokens(seq: Sequence, length: int) -> tuple[int, ...]:
    """The sequence's first `length` tokens as the fake model makes them, in flight or not."""
    outputs = [fake_token(seq.seq_id, k) for k in range(max(0, length - seq.num_prompt_tokens))]
    return tuple((seq.prompt_token_ids + outputs)[:length])


class FakeKVCache:
    """Which K/V each page slot holds: a position's K/V depend on every token up to it, so a
    slot holds the token prefix ending there. A step writes its rows' positions, then every
    row reads its whole context (as each layer writes before its attention reads)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.prefix_of_hash: dict[bytes, tuple[int, ...]] = {}

    def run(self, scheduled) -> None:
        ps = self.page_size
        for seq, n, start in zip(scheduled.seqs, scheduled.num_new, scheduled.starts):
            tokens = true_tokens(seq, start + n)
            for p in range(start, start + n):
                self.slots[seq.page_ids[p // ps], p % ps] = tokens[:p + 1]
        for seq, n, start in zip(scheduled.seqs, scheduled.num_new, scheduled.starts):
            tokens = true_tokens(seq, start + n)
            for p in range(start + n):
                assert self.slots.get((seq.page_ids[p // ps], p % ps)) == tokens[:p + 1], \
                    f"seq {seq.seq_id} reads the wrong K/V at position {p} (cached prefix {start})"

    def check_published(self, alloc: PageAllocator, seqs: list[Sequence]) -> None:
        """The hash table never maps to a page whose contents are not its hash's tokens."""
        ps = self.page_size
        for seq in seqs:
            for i, page_hash in enumerate(seq.page_hashes):
                self.prefix_of_hash.setdefault(page_hash, true_tokens(seq, (i + 1) * ps))
        for page_hash, page in alloc.published().items():
            prefix = self.prefix_of_hash[page_hash]
            for offset in range(ps):
                assert self.slots.get((page, offset)) == prefix[:len(prefix) - ps + offset + 1], \
                    f"page {page} is published for tokens it does not hold"


def fail_step(sched: Scheduler, scheduled) -> set[str]:
    """What the engine does when a step's dispatch raises: take the step back, then fail the
    requests in it (the step's publications are forgotten, the sequences aborted)."""
    sched.unschedule(scheduled)
    sched.forget_published(scheduled)
    for seq in scheduled.seqs:
        if not seq.is_finished:
            sched.finish(seq, "abort")
    return {seq.request_id for seq in scheduled.seqs}


def check_slots_and_counters(sched: Scheduler, finished: list[Sequence]) -> None:
    slots = [s.slot for s in sched.running]
    assert len(set(slots)) == len(slots), "two running sequences share a slot"
    assert all(0 <= slot < sched.config.max_num_seqs for slot in slots), "the sink slot was handed out"
    assert all(s.slot is None for s in list(sched.waiting) + finished), "a sequence off the batch holds a slot"
    assert sched.slots.num_free == sched.config.max_num_seqs - len(slots), "slots leaked"
    assert sched.num_running_requests == len({s.request_id for s in sched.running})
    assert sched.num_waiting_requests == len({s.request_id for s in sched.waiting})


def check_schedule(sched: Scheduler, scheduled, before: dict[int, Before], waiting_before: list[Sequence],
                   overlapped: bool) -> None:
    config, ps = sched.config, sched.config.page_size
    assert sum(scheduled.num_new) <= config.max_num_batched_tokens, "token budget exceeded"
    assert len(scheduled) <= config.max_num_seqs and len(sched.running) <= config.max_num_seqs
    assert len({id(s) for s in scheduled.seqs}) == len(scheduled), "a sequence scheduled twice"
    rows = {id(s): row for row, s in enumerate(scheduled.seqs)}
    for seq, n, start, samples in zip(scheduled.seqs, scheduled.num_new, scheduled.starts, scheduled.samples):
        b = before[id(seq)]
        assert seq.status is SequenceStatus.RUNNING and seq in sched.running
        # A sequence admitted (or preempted and readmitted) within this schedule starts over,
        # or after a cached prefix of whole pages.
        if b.status is SequenceStatus.WAITING or seq.num_preemptions > b.preemptions:
            assert start == 0 or (config.cached_pages_per_step and start % ps == 0), "admitted mid-context"
        else:
            assert start == b.computed
        known = b.num_tokens + b.pending  # tokens the host or the device holds
        assert 1 <= n <= known - start, "scheduled a token nobody knows yet"
        assert samples == (start + n == known), "a row samples exactly when it reaches the end"
        assert seq.num_computed_tokens == start + n, "schedule() counts the tokens it schedules"
        assert seq.num_pending == b.pending + samples
        assert len(seq.page_ids) * ps >= start + n, "pages do not cover the step"
    for seq in sched.running:
        assert seq.num_tokens + seq.num_pending <= sched.max_len(seq), "scheduled past max_len"
        assert seq.num_pending <= 1 + overlapped, "more tokens in flight than steps"
    for seq in list(sched.running) + list(sched.waiting):
        b = before.get(id(seq))
        if b is not None and id(seq) not in rows:
            preempted = seq.num_preemptions > b.preemptions
            assert seq.num_computed_tokens == (0 if preempted else b.computed) and seq.num_pending == b.pending
    for seq in waiting_before:
        if seq.status is SequenceStatus.RUNNING:
            assert before[id(seq)].pending == 0, "readmitted while a token of it was in flight"
    if not overlapped:
        assert all(b.pending == 0 for b in before.values()), "sync: nothing pending between steps"

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

    if config.scheduling == "request":
        assert sched.num_preemptions == 0, "request-level scheduling preempted"
        running_before = [i for i, b in before.items() if b.status is SequenceStatus.RUNNING]
        assert not admitted or not running_before, "admitted while a batch was still running"
        assert all(len(s.page_ids) * ps >= sched.max_len(s) for s in sched.running), \
            "full-length pages not reserved"
        assert all(s.page_ids == [] for s in sched.waiting)
    else:
        assert all(s.page_ids == [] for s in sched.waiting), "a waiting sequence holds pages"
        # Every sequence that was decoding and is still running gets its token, unless the
        # token in flight already takes it to its length (overlapped steps only).
        for seq in sched.running:
            b = before.get(id(seq))
            if b is not None and b.decoding and b.num_tokens + b.pending < sched.max_len(seq):
                assert id(seq) in rows, "a running decode was skipped"


def postprocess_and_check(sched: Scheduler, scheduled, tokens: list[int], discarded: Counter) -> None:
    was_finished = [s.is_finished for s in scheduled.seqs]
    computed = [s.num_computed_tokens for s in scheduled.seqs]
    pending = [s.num_pending for s in scheduled.seqs]
    n_out = [len(s.output_token_ids) for s in scheduled.seqs]
    update = sched.postprocess(scheduled, tokens, stop_on_multiples_of_11)
    advanced = {id(seq) for _, seq in update.advanced}
    assert [row for row, _ in update.advanced] == sorted(row for row, _ in update.advanced)
    for row, (seq, samples) in enumerate(zip(scheduled.seqs, scheduled.samples)):
        appended = samples and not was_finished[row]
        if samples and was_finished[row]:
            discarded[seq.seq_id] += 1  # finished (stopped or aborted) while the step ran
        assert (id(seq) in advanced) == appended
        assert len(seq.output_token_ids) == n_out[row] + appended
        if appended:
            assert seq.output_token_ids[-1] == tokens[row] and seq.num_pending == pending[row] - 1
        assert seq.num_computed_tokens == computed[row], "postprocess does not advance the cached count"
        stops = appended and (is_stop_token(tokens[row]) or seq.num_tokens >= sched.max_len(seq))
        assert (seq in update.finished) == stops, "retired exactly at its stop token or length"
        if seq in update.finished:
            assert seq.finish_reason == ("stop" if is_stop_token(tokens[row]) else "length")
    assert sched.num_discarded_tokens == sum(discarded.values())


def simulate(config_kw: dict, reqs: list[Req], policy: str, overlapped: bool = False) -> Scheduler:
    """Drive the scheduler with the fake model. Synchronous: schedule, run, postprocess.
    Overlapped (the engine's async mode): step k+1 is scheduled before step k is postprocessed,
    so every step is scheduled with the previous one's tokens still in flight. A step in
    `failing_steps` fails at dispatch: the steps in flight complete, its requests fail."""
    config_kw = dict(config_kw)
    failing_steps = config_kw.pop("failing_steps", frozenset())
    config = EngineConfig(scheduling=policy, **config_kw).resolve(MODEL)
    alloc = PageAllocator(config.num_pages, config.page_size)
    sched = Scheduler(config, alloc)
    kv = FakeKVCache(config.page_size)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    seqs: dict[int, Sequence] = {}  # request index -> its sequence, seq_id = arrival order
    failed: set[str] = set()
    discarded: Counter[int] = Counter()
    in_flight = None
    step = 0
    while step <= 13 or sched.has_unfinished() or in_flight:
        assert step < 5000, "no progress: livelock"
        for i in order:
            if reqs[i].arrival == step:
                seq = Sequence(len(seqs), f"r{i}", 0, reqs[i].prompt,
                               SamplingParams(max_tokens=reqs[i].max_tokens, temperature=0), seed=i)
                seqs[i] = seq
                sched.add(seq)
        for i, seq in seqs.items():
            if reqs[i].abort_at == step and not seq.is_finished:
                sched.finish(seq, "abort")  # with a step in flight, when overlapped

        before, waiting_before = snapshot(sched), list(sched.waiting)
        scheduled = sched.schedule()
        check_schedule(sched, scheduled, before, waiting_before, overlapped)
        if scheduled and step in failing_steps:
            done, in_flight = in_flight, None
            if done is not None:
                postprocess_and_check(sched, *done, discarded)
            failed |= fail_step(sched, scheduled)
        else:
            dispatched = None
            if scheduled:
                kv.run(scheduled)
                dispatched = (scheduled, fake_step(scheduled))
            done, in_flight = (in_flight, dispatched) if overlapped else (dispatched, None)
            if done is not None:
                postprocess_and_check(sched, *done, discarded)
        live = list(sched.running) + list(sched.waiting)
        finished = [s for s in seqs.values() if s.is_finished]
        check_pages(sched, live, finished)
        kv.check_published(alloc, list(seqs.values()))
        check_slots_and_counters(sched, finished)
        assert all(s.status is SequenceStatus.WAITING for s in sched.waiting)
        assert all(s.status is SequenceStatus.RUNNING for s in sched.running)
        if not overlapped:
            assert all(s.num_pending == 0 for s in live)
        step += 1

    # Every request finished or aborted; pool, slots and counters are whole again.
    assert len(seqs) == len(reqs)
    assert not sched.running and not sched.waiting
    assert alloc.num_free == alloc.num_usable
    assert sorted(list(alloc._free) + list(alloc._evictable)) == list(range(1, config.num_pages))
    assert all(alloc.ref_count(p) == 0 for p in range(config.num_pages))
    assert sched.slots.num_free == config.max_num_seqs
    assert sched.num_running_requests == sched.num_waiting_requests == 0
    for i, seq in seqs.items():
        assert seq.is_finished and seq.page_ids == [] and seq.slot is None
        assert seq.num_pending in (0, discarded[seq.seq_id]), "a token in flight that never arrived"
        full = expected_output(reqs[i], seq.seq_id, config.max_model_len)
        if seq.finish_reason == "abort":
            assert reqs[i].abort_at is not None or seq.request_id in failed
            assert seq.output_token_ids == full[:len(seq.output_token_ids)] and len(seq.output_token_ids) < len(full)
        else:
            assert seq.output_token_ids == full
            assert seq.finish_reason == ("stop" if is_stop_token(full[-1]) else "length")
        if seq.finish_reason == "length":
            assert discarded[seq.seq_id] == 0, "a length finish is foreseen: no token computed past it"
        assert discarded[seq.seq_id] <= overlapped, "more than one token discarded for a sequence"
    return sched


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_iteration_level_invariants(case):
    config_kw, reqs = case
    simulate(config_kw, reqs, "iteration")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_request_level_invariants(case):
    config_kw, reqs = case
    simulate(config_kw, reqs, "request")


def outputs(sched_seqs) -> dict[str, tuple]:
    return {s.request_id: (s.finish_reason, tuple(s.output_token_ids)) for s in sched_seqs}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(failures=False), st.sampled_from(["iteration", "request"]))
def test_overlapped_steps_end_as_the_synchronous_run(case, policy):
    """Step k+1 scheduled before step k is postprocessed (one step in flight, the engine's
    async mode): the invariants hold throughout, and every request that was not aborted ends
    with the tokens and finish reason of the synchronous run."""
    config_kw, reqs = case
    runs = {}
    for overlapped in (False, True):
        seen = []
        original = Scheduler.add

        def recording_add(self, seq, seen=seen):
            seen.append(seq)
            original(self, seq)

        Scheduler.add = recording_add
        try:
            sched = simulate(config_kw, reqs, policy, overlapped)
        finally:
            Scheduler.add = original
        runs[overlapped] = outputs(seen)
        if not overlapped:
            assert sched.num_discarded_tokens == 0
    for request_id, (reason, tokens) in runs[False].items():
        async_reason, async_tokens = runs[True][request_id]
        if "abort" not in (reason, async_reason):
            assert (async_reason, async_tokens) == (reason, tokens), request_id


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_tiny_pool_forces_preemption(page_size, overlapped):
    """The property workloads include pools this tight; here preemption is certain."""
    max_len = 24
    reqs = [Req(arrival=i % 3, prompt_len=5 + (3 * i) % 11, max_tokens=8, abort_at=None) for i in range(10)]
    reqs[4].abort_at = 6
    full = max(-(-min(r.prompt_len + r.max_tokens, max_len) // page_size) for r in reqs)
    config_kw = dict(page_size=page_size, max_model_len=max_len, max_num_seqs=4,
                     max_num_batched_tokens=12, num_pages=full + 2)
    sched = simulate(config_kw, reqs, "iteration", overlapped)
    assert sched.num_preemptions > 0
    sched = simulate(config_kw, reqs, "request", overlapped)
    assert sched.num_preemptions == 0


def test_overlapped_run_discards_the_token_after_a_stop():
    """A stop is seen one step late when overlapped: the step already in flight computed one
    more token for the sequence, which is discarded, never appended; its pages and slot are
    back at once. An abort with a step in flight discards that step's token the same way."""
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=2)
    a, b = make_seq(0, 3, max_tokens=8), make_seq(1, 3, max_tokens=8)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    second = sched.schedule()  # both sequences again, their first tokens still in flight
    assert second == [(a, 1), (b, 1)] and a.num_pending == b.num_pending == 2
    update = sched.postprocess(first, [11, 5], stop_on_multiples_of_11)
    assert update.finished == [a] and a.output_token_ids == [11] and a.page_ids == [] and a.slot is None
    sched.finish(b, "abort")
    assert sched.slots.num_free == 2 and sched.allocator.num_free == sched.allocator.num_usable
    update = sched.postprocess(second, [7, 7], stop_on_multiples_of_11)
    assert update.advanced == [] and a.output_token_ids == [11] and b.output_token_ids == [5]
    assert sched.num_discarded_tokens == 2


def start_running(sched: Scheduler, seq: Sequence, outputs: list[int], num_pages: int) -> Sequence:
    """A sequence running with its prompt and outputs cached but the last token, as admission
    and earlier steps leave it (slot, counters and pages through the scheduler's own paths)."""
    sched.add(seq)
    sched.move_to_running(seq)
    seq.slot_joined = False
    seq.output_token_ids = list(outputs)
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.page_ids = sched.allocator.allocate(num_pages)
    return seq


def test_a_preempted_sequence_waits_for_its_token_in_flight():
    """Overlapped steps: the victim of a preemption may have a token in flight. It must not be
    readmitted (its recompute needs that token) until the token has arrived, even when the
    preemption left pages and budget for it; then it is recomputed and goes on."""
    sched = make_scheduler(page_size=2, num_pages=6, max_num_batched_tokens=5, max_num_seqs=2)  # 5 pages
    a = start_running(sched, make_seq(0, 3, max_tokens=6), [fake_token(0, 0)], num_pages=2)  # room to position 3
    b = start_running(sched, make_seq(1, 5, max_tokens=6), [fake_token(1, 0)], num_pages=3)  # room to position 5
    assert sched.allocator.num_free == 0
    second = sched.schedule()
    assert second == [(a, 1), (b, 1)] and a.num_pending == b.num_pending == 1
    tokens = fake_step(second)
    third = sched.schedule()  # a's position 4 needs a page: b (not in this step) is preempted
    assert third == [(a, 1)] and sched.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING and b.num_pending == 1 and b.num_computed_tokens == 0
    assert sched.allocator.num_free == 2, "room enough to readmit b, were its token here"
    sched.postprocess(second, tokens, stop_on_multiples_of_11)
    assert b.output_token_ids == [fake_token(1, 0), fake_token(1, 1)] and b.num_pending == 0
    in_flight = (third, fake_step(third))
    while sched.has_unfinished() or in_flight:
        scheduled = sched.schedule()
        done, in_flight = in_flight, ((scheduled, fake_step(scheduled)) if scheduled else None)
        if done:
            sched.postprocess(*done, stop_on_multiples_of_11)
    for seq, req in ((a, Req(0, 3, 6, None)), (b, Req(0, 5, 6, None))):
        assert seq.output_token_ids == expected_output(req, seq.seq_id, 64)
    assert sched.allocator.num_free == sched.allocator.num_usable and sched.slots.num_free == 2


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
    for seq in (prefilling, decoding):  # running, with a slot, as admission leaves them
        sched.add(seq)
        sched.move_to_running(seq)
    assert sched.allocator.num_free == 0

    scheduled = sched.schedule()

    assert [(s.request_id, n) for s, n in scheduled] == [("new", 1)]
    assert decoding.status is SequenceStatus.RUNNING and len(decoding.page_ids) == 2
    assert prefilling.status is SequenceStatus.WAITING and prefilling.page_ids == []
    assert list(sched.waiting) == [prefilling]
    assert prefilling.slot is None and decoding.slot is not None and sched.slots.num_free == 3
