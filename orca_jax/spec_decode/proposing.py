"""Which running sequences propose drafts before a step, and the backoff of those whose
proposals keep failing.

The engine asks `Speculation.propose` before it schedules each step; the scheduler then
verifies what its token budget and free pages allow (`Scheduler._drafts_to_verify`) and
reports per verified row how many drafts were accepted (`StepUpdate.verified`), which
`Speculation.record` turns into two backoffs: a sequence whose last `backoff_after` proposals
were all rejected outright skips the next `backoff_steps` steps' proposals, twice as many
each further time (up to 64), so text that does not repeat stops paying verification rows;
and when whole steps keep gaining too little, the engine goes back to overlapped steps (async
scheduling) for a while, since proposing costs it the overlap.

A sequence speculates only when the step can judge its drafts by the plain rule: no
penalties (their counts would have to include the drafts before each position) and no
grammar (a mask per draft position would need the matcher advanced through the drafts).
Those sequences decode one token per step, exactly as without speculation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from orca_jax.core.sequence import Sequence, SequenceStatus
from orca_jax.config.speculative import SpeculativeConfig
from orca_jax.spec_decode.ngram import NgramProposer

MAX_BACKOFF_STEPS = 64


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to limits[i] draft tokens continuing each sequence's tokens."""


def can_speculate(seq: Sequence) -> bool:
    return seq.guided is None and seq.token_rules is None and not seq.params.uses_penalties


class Speculation:
    """Proposals before each step, and when to make them.

    A proposal needs the sequence's last token on the host, so a step that speculates runs one
    at a time: it gives up async scheduling's overlap of host and device work (about 7% of a
    decode step on the 2-core CPU, docs/benchmarks.md). `overlap_allowed` (the engine's
    async_scheduling) lets the engine win that back where speculation does not pay: after
    `backoff_after` proposing steps in a row that gained too little (accepted tokens under
    `MIN_GAIN` of the step's sequences), it runs `overlap_steps` overlapped steps without
    proposals (`backoff_steps`, doubling while it keeps not paying, up to 64), then tries again."""

    # A proposing step pays when its accepted drafts are at least this share of its sequences
    # (each accepted draft saves about one sequence-step; the lost overlap costs ~7% per step).
    MIN_GAIN = 0.1

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, overlap_allowed: bool = False):
        self.config = config
        self.proposer = proposer
        self.overlap_allowed = overlap_allowed
        self.overlap_steps_left = 0  # steps still to run overlapped, without proposals
        self._overlap_span = config.backoff_steps
        self._fruitless = 0  # proposing steps in a row that did not pay
        self._asked: int | None = None  # sequences asked for drafts before the step in flight

    @property
    def proposing(self) -> bool:
        """Whether the next step proposes (and so runs one at a time), batch size aside."""
        return self.overlap_steps_left == 0

    def proposes_for(self, num_running: int) -> bool:
        """Whether the next step, with `num_running` sequences running, proposes: not while
        backing off, nor above `disable_by_batch_size` (then steps overlap as without
        speculation)."""
        limit = self.config.disable_by_batch_size
        return self.proposing and (limit is None or num_running <= limit)

    def propose(self, running: list[Sequence], max_len: Callable[[Sequence], int]) -> int:
        """Give each running sequence that decodes next its drafts (`Sequence.draft_token_ids`).
        Returns how many sequences got a proposal."""
        seqs, limits, eligible = [], [], 0
        for seq in running:
            seq.draft_token_ids = []
            if seq.num_uncomputed_tokens != 1 or seq.num_pending or not can_speculate(seq):
                continue
            eligible += 1  # it could speculate: a step where none does, or none gains, did not pay
            if seq.skip_proposals:
                seq.skip_proposals -= 1
                continue
            # Every accepted draft is an output token: none past the length limit.
            limit = min(self.config.num_speculative_tokens, max_len(seq) - seq.num_tokens - 1)
            if limit > 0:
                seqs.append(seq)
                limits.append(limit)
        self._asked = eligible
        if not seqs:
            return 0
        proposals = self.proposer.propose(seqs, limits)
        for seq, drafts in zip(seqs, proposals):
            seq.draft_token_ids = list(drafts)
        return sum(bool(d) for d in proposals)

    def warmup(self):
        """Build the proposer's own step programs, if it has any (a draft model); its report."""
        warmup = getattr(self.proposer, "warmup", None)
        return warmup() if warmup is not None else None

    def release_finished(self) -> None:
        """Let the proposer drop what it keeps for sequences no longer running (a draft model's
        pages and slots)."""
        release = getattr(self.proposer, "release_finished", None)
        if release is not None:
            release()

    def record(self, verified: list[tuple[Sequence, int, int]], num_rows: int) -> None:
        """After a step of `num_rows` rows: each verified row's (sequence, drafts, accepted)
        updates its sequence's backoff, and the step as a whole the engine's overlap backoff."""
        for seq, _, accepted in verified:
            if accepted:
                seq.num_failed_proposals = 0
                continue
            seq.num_failed_proposals += 1
            over = seq.num_failed_proposals - self.config.backoff_after
            if over >= 0:
                seq.skip_proposals = min(MAX_BACKOFF_STEPS, self.config.backoff_steps << min(over, 16))
        asked, self._asked = self._asked, None
        if not self.overlap_allowed:
            return
        if asked is None:  # an overlapped step
            self.overlap_steps_left = max(0, self.overlap_steps_left - 1)
        elif asked:  # a proposing step with sequences that could speculate (not only prefills)
            self._judge(sum(a for *_, a in verified), num_rows)

    def _judge(self, accepted: int, num_rows: int) -> None:
        if accepted >= max(1.0, self.MIN_GAIN * num_rows):
            self._fruitless, self._overlap_span = 0, self.config.backoff_steps
            return
        self._fruitless += 1
        if self._fruitless >= self.config.backoff_after:
            self.overlap_steps_left = self._overlap_span
            self._overlap_span = min(MAX_BACKOFF_STEPS, 2 * self._overlap_span)
            self._fruitless = 0


class NgramSequenceProposer:
    """The n-gram proposer over sequences (orca_jax.spec_decode.ngram looks up one history).
    Each running sequence's tokens are kept in a numpy buffer that grows by the tokens
    appended since the last call: converting the whole list every step cost more than the
    lookup itself (about 80 us per 4,096 tokens)."""

    def __init__(self, config: SpeculativeConfig):
        self.lookup = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        self._histories: dict[int, tuple[Sequence, np.ndarray, int]] = {}  # seq_id -> (seq, buffer, length)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [self.lookup.propose(self._history(seq), limit) for seq, limit in zip(seqs, limits)]

    def _history(self, seq: Sequence) -> np.ndarray:
        _, buffer, length = self._histories.get(seq.seq_id, (seq, np.empty(0, np.int32), 0))
        n = seq.num_tokens
        if n > buffer.shape[0]:  # grow by doubling, so appends cost O(1) amortised
            grown = np.empty(max(2 * buffer.shape[0], n + 64), np.int32)
            grown[:length] = buffer[:length]
            buffer = grown
        buffer[length:n] = seq.tokens(length, n)
        self._histories[seq.seq_id] = (seq, buffer, n)
        return buffer[:n]

    def release_finished(self) -> None:
        for seq_id, (seq, _, _) in list(self._histories.items()):
            if seq.status is not SequenceStatus.RUNNING:
                del self._histories[seq_id]
