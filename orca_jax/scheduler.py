"""Iteration-level scheduler (Orca) and the request-level baseline.

`schedule()` is called before every model step and returns that step's batch as a list of
(sequence, number of new tokens). Policies:

- "iteration": every running sequence gets its next token(s) first (decodes, then the rest of
  chunked prefills); the remaining token budget admits waiting requests first come, first
  served. Finished sequences leave after any step and new ones join at the next. When the page
  pool runs dry the most recently admitted sequence is preempted: its pages are freed and it is
  recomputed from scratch later (its generated tokens are kept).
- "request": Orca's baseline (FasterTransformer-style static batching). A batch is admitted
  only when none is running, with pages for each member's whole length reserved up front, and
  runs until every member has finished; later arrivals wait for the next batch. The step itself
  is the same, so the two policies differ only here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from orca_jax.config import EngineConfig
from orca_jax.kv_cache import PageAllocator
from orca_jax.sequence import Sequence, SequenceStatus

ScheduledBatch = list[tuple[Sequence, int]]


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: PageAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    # ---- queue changes ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) and return its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.allocator.free(seq.page_ids)
        seq.page_ids = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the per-step decision ---------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        if self.config.scheduling == "request":
            return self._schedule_request_level()
        return self._schedule_iteration_level()

    def _schedule_iteration_level(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        scheduled: ScheduledBatch = []
        # Decodes first, then running sequences still in (chunked) prefill.
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decoding + prefilling:
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue  # preempted to make room for an earlier sequence
            granted = self._reserve_or_preempt(seq, min(seq.num_uncomputed_tokens, budget), scheduled)
            if granted:
                scheduled.append((seq, granted))
                budget -= granted
        self._admit_waiting(scheduled, budget)
        return scheduled

    def _admit_waiting(self, scheduled: ScheduledBatch, budget: int) -> None:
        """FCFS admission: the head of the queue goes first, and nothing overtakes it."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            chunk = min(seq.num_uncomputed_tokens, budget)
            if not self.allocator.grow_to(seq.page_ids, seq.num_computed_tokens + chunk):
                break
            self._move_to_running(seq)
            scheduled.append((seq, chunk))
            budget -= chunk

    def _reserve_or_preempt(self, seq: Sequence, desired: int, scheduled: ScheduledBatch) -> int:
        """Pages for up to `desired` new tokens of a running sequence, preempting the most
        recently admitted sequences not already in this step while none are free. Returns the
        tokens granted; 0 when `seq` itself had to be preempted."""
        in_step = {id(s) for s, _ in scheduled}
        while True:
            room = (len(seq.page_ids) + self.allocator.num_free) * self.allocator.page_size
            granted = min(desired, room - seq.num_computed_tokens)
            if granted >= 1:
                self.allocator.grow_to(seq.page_ids, seq.num_computed_tokens + granted)
                return granted
            # `seq` itself is not in the step yet, so a victim always exists.
            victim = next(s for s in reversed(self.running) if id(s) not in in_step)
            self.preempt(victim)
            if victim is seq:
                return 0

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the cache, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self.allocator.free(seq.page_ids)
        seq.page_ids = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _schedule_request_level(self) -> ScheduledBatch:
        if not self.running:
            self._admit_static_batch()
        budget = self.config.max_num_batched_tokens
        scheduled: ScheduledBatch = []
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decoding + prefilling:
            if budget == 0:
                break
            chunk = min(seq.num_uncomputed_tokens, budget)
            scheduled.append((seq, chunk))  # pages were reserved at admission
            budget -= chunk
        return scheduled

    def _admit_static_batch(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.allocator.grow_to(seq.page_ids, self.max_len(seq)):
                break
            self._move_to_running(seq)

    def _move_to_running(self, seq: Sequence) -> None:
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def max_len(self, seq: Sequence) -> int:
        """The most tokens a sequence can ever hold in the cache."""
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.config.max_model_len)

    # ---- after the step ------------------------------------------------------------------------
    def postprocess(self, scheduled: ScheduledBatch, sampled, stop_rule: StopRule | None = None) -> StepUpdate:
        """The one postprocess of a step: advance each sequence's cached-token count; append the
        sampled token (row i of `sampled` is scheduled[i]) to every sequence whose scheduled
        tokens reached its end; retire those that stop: `stop_rule(seq, token)` first (EOS,
        stop tokens and strings: the engine's), then the length limit (`max_len`)."""
        update = StepUpdate()
        for row, (seq, n_new) in enumerate(scheduled):
            seq.num_computed_tokens += n_new
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk short of the prompt's end: no token yet
            token = int(sampled[row])
            seq.output_token_ids.append(token)
            update.advanced.append((row, seq))
            stop = stop_rule(seq, token) if stop_rule is not None else None
            if stop is None and seq.num_tokens >= self.max_len(seq):  # max_tokens or max_model_len
                stop = ("length", None)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = stop
                self.finish(seq, stop[0])
                update.finished.append(seq)
        return update


# (finish reason, stop reason) of a sequence that stops on `token`, or None to go on. The
# reason is "stop" or "length"; the stop reason the stop token id or string, else None.
StopRule = Callable[[Sequence, int], "tuple[str, int | str | None] | None"]


@dataclass
class StepUpdate:
    advanced: list[tuple[int, Sequence]] = field(default_factory=list)  # (row, sequence) that got a token
    finished: list[Sequence] = field(default_factory=list)  # retired by this step, pages freed
