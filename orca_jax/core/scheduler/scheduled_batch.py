"""One step's batch as the scheduler hands it to the step (`ScheduledBatch`), and the rows of
the persistent batch state that running sequences hold (`SlotAllocator`)."""

from __future__ import annotations

from orca_jax.core.sequence import Sequence


class ScheduledBatch:
    """One step's rows, in order, as parallel lists. Iterating gives (sequence, new tokens)
    pairs, and a batch compares equal to a list of such pairs."""

    __slots__ = ("seqs", "num_new", "starts", "samples", "drafts", "pending_counted", "published", "in_flight",
                 "num_padding_tokens")

    def __init__(self):
        self.seqs: list[Sequence] = []
        self.num_new: list[int] = []
        self.starts: list[int] = []  # tokens cached before this step
        self.samples: list[bool] = []  # the row reaches the sequence's end, so it samples a token
        # Speculative decoding: the draft tokens a row verifies after its last known token (the
        # row's last len(drafts) tokens); () for every row without speculation.
        self.drafts: list[tuple[int, ...]] = []
        # schedule() has added each sampling row to its sequence's num_pending; `of` has not.
        self.pending_counted = True
        # (page, hash) published while this step was scheduled: its K/V are this step's to write.
        self.published: list[tuple[int, bytes]] = []
        # Counted in its sequences' num_in_flight until it returns (Scheduler.batch_returned).
        self.in_flight = False
        # Tokens the step computes beyond its rows' own, as FasterTransformer's rectangle would
        # ("request_padded"): prompts padded to the batch's longest, and the slots of members
        # that finished while the batch runs. The token bucket holds them; they write the sink page.
        self.num_padding_tokens = 0

    @classmethod
    def of(cls, pairs) -> ScheduledBatch:
        """A hand-made schedule (tests, kernel cases) from (sequence, new tokens) pairs whose
        cached counts have not been advanced."""
        batch = cls()
        batch.pending_counted = False
        for seq, n in pairs:
            start = seq.num_computed_tokens
            batch.add(seq, n, start, start + n == seq.num_tokens + seq.num_pending)
        return batch

    def add(self, seq: Sequence, n: int, start: int, samples: bool, drafts: tuple[int, ...] = ()) -> None:
        self.seqs.append(seq)
        self.num_new.append(n)
        self.starts.append(start)
        self.samples.append(samples)
        self.drafts.append(drafts)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(d) for d in self.drafts)

    def output_offsets(self) -> list[int]:
        """Where each row's positions start in the step's outputs: a row has one sampled
        position, plus one per draft token it verifies (the step program lays them out so)."""
        offsets, at = [], 0
        for drafts in self.drafts:
            offsets.append(at)
            at += 1 + len(drafts)
        return offsets

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def __iter__(self):
        return zip(self.seqs, self.num_new)

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, row: int) -> tuple[Sequence, int]:
        return self.seqs[row], self.num_new[row]

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"ScheduledBatch({[(s.seq_id, n) for s, n in self]})"


class SlotAllocator:
    """Rows of the persistent batch state: one per running sequence, `max_num_seqs` of them.
    Row `max_num_seqs` is the padding sink and never handed out (as page 0 is)."""

    def __init__(self, max_num_seqs: int):
        self.sink = max_num_seqs
        self._free = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out slot 0 first
        self._in_use = [False] * max_num_seqs

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:  # the scheduler admits at most max_num_seqs, so this is a bug
            raise RuntimeError("no free batch slot: more running sequences than max_num_seqs")
        slot = self._free.pop()
        self._in_use[slot] = True
        return slot

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.sink or not self._in_use[slot]:
            raise ValueError(f"slot {slot} is not in use (released twice, or out of range)")
        self._in_use[slot] = False
        self._free.append(slot)
