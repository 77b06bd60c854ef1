"""What every scheduling policy shares: the queues, admission, preemption, prefix caching, the
in-flight rule and postprocess (`SchedulerBase`). The policies themselves, and the contract of a
step's batch, are in `orca_jax.core.scheduler.scheduler`.

Prefix caching (`EngineConfig.enable_prefix_caching`, iteration-level only): admission looks up
the longest run of a sequence's full pages already in the cache (`PageAllocator.lookup`, by
the content hashes of `orca_jax.core.prefix_cache`), holds those pages and schedules only the
rest. Every full page is published as soon as its tokens are scheduled, so the next sequence
admitted, even in the same step, finds it: within a step every layer writes the step's K/V
before its attention reads any, and later steps run after it on the device. A step that
fails takes its publications back (`forget_published`).

Tokens are counted when they are scheduled (as vLLM V1 does): `num_computed_tokens` rises in
`schedule()`, and a row that samples adds one to the sequence's `num_pending` until
`postprocess` appends the token. So a sequence can be scheduled again while its last token is
still on the device (overlapped steps, `orca_jax.engine.engine`); with one step at a time nothing is
pending between steps. Each running sequence holds a slot, its row of the persistent batch
state on the device (`orca_jax.worker.batch_state`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from orca_jax.config import EngineConfig
from orca_jax.core.kv_cache import PageAllocator
from orca_jax.core.prefix_cache import extend_page_hashes
from orca_jax.core.scheduler.scheduled_batch import ScheduledBatch, SlotAllocator
from orca_jax.core.sequence import Sequence, SequenceStatus


class SchedulerBase:
    """The scheduler's state and the parts every policy builds a step from: the queues and
    slots, admission (first come, first served, with the prefix cache), page reservation and
    preemption, the in-flight rule, and the one postprocess. `Scheduler` adds the policy."""

    def __init__(self, config: EngineConfig, allocator: PageAllocator):
        self.config = config
        self.allocator = allocator
        self.slots = SlotAllocator(config.max_num_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self.num_discarded_tokens = 0  # sampled for a sequence that had finished meanwhile
        self.num_schedules = 0
        self.static_batch_size = 0  # members admitted to the running static batch (request-level)
        # Speculative decoding counters (vLLM's spec_decode metrics): rows that verified
        # drafts, draft tokens verified, and those accepted.
        self.num_spec_rows = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Running sequences under a grammar: while any runs, the engine completes each step
        # before it dispatches the next (a mask needs the token before it).
        self.num_needing_host_tokens = 0  # running sequences whose mask reads their tokens
        # Prefix cache lookups at admission, in tokens (vLLM's queries / hits counters).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Requests (not sequences) with a sequence running / waiting, for O(1) stats.
        self._running_requests: Counter[str] = Counter()
        self._waiting_requests: Counter[str] = Counter()

    # ---- queue changes ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._waiting_requests[seq.request_id] += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) and return its pages and slot. A token it
        still has in flight is discarded when it arrives."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._leave_running(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            _decrement(self._waiting_requests, seq.request_id)
        self._release_pages(seq)
        seq.num_published_pages = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release_pages(self, seq: Sequence) -> None:
        """Give up a sequence's pages. Under Orca's rule (pipeline parallelism) a batch in flight
        that holds the sequence may still write them, so they return to the pool when it does."""
        if self.excludes_in_flight and seq.num_in_flight:
            seq.pages_in_flight.extend(seq.page_ids)
        else:
            self.allocator.free(seq.page_ids)
        seq.page_ids = []

    @property
    def excludes_in_flight(self) -> bool:
        """Orca's rule (Algorithm 1): with several batches in flight, one per pipeline stage, a
        sequence in one of them is neither scheduled again nor stripped of its pages until that
        batch returns. One stage keeps today's overlapped steps instead, where a decoding
        sequence's next step is dispatched while its token is still on the device."""
        return self.config.pipeline_parallel_size > 1

    def batch_returned(self, scheduled: ScheduledBatch) -> None:
        """A dispatched batch left the device (postprocessed, failed or dropped) or was never
        dispatched: its sequences are free to be scheduled again, and pages they gave up while
        it was in flight go back to the pool. Idempotent."""
        if not scheduled.in_flight:
            return
        scheduled.in_flight = False
        for seq in scheduled.seqs:
            seq.num_in_flight -= 1
            if not seq.num_in_flight and seq.pages_in_flight:
                self.allocator.free(seq.pages_in_flight)
                seq.pages_in_flight = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running_requests(self) -> int:
        return len(self._running_requests)

    @property
    def num_waiting_requests(self) -> int:
        return len(self._waiting_requests)

    # ---- what the policies build a step from --------------------------------------------------
    def schedulable_running(self) -> list[Sequence]:
        """Running sequences with work, decodes first, then those still in (chunked) prefill.
        A sequence whose pending token already takes it to its length limit is left out: that
        token ends it, so another would be wasted."""
        decoding, prefilling = [], []
        for seq in self.running:
            uncomputed = seq.num_uncomputed_tokens
            if uncomputed == 0 or seq.num_tokens + seq.num_pending >= self.max_len(seq):
                continue
            if self.excludes_in_flight and seq.num_in_flight:
                continue  # Orca's rule: its batch has not returned
            (decoding if uncomputed == 1 else prefilling).append(seq)
        return decoding + prefilling

    def grant_with_drafts(self, scheduled: ScheduledBatch, granted_rows: list[tuple[Sequence, int]], budget: int,
                           *, grow: bool) -> int:
        """Add the rows whose own tokens are granted, each with the drafts the budget left after
        all of them allows (in row order); returns the budget left."""
        for seq, granted in granted_rows:
            drafts = self._drafts_to_verify(seq, budget, grow=grow)
            self.grant(scheduled, seq, granted, drafts)
            budget -= len(drafts)
        return budget

    def _drafts_to_verify(self, seq: Sequence, budget: int, *, grow: bool) -> tuple[int, ...]:
        """The proposed draft tokens of a decoding sequence this step verifies: as many as the
        budget, its length limit and its pages allow. Pages for them are taken only if free
        (`grow`; the request-level policy reserved them at admission): speculation never
        preempts. The proposal is used up either way."""
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        if not drafts or seq.num_uncomputed_tokens != 1 or seq.num_pending:
            return ()
        # Each accepted draft is an output token: none past the length limit.
        n = max(0, min(len(drafts), budget, self.max_len(seq) - seq.num_tokens - 1))
        if grow:
            room = (len(seq.page_ids) + self.allocator.num_free) * self.allocator.page_size
            n = max(0, min(n, room - seq.num_computed_tokens - 1))
            self.allocator.grow_to(seq.page_ids, seq.num_computed_tokens + 1 + n)
        return tuple(drafts[:n])

    def grant(self, scheduled: ScheduledBatch, seq: Sequence, n: int, drafts: tuple[int, ...] = ()) -> None:
        """The one place a row is added: its tokens (and drafts) count as computed from now on."""
        start = seq.num_computed_tokens
        seq.num_computed_tokens = start + n + len(drafts)
        samples = start + n == seq.num_tokens + seq.num_pending
        seq.num_pending += samples
        seq.step_mark = self.num_schedules
        scheduled.add(seq, n + len(drafts), start, samples, drafts)
        if self.config.enable_prefix_caching:
            self._publish_full_pages(seq, scheduled)

    def unschedule(self, scheduled: ScheduledBatch) -> None:
        """Take back what `schedule()` counted, when the step could not be dispatched: admitted
        sequences stay admitted with their pages, but no cached count has advanced, and the
        pages the step was to fill are no longer published."""
        self.forget_published(scheduled)
        self.batch_returned(scheduled)
        for seq, start, samples in zip(scheduled.seqs, scheduled.starts, scheduled.samples):
            seq.num_computed_tokens = start
            seq.num_pending -= samples
            seq.num_published_pages = min(seq.num_published_pages, start // self.allocator.page_size)

    def admit_waiting(self, scheduled: ScheduledBatch, budget: int) -> None:
        """FCFS admission: the head of the queue goes first, and nothing overtakes it, except
        past a sequence whose grammar is still compiling (it waits, not the queue). A
        preempted sequence whose token is still in flight waits for it (its recompute needs
        every token). With prefix caching a sequence starts after its cached prefix; the pages
        of the cached prefixes one step takes are bounded (`cached_pages_per_step`), and a
        sequence that would pass the bound waits for the next step, unless it is the step's
        first, which then takes the bound's worth."""
        cached_pages_left = self.config.cached_pages_per_step
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.next_admissible()
            if seq is None or seq.num_pending or (self.excludes_in_flight and seq.num_in_flight):
                break
            cached = self._cached_prefix(seq)
            if len(cached) > cached_pages_left:
                if cached_pages_left < self.config.cached_pages_per_step:
                    break
                cached = cached[:cached_pages_left]
            self._hold_cached_prefix(seq, cached)
            chunk = min(seq.num_uncomputed_tokens, budget)
            if not self.allocator.grow_to(seq.page_ids, seq.num_computed_tokens + chunk):
                self._drop_pages(seq)
                break
            cached_pages_left -= len(cached)
            self._count_lookup(seq)
            self.move_to_running(seq)
            self.grant(scheduled, seq, chunk)
            budget -= chunk

    def next_admissible(self) -> Sequence | None:
        """The first waiting sequence that can run: one whose grammar is still compiling
        keeps its place but lets the others pass."""
        for seq in self.waiting:
            if not seq.awaiting_grammar:
                return seq
        return None

    # ---- prefix caching ----------------------------------------------------------------------
    def _looks_up(self, seq: Sequence) -> bool:
        """Whether admission looks a sequence's prefix up. Not with penalties: they count the
        tokens a step feeds (orca_jax.worker.batch_state), and a cached prefix is not fed. Nor
        with prompt_logprobs: they are computed from the prompt's logits, which a cached page
        does not keep, so the whole prompt is computed."""
        return (bool(self.config.cached_pages_per_step) and not seq.params.uses_penalties
                and seq.params.prompt_logprobs is None)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The published pages of the longest cached prefix of a waiting sequence's tokens, in
        whole pages, short of its last token (its logits must be computed to sample the next)."""
        if not self._looks_up(seq):
            return []
        ps = self.allocator.page_size
        extend_page_hashes(seq.page_hashes, seq.tokens, seq.num_tokens, ps, seq.cache_salt)
        return self.allocator.lookup(seq.page_hashes[:(seq.num_tokens - 1) // ps])

    def _hold_cached_prefix(self, seq: Sequence, pages: list[int]) -> None:
        self.allocator.hold(pages)
        seq.page_ids = list(pages)
        seq.num_computed_tokens = len(pages) * self.allocator.page_size
        seq.num_published_pages = len(pages)

    def _count_lookup(self, seq: Sequence) -> None:
        """Counters of an admission: the tokens looked up and those found (vLLM counts every
        lookup, a readmission after preemption too)."""
        if self._looks_up(seq):
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_computed_tokens

    def _publish_full_pages(self, seq: Sequence, scheduled: ScheduledBatch) -> None:
        """Publish the sequence's pages that are full of known tokens scheduled by now. A pending
        token's page waits for the step after its token arrives (the hash needs its id)."""
        ps = self.allocator.page_size
        full = min(seq.num_computed_tokens, seq.num_tokens) // ps
        if full <= seq.num_published_pages:
            return
        extend_page_hashes(seq.page_hashes, seq.tokens, full * ps, ps, seq.cache_salt)
        for index in range(seq.num_published_pages, full):
            page, page_hash = seq.page_ids[index], seq.page_hashes[index]
            if self.allocator.publish(page, page_hash):
                scheduled.published.append((page, page_hash))
        seq.num_published_pages = full

    def forget_published(self, scheduled: ScheduledBatch) -> None:
        """Unpublish the pages a step was to fill, when it failed (idempotent). Only the step's
        own sequences can hold them, unless a later step built on it, and then the engine
        resets the whole cache (`reset_prefix_cache`)."""
        for page, page_hash in scheduled.published:
            self.allocator.unpublish(page, page_hash)
        scheduled.published = []

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (vLLM's reset_prefix_cache: after a weight reload, or when
        the KV cache itself was lost). Returns the number of pages that were published."""
        return self.allocator.reset_prefix_cache()

    def _drop_pages(self, seq: Sequence) -> None:
        self._release_pages(seq)
        seq.num_computed_tokens = 0
        seq.num_published_pages = 0

    def reserve_or_preempt(self, seq: Sequence, desired: int) -> int:
        """Pages for up to `desired` new tokens of a running sequence, preempting the most
        recently admitted sequences not already in this step while none are free. Returns the
        tokens granted; 0 when `seq` itself had to be preempted."""
        page_size = self.allocator.page_size
        if seq.num_computed_tokens + desired <= len(seq.page_ids) * page_size:
            return desired  # its pages already cover the step (most decodes)
        while True:
            room = (len(seq.page_ids) + self.allocator.num_free) * page_size
            granted = min(desired, room - seq.num_computed_tokens)
            if granted >= 1:
                self.allocator.grow_to(seq.page_ids, seq.num_computed_tokens + granted)
                return granted
            # `seq` itself is not in the step yet, so a victim always exists.
            victim = next(s for s in reversed(self.running) if s.step_mark != self.num_schedules)
            if self.excludes_in_flight and victim.num_in_flight:
                # Orca's rule: a batch in flight is writing the victim's pages. `seq` waits for
                # it rather than preempting an older sequence or itself (the two would otherwise
                # take turns preempting each other and neither finish).
                return 0
            self.preempt(victim)
            if victim is seq:
                return 0

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the cache, keep the tokens, requeue at the front. A token
        still in flight stays pending and is appended when it arrives."""
        self.running.remove(seq)
        self._leave_running(seq)
        self._drop_pages(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._waiting_requests[seq.request_id] += 1

    def move_to_running(self, seq: Sequence) -> None:
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:  # it passed sequences whose grammars are compiling
            self.waiting.remove(seq)
        _decrement(self._waiting_requests, seq.request_id)
        seq.status = SequenceStatus.RUNNING
        if seq.num_cached_tokens is None:  # its first admission: the prompt tokens found cached
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        seq.slot = self.slots.acquire()
        seq.slot_joined = True
        self.running.append(seq)
        self._running_requests[seq.request_id] += 1
        self.num_needing_host_tokens += seq.needs_host_tokens

    def _leave_running(self, seq: Sequence) -> None:
        self.slots.release(seq.slot)
        seq.slot = None
        self.num_needing_host_tokens -= seq.needs_host_tokens
        _decrement(self._running_requests, seq.request_id)

    def max_len(self, seq: Sequence) -> int:
        """The most tokens a sequence can ever hold in the cache."""
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.config.max_model_len)

    # ---- after the step ------------------------------------------------------------------------
    def postprocess(self, scheduled: ScheduledBatch, sampled, stop_rule: StopRule | None = None,
                    num_accepted=None) -> StepUpdate:
        """The one postprocess of a step: append the sampled tokens to every sequence whose row
        sampled, then retire those that stop: `stop_rule(seqs, tokens)` first (EOS, stop tokens
        and strings: the engine's), then the length limit (`max_len`). A token of a sequence
        that finished after the step was dispatched (aborted, or stopped by the step before) is
        discarded.

        `sampled` holds one token per output position (`ScheduledBatch.output_offsets`: row i
        at position i when no row verifies drafts). A row that verified drafts brings its
        `num_accepted[i]` accepted drafts and then the target's own token; they are appended
        one at a time, in rounds of one token per sequence, so a stop inside an accepted run
        ends the sequence there and nothing after it is emitted. Its cached count then drops
        back to what the accepted tokens cover, and pages past that return to the pool."""
        self.batch_returned(scheduled)
        tokens = sampled.tolist() if hasattr(sampled, "tolist") else list(sampled)
        accepted = [0] * len(scheduled) if num_accepted is None else [int(a) for a in num_accepted[:len(scheduled)]]
        offsets = scheduled.output_offsets()
        runs = []  # (row, seq, output positions of its new tokens)
        for row, (seq, samples) in enumerate(zip(scheduled.seqs, scheduled.samples)):
            if not samples:
                continue  # a prefill chunk short of the prompt's end: no token yet
            seq.num_pending -= 1
            if seq.is_finished:
                self.num_discarded_tokens += 1
                continue
            runs.append((row, seq, range(offsets[row], offsets[row] + accepted[row] + 1)))
        update = StepUpdate()
        for round_ in range(max((len(positions) for *_, positions in runs), default=0)):
            self._append_round(runs, round_, tokens, stop_rule, update)
        for row, seq, positions in runs:
            if scheduled.drafts[row]:
                self._settle_verified(seq, scheduled.starts[row], len(scheduled.drafts[row]), len(positions) - 1,
                                      update)
        return update

    def _append_round(self, runs, round_: int, tokens: list[int], stop_rule: StopRule | None,
                      update: StepUpdate) -> None:
        """Append the `round_`-th new token of every sequence that has one and is still running,
        then apply the stop rules to those tokens."""
        seqs, new = [], []
        for _, seq, positions in runs:
            if round_ < len(positions) and not seq.is_finished:
                position = positions[round_]
                seq.output_token_ids.append(tokens[position])
                update.advanced.append((position, seq))
                seqs.append(seq)
                new.append(tokens[position])
        stops = stop_rule(seqs, new) if stop_rule is not None and seqs else [None] * len(seqs)
        for seq, stop in zip(seqs, stops):
            if stop is None and seq.num_tokens >= self.max_len(seq):  # max_tokens or max_model_len
                stop = ("length", None)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = stop
                self.finish(seq, stop[0])
                update.finished.append(seq)

    def _settle_verified(self, seq: Sequence, start: int, drafted: int, accepted: int, update: StepUpdate) -> None:
        """After a row verified `drafted` tokens and accepted `accepted`: count them, and if the
        sequence runs on, its cache holds the last token and the accepted drafts only. The
        rejected positions' K/V are overwritten later; pages past the kept tokens are freed now
        (the device's page table is rewritten from there on: `Sequence.pages_trimmed_to`)."""
        self.num_spec_rows += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        update.verified.append((seq, drafted, accepted))
        if seq.is_finished:
            return
        seq.num_computed_tokens = start + 1 + accepted
        keep = self.allocator.pages_needed(seq.num_tokens)
        # The request-level policy keeps what it reserved at admission for the whole length.
        if self.config.scheduling == "iteration" and len(seq.page_ids) > keep:
            self.allocator.free(seq.page_ids[keep:])
            del seq.page_ids[keep:]
            seq.pages_trimmed_to = keep if seq.pages_trimmed_to is None else min(seq.pages_trimmed_to, keep)


def _decrement(counts: Counter, key: str) -> None:
    counts[key] -= 1
    if not counts[key]:
        del counts[key]


# Per sequence that got a token (in step order, the token appended already): (finish reason,
# stop reason) if it stops on it, or None to go on. The reason is "stop" or "length"; the stop
# reason the stop token id or string, else None. One call per step, so the engine can
# detokenize the whole step at once.
StopRule = Callable[[list[Sequence], list[int]], "list[tuple[str, int | str | None] | None]"]


@dataclass
class StepUpdate:
    # (output position, sequence) per appended token, in order: a sequence that accepted drafts
    # appears once per token it got.
    advanced: list[tuple[int, Sequence]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # retired by this step, pages freed
    # (sequence, draft tokens verified, accepted) per row that verified drafts.
    verified: list[tuple[Sequence, int, int]] = field(default_factory=list)
