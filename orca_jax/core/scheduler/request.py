"""The "request" policy: Orca's baseline (FasterTransformer-style static batching). A batch is
admitted only when none is running, with pages for each member's whole length reserved up front,
and runs until every member has finished; later arrivals wait for the next batch. The step itself
is the same as "iteration"'s (selective batching kept: no padding, a finished member costs
nothing), so the two policies differ only here."""

from __future__ import annotations

from collections.abc import Callable

from orca_jax.core.scheduler.base import SchedulerBase
from orca_jax.core.scheduler.scheduled_batch import ScheduledBatch
from orca_jax.core.sequence import Sequence

# Whether a waiting sequence may join the static batch being admitted, given the longest prompt
# admitted so far.
JoinRule = Callable[[SchedulerBase, Sequence, int], bool]


def schedule_request_level(s: SchedulerBase) -> ScheduledBatch:
    if not s.running:
        admit_static_batch(s)
    budget = s.config.max_num_batched_tokens
    scheduled = ScheduledBatch()
    granted_rows = []
    for seq in s.schedulable_running():
        if budget == 0:
            break
        chunk = min(seq.num_uncomputed_tokens, budget)
        granted_rows.append((seq, chunk))
        budget -= chunk
    # Pages were reserved at admission, for the whole length drafts stay within.
    s.grant_with_drafts(scheduled, granted_rows, budget, grow=False)
    return scheduled


def admit_static_batch(s: SchedulerBase, may_join: JoinRule | None = None) -> None:
    """FCFS while slots, pages for each member's whole length and `may_join` allow."""
    longest = 0  # the longest prompt admitted
    while len(s.running) < s.config.max_num_seqs:
        seq = s.next_admissible()
        if seq is None or seq.num_pending or (may_join is not None and not may_join(s, seq, longest)):
            break
        if not s.allocator.grow_to(seq.page_ids, s.max_len(seq)):
            break
        longest = max(longest, seq.num_uncomputed_tokens)
        s.move_to_running(seq)
    s.static_batch_size = len(s.running)
