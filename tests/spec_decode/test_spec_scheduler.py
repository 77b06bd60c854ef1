"""Speculative decoding in the scheduler (orca_jax/core/scheduler/), host only, no model: which
drafts a step verifies (`_drafts_to_verify`: the token budget left after every running
sequence's next token, the length limit, pages only if free, never a preemption), and what
postprocess makes of a verified row (`num_accepted`: the accepted drafts and the target's token
appended in rounds, a stop inside the run ending it there, the cached count rolled back, pages
past the kept tokens freed and `pages_trimmed_to` set). A hypothesis property test drives
random schedules with random drafts, acceptances, stops and aborts through both policies and
checks pages, slots, cached K/V and outputs after every step.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

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
FILLER = 999  # what the device returns at positions past a row's emitted token: never appended


def make_scheduler(k: int = 5, **kw) -> Scheduler:
    settings_ = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=33, max_model_len=64,
                     enable_prefix_caching=False, speculative_config={"num_speculative_tokens": k})
    settings_.update(kw)
    config = EngineConfig(**settings_).resolve(MODEL)
    return Scheduler(config, PageAllocator(config.num_pages, config.page_size))


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 30) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(range(3, 3 + prompt_len)),
                    SamplingParams(max_tokens=max_tokens, temperature=0), seed=seq_id)


def device_tokens(scheduled, accepted: dict[int, int], targets: dict[int, int]) -> tuple[list[int], list[int]]:
    """(token per output position, accepted per row) as the step program returns them: a row
    that verified d drafts has d + 1 positions, its accepted drafts first, then the target's
    token (targets[seq_id], default 7), then filler. Rows without drafts: one position."""
    tokens, num_accepted = [], []
    for seq, drafts, samples in zip(scheduled.seqs, scheduled.drafts, scheduled.samples):
        a = accepted.get(seq.seq_id, 0) if drafts else 0
        assert a <= len(drafts)
        target = targets.get(seq.seq_id, 7) if samples else FILLER
        tokens += list(drafts[:a]) + [target] + [FILLER] * (len(drafts) - a)
        num_accepted.append(a)
    return tokens, num_accepted


def run_plain_step(sched: Scheduler) -> None:
    scheduled = sched.schedule()
    tokens, accepted = device_tokens(scheduled, {}, {})
    sched.postprocess(scheduled, tokens, None, accepted)


def decoding(sched: Scheduler, *seqs: Sequence) -> None:
    """Add the sequences and step until each has its first token and decodes."""
    for seq in seqs:
        sched.add(seq)
    while not all(s.is_decoding for s in seqs):
        run_plain_step(sched)


# ---------------------------------------------------------------------------------------------
# Which drafts a step verifies
# ---------------------------------------------------------------------------------------------
def test_drafts_take_only_the_budget_left_after_every_sequences_next_token():
    sched = make_scheduler(k=8, max_num_batched_tokens=16)
    a, b, c = make_seq(0, 3), make_seq(1, 3), make_seq(2, 3)
    decoding(sched, a, b, c)
    for i, seq in enumerate((a, b, c)):
        seq.draft_token_ids = list(range(100 * (i + 1), 100 * (i + 1) + 8))
    scheduled = sched.schedule()
    # 16 tokens, 3 of them the sequences' own: 13 for drafts, first come first served.
    assert scheduled == [(a, 9), (b, 6), (c, 1)]
    assert scheduled.drafts == [tuple(range(100, 108)), tuple(range(200, 205)), ()]
    assert scheduled.num_tokens == 16 and scheduled.samples == [True] * 3
    assert [s.num_computed_tokens for s in (a, b, c)] == [4 + 8, 4 + 5, 4], "drafts count as computed"
    assert all(s.draft_token_ids == [] for s in (a, b, c)), "a proposal is used up, cut or not"


def test_drafts_never_shrink_a_prefill_chunk_and_waiting_requests_wait():
    sched = make_scheduler(k=16, max_num_batched_tokens=16)
    a, d = make_seq(0, 3), make_seq(1, 40)
    decoding(sched, a)
    sched.add(d)
    run_plain_step(sched)  # a decodes, d's first chunk
    assert d.status is SequenceStatus.RUNNING and not d.is_decoding
    late = make_seq(2, 2)
    sched.add(late)
    a.draft_token_ids = list(range(100, 116))
    scheduled = sched.schedule()
    # Certain work before speculative work: a's token and d's 15-token chunk fill the budget.
    assert scheduled == [(a, 1), (d, 15)] and scheduled.drafts[0] == ()
    assert late.status is SequenceStatus.WAITING


def test_drafts_stop_at_the_length_limits():
    a = make_seq(0, 4, max_tokens=6)  # at most 10 tokens
    b = make_seq(1, 9, max_tokens=50)  # max_model_len 12
    sched = make_scheduler(k=5, max_model_len=12)
    decoding(sched, a, b)
    assert (a.num_tokens, b.num_tokens) == (5, 10)
    a.draft_token_ids, b.draft_token_ids = [11, 12, 13, 14, 15], [21, 22, 23]
    scheduled = sched.schedule()
    # Every accepted draft is an output token, and the target adds one more.
    assert scheduled.drafts == [(11, 12, 13, 14), (21,)]
    tokens, accepted = device_tokens(scheduled, {0: 4, 1: 1}, {0: 16, 1: 22})
    update = sched.postprocess(scheduled, tokens, None, accepted)
    assert a.output_token_ids == [7, 11, 12, 13, 14, 16] and a.finish_reason == "length"
    assert b.output_token_ids == [7, 21, 22] and b.finish_reason == "length"
    assert set(map(id, update.finished)) == {id(a), id(b)}
    assert sched.allocator.num_free == sched.allocator.num_usable


def test_drafts_are_cut_to_the_rows_own_pages_when_none_is_free():
    sched = make_scheduler(k=4, page_size=4, num_pages=3)  # two usable pages
    a = make_seq(0, 5)
    decoding(sched, a)
    assert len(a.page_ids) == 2 and sched.allocator.num_free == 0 and a.num_computed_tokens == 5
    a.draft_token_ids = [11, 12, 13, 14]
    scheduled = sched.schedule()
    # Position 5 (its token) and 6, 7 (two drafts) fit its pages; 8 would need a third.
    assert scheduled == [(a, 3)] and scheduled.drafts == [(11, 12)]
    assert sched.num_preemptions == 0 and a.status is SequenceStatus.RUNNING and len(a.page_ids) == 2


def test_drafts_take_free_pages_when_there_are_some():
    sched = make_scheduler(k=4, page_size=4, num_pages=4)  # three usable pages
    a = make_seq(0, 5)
    decoding(sched, a)
    a.draft_token_ids = [11, 12, 13, 14]
    scheduled = sched.schedule()
    assert scheduled.drafts == [(11, 12, 13, 14)] and len(a.page_ids) == 3 and sched.allocator.num_free == 0


def test_drafts_never_take_the_page_another_sequence_needs_for_its_next_token():
    """Speculation never preempts: not directly (above), nor by taking the last free page for
    one sequence's drafts when a later sequence needs that page for its own next token. A's
    token fits its pages, its drafts would need the pool's last page, and B's next token needs
    that page: B must run this step and A's drafts be cut to A's own pages."""
    sched = make_scheduler(k=3, page_size=4, num_pages=6, max_num_batched_tokens=16)  # five usable pages
    a, b = make_seq(0, 6), make_seq(1, 8)
    decoding(sched, a, b)
    assert (a.num_computed_tokens, len(a.page_ids)) == (6, 2)  # a's token goes to position 6: fits
    assert (b.num_computed_tokens, len(b.page_ids)) == (8, 2)  # b's token goes to position 8: a third page
    assert sched.allocator.num_free == 1
    a.draft_token_ids = [11, 12, 13]
    scheduled = sched.schedule()
    assert sched.num_preemptions == 0 and b.status is SequenceStatus.RUNNING, \
        f"a's drafts took the page b needed for its next token, and b was preempted: {scheduled}, " \
        f"drafts {scheduled.drafts}"
    assert scheduled == [(a, 2), (b, 1)] and scheduled.drafts == [(11,), ()]


# ---------------------------------------------------------------------------------------------
# What postprocess makes of a verified row
# ---------------------------------------------------------------------------------------------
def verified_step(num_accepted: int):
    """a (7-token prompt, decoding at position 7, 2 pages of 4) verifies 5 drafts (positions
    8-12: 4 pages during the step) next to b, a plain decode."""
    sched = make_scheduler(k=5, page_size=4, max_num_batched_tokens=16)
    a, b = make_seq(0, 7), make_seq(1, 3)
    decoding(sched, a, b)
    assert (a.num_tokens, a.num_computed_tokens, len(a.page_ids)) == (8, 7, 2)
    a.draft_token_ids = [100, 101, 102, 103, 104]
    scheduled = sched.schedule()
    assert scheduled == [(a, 6), (b, 1)] and len(a.page_ids) == 4 and a.num_computed_tokens == 13
    tokens, accepted = device_tokens(scheduled, {0: num_accepted}, {0: 200, 1: 300})
    free_before = sched.allocator.num_free
    update = sched.postprocess(scheduled, tokens, None, accepted)
    return sched, a, b, update, free_before


def test_postprocess_appends_the_accepted_drafts_and_the_targets_token_and_rolls_back():
    for accepted in range(6):
        sched, a, b, update, free_before = verified_step(accepted)
        assert a.output_token_ids == [7] + [100, 101, 102, 103, 104][:accepted] + [200], accepted
        assert b.output_token_ids == [7, 300]
        # The cache holds a's last token and the accepted drafts; the target's token is next.
        assert a.num_tokens == 8 + accepted + 1 and a.num_computed_tokens == 7 + 1 + accepted
        keep = -(-a.num_tokens // 4)
        assert len(a.page_ids) == keep and sched.allocator.num_free == free_before + 4 - keep
        assert a.pages_trimmed_to == (keep if keep < 4 else None), accepted
        assert (sched.num_spec_rows, sched.num_draft_tokens, sched.num_accepted_tokens) == (1, 5, accepted)
        assert [(s.seq_id, d, n) for s, d, n in update.verified] == [(0, 5, accepted)]
        # Rounds of one token per sequence: a's first, b's, then a's others, at their positions.
        assert [(position, s.seq_id) for position, s in update.advanced] == \
            [(0, 0), (6, 1)] + [(i, 0) for i in range(1, accepted + 1)]
        # Decoding again from the target's token.
        assert a.is_decoding and sched.schedule().starts[0] == 8 + accepted


def test_trimmed_pages_go_back_to_the_pool():
    sched, a, b, update, free_before = verified_step(0)
    assert len(a.page_ids) == 3 and a.pages_trimmed_to == 3
    used = Counter(p for s in (a, b) for p in s.page_ids)
    assert sched.allocator.num_used == len(used) == sum(used.values())
    assert all(sched.allocator.ref_count(p) == 1 for p in used)
    for seq in (a, b):
        sched.finish(seq, "abort")
    assert sched.allocator.num_free == sched.allocator.num_usable


def test_a_stop_inside_an_accepted_run_ends_the_sequence_there():
    sched = make_scheduler(k=4, page_size=4, max_num_batched_tokens=16)
    a, b = make_seq(0, 5), make_seq(1, 5)
    decoding(sched, a, b)
    a.draft_token_ids, b.draft_token_ids = [100, 101, 102, 103], [50, 51]
    scheduled = sched.schedule()
    assert scheduled.drafts == [(100, 101, 102, 103), (50, 51)]
    tokens, accepted = device_tokens(scheduled, {0: 4, 1: 2}, {0: 200, 1: 60})
    calls = []

    def stop_on_101(seqs, new):
        calls.append([(s.seq_id, t) for s, t in zip(seqs, new)])
        assert [s.output_token_ids[-1] for s in seqs] == new
        return [("stop", t) if t == 101 else None for t in new]

    update = sched.postprocess(scheduled, tokens, stop_on_101, accepted)
    assert calls == [[(0, 100), (1, 50)], [(0, 101), (1, 51)], [(1, 60)]], "nothing of a's after its stop"
    assert a.output_token_ids == [7, 100, 101] and (a.finish_reason, a.stop_reason) == ("stop", 101)
    assert a.page_ids == [] and a.slot is None and update.finished == [a]
    assert b.output_token_ids == [7, 50, 51, 60] and b.status is SequenceStatus.RUNNING
    assert [(s.seq_id, d, n) for s, d, n in update.verified] == [(0, 4, 4), (1, 2, 2)]
    assert sched.allocator.num_used == len(b.page_ids) == -(-b.num_computed_tokens // 4), "a's pages all returned"


def test_a_verified_row_of_an_aborted_sequence_is_discarded():
    sched = make_scheduler(k=3)
    a = make_seq(0, 5)
    decoding(sched, a)
    a.draft_token_ids = [11, 12, 13]
    scheduled = sched.schedule()
    sched.finish(a, "abort")
    tokens, accepted = device_tokens(scheduled, {0: 3}, {})
    update = sched.postprocess(scheduled, tokens, None, accepted)
    assert update.advanced == [] and update.verified == [] and a.output_token_ids == [7]
    assert sched.num_discarded_tokens == 1 and sched.allocator.num_free == sched.allocator.num_usable


def test_the_request_level_policy_keeps_its_reservation_after_a_rejection():
    """The request-level policy reserves pages for a sequence's whole length at admission and
    never allocates again: a rejected run must not give those pages back, or later steps
    compute tokens past the sequence's pages."""
    sched = make_scheduler(k=3, scheduling="request", page_size=4)
    a = make_seq(0, 6, max_tokens=20)
    decoding(sched, a)
    reserved = -(-26 // 4)
    assert len(a.page_ids) == reserved
    while not a.is_finished:
        a.draft_token_ids = [11, 12, 13]
        scheduled = sched.schedule()
        tokens, accepted = device_tokens(scheduled, {0: 0}, {})
        assert len(a.page_ids) * 4 >= a.num_computed_tokens, \
            f"step computes up to position {a.num_computed_tokens - 1} with {len(a.page_ids)} pages of 4"
        sched.postprocess(scheduled, tokens, None, accepted)
        if not a.is_finished:
            assert len(a.page_ids) == reserved, "the request-level reservation was given back after a rejection"
    assert sched.allocator.num_free == sched.allocator.num_usable


# ---------------------------------------------------------------------------------------------
# Property test: random schedules with random drafts and acceptances
# ---------------------------------------------------------------------------------------------
STOP_TOKEN = 2
VOCAB = (1, 2, 3, 4, 5, 6, 7, 8, 9)


def stop_on_two(seqs, tokens):
    assert [s.output_token_ids[-1] for s in seqs] == tokens
    return [("stop", t) if t == STOP_TOKEN else None for t in tokens]


@dataclasses.dataclass
class Req:
    arrival: int
    prompt: tuple[int, ...]
    max_tokens: int
    abort_at: int | None


@st.composite
def spec_workloads(draw, scheduling: str):
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(6, 48))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 40))
    reqs = []
    for _ in range(draw(st.integers(1, 10))):
        arrival = draw(st.integers(0, 10))
        abort_at = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(arrival, arrival + 30)))
        prompt_len = draw(st.integers(1, max_model_len - 1))
        # Prompts of a small vocabulary, so that prefixes repeat (prefix caching shares pages).
        prompt = tuple(draw(st.lists(st.sampled_from((1, 3, 4)), min_size=prompt_len, max_size=prompt_len)))
        reqs.append(Req(arrival, prompt, draw(st.integers(1, 20)), abort_at))
    full = max(-(-min(len(r.prompt) + r.max_tokens, max_model_len) // page_size) for r in reqs)
    num_usable = full + draw(st.one_of(st.integers(0, 2), st.integers(0, full * 3)))
    config = dict(page_size=page_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=budget, num_pages=num_usable + 1, scheduling=scheduling,
                  enable_prefix_caching=scheduling == "iteration" and draw(st.booleans()))
    return config, draw(st.integers(1, 6)), reqs


def check_pages(sched: Scheduler, live: list[Sequence], finished: list[Sequence]) -> None:
    alloc, ps = sched.allocator, sched.config.page_size
    holders = Counter(p for s in live for p in s.page_ids)
    assert PADDING_PAGE not in holders
    assert all(len(set(s.page_ids)) == len(s.page_ids) for s in live), "a page twice in one page table"
    assert [alloc.ref_count(p) for p in range(alloc.num_pages)] == [holders[p] for p in range(alloc.num_pages)], \
        "reference counts differ from the page tables"
    assert alloc.num_used == len(holders), "pages in use differ from the pages sequences hold"
    assert all(s.page_ids == [] for s in finished)
    for seq in sched.running:
        assert len(seq.page_ids) * ps >= seq.num_computed_tokens, \
            f"seq {seq.seq_id}: {seq.num_computed_tokens} tokens computed, {len(seq.page_ids)} pages of {ps}"
        if sched.config.scheduling == "request":
            assert len(seq.page_ids) == alloc.pages_needed(sched.max_len(seq)), \
                f"seq {seq.seq_id}: the request-level reservation changed"
        else:
            assert len(seq.page_ids) <= alloc.pages_needed(seq.num_tokens), \
                f"seq {seq.seq_id} holds pages past its tokens (rejected drafts' pages not returned)"


def simulate(config_kw: dict, k: int, reqs: list[Req], data) -> None:
    sched = make_scheduler(k=k, **config_kw)
    ps = sched.config.page_size
    kv: dict[tuple[int, int], int] = {}  # (page, offset) -> the token whose K/V it holds
    seqs: dict[int, Sequence] = {}  # request index -> its sequence, once it arrived
    finished: list[Sequence] = []
    step = 0
    while step <= max(r.arrival for r in reqs) or sched.has_unfinished():
        assert step < 2000, "no progress"
        for i, r in enumerate(reqs):
            if r.arrival == step:
                seq = Sequence(i, f"r{i}", 0, list(r.prompt), SamplingParams(max_tokens=r.max_tokens, temperature=0),
                               seed=i)
                seqs[i] = seq
                sched.add(seq)
            if r.abort_at == step and i in seqs and not seqs[i].is_finished:
                sched.finish(seqs[i], "abort")
                finished.append(seqs[i])
        # Proposals: any length (the scheduler cuts them), only for decoding sequences; the
        # engine's Speculation.propose clears every running sequence's old ones first.
        proposals = {}
        for seq in sched.running:
            seq.draft_token_ids = []
            if seq.num_uncomputed_tokens == 1 and data.draw(st.booleans()):
                seq.draft_token_ids = data.draw(st.lists(st.sampled_from(VOCAB), min_size=1, max_size=k))
                proposals[id(seq)] = list(seq.draft_token_ids)
        running_before = list(sched.running)
        preemptions_before = {id(seq): seq.num_preemptions for seq in running_before}
        decoding_before = [s for s in running_before if s.is_decoding]
        scheduled = sched.schedule()

        # The schedule.
        config = sched.config
        assert scheduled.num_tokens <= config.max_num_batched_tokens
        # A sequence preempted for another's own token needs no budget this step; each one
        # still running does.
        still_running = [s for s in running_before if s.status is SequenceStatus.RUNNING]
        assert scheduled.num_draft_tokens <= config.max_num_batched_tokens - len(still_running), \
            "drafts took budget a running sequence's next token needed"
        in_step = {id(s) for s in scheduled.seqs}
        for seq in decoding_before:
            assert id(seq) in in_step or seq.status is not SequenceStatus.RUNNING, \
                "a decoding sequence lost its token to drafts"
        for seq, n, start, samples, drafts in zip(scheduled.seqs, scheduled.num_new, scheduled.starts,
                                                  scheduled.samples, scheduled.drafts):
            if drafts:
                assert samples and list(drafts) == proposals[id(seq)][:len(drafts)] and len(drafts) <= k
                assert seq.num_tokens + len(drafts) + 1 <= sched.max_len(seq), "drafts past the length limit"
                assert n == 1 + len(drafts) and start == seq.num_tokens - 1
            assert seq.num_computed_tokens == start + n
            assert len(seq.page_ids) * ps >= start + n, "pages do not cover the step"
            if preemptions_before.get(id(seq)) == seq.num_preemptions:
                assert seq.draft_token_ids == [], "a proposal is used up, cut or not"
            # The fake device writes the step's K/V: known tokens, then the drafts.
            written = seq.tokens(start, start + n - len(drafts)) + list(drafts)
            for p, token in zip(range(start, start + n), written):
                kv[seq.page_ids[p // ps], p % ps] = token

        # The device's answer and postprocess.
        accepted = {s.seq_id: data.draw(st.integers(0, len(d))) for s, d in zip(scheduled.seqs, scheduled.drafts) if d}
        targets = {s.seq_id: data.draw(st.sampled_from(VOCAB)) for s in scheduled.seqs}
        tokens, num_accepted = device_tokens(scheduled, accepted, targets)
        outputs_before = {id(s): len(s.output_token_ids) for s in scheduled.seqs}
        counters = (sched.num_draft_tokens, sched.num_accepted_tokens)
        update = sched.postprocess(scheduled, tokens, stop_on_two, num_accepted)
        finished += update.finished
        verified_rows = [(s, d) for s, d in zip(scheduled.seqs, scheduled.drafts) if d]
        assert (sched.num_draft_tokens - counters[0], sched.num_accepted_tokens - counters[1]) == \
            (sum(len(d) for _, d in verified_rows), sum(accepted[s.seq_id] for s, _ in verified_rows))
        for seq, drafts, samples in zip(scheduled.seqs, scheduled.drafts, scheduled.samples):
            if not samples:
                continue
            emitted = list(drafts[:accepted.get(seq.seq_id, 0)]) + [targets[seq.seq_id]]
            new = seq.output_token_ids[outputs_before[id(seq)]:]
            # Up to the first stop token or the length limit, nothing after.
            cut = next((i + 1 for i, t in enumerate(emitted) if t == STOP_TOKEN), len(emitted))
            assert new == emitted[:len(new)] and 1 <= len(new) <= cut
            if len(new) < cut:
                assert seq.finish_reason == "length" and seq.num_tokens == sched.max_len(seq)
            elif new[-1] == STOP_TOKEN:
                assert (seq.finish_reason, seq.stop_reason) == ("stop", STOP_TOKEN)
        live = list(sched.running) + list(sched.waiting)
        check_pages(sched, live, finished)
        for seq in sched.running:  # every position counted as computed holds its token's K/V
            for p in range(seq.num_computed_tokens):
                assert kv.get((seq.page_ids[p // ps], p % ps)) == seq.token_at(p), \
                    f"seq {seq.seq_id}: position {p} of its cache holds another token's K/V"
        assert sched.slots.num_free == config.max_num_seqs - len(sched.running)
        step += 1
    assert sched.allocator.num_free == sched.allocator.num_usable and sched.allocator.num_used == 0
    assert sched.slots.num_free == sched.config.max_num_seqs
    assert all(s.is_finished for s in seqs.values())


PROPERTY_SETTINGS = settings(max_examples=150, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@PROPERTY_SETTINGS
@given(workload=spec_workloads("iteration"), data=st.data())
def test_random_speculative_schedules_keep_pages_and_cache_consistent(workload, data):
    simulate(*workload, data)


@PROPERTY_SETTINGS
@given(workload=spec_workloads("request"), data=st.data())
def test_random_speculative_schedules_under_the_request_level_policy(workload, data):
    simulate(*workload, data)
