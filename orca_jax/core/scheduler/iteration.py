"""The "iteration" policy (Orca's): every running sequence gets its next token(s) first (decodes,
then the rest of chunked prefills), preempting the most recently admitted when the page pool
runs dry; then drafts, from the budget and free pages that leaves, so drafts never displace a
sequence's own token nor cause a preemption; then the remaining budget admits waiting requests,
first come, first served. Finished sequences leave after any step and new ones join at the next."""

from __future__ import annotations

from orca_jax.core.scheduler.base import SchedulerBase
from orca_jax.core.scheduler.scheduled_batch import ScheduledBatch
from orca_jax.core.sequence import SequenceStatus


def schedule_iteration_level(s: SchedulerBase) -> ScheduledBatch:
    budget = s.config.max_num_batched_tokens
    scheduled = ScheduledBatch()
    granted_rows = []
    for seq in s.schedulable_running():
        if seq.status is not SequenceStatus.RUNNING or budget == 0:
            continue  # preempted to make room for an earlier sequence
        granted = s.reserve_or_preempt(seq, min(seq.num_uncomputed_tokens, budget))
        if granted:
            seq.step_mark = s.num_schedules  # in this step: no longer a preemption victim
            granted_rows.append((seq, granted))
            budget -= granted
    budget = s.grant_with_drafts(scheduled, granted_rows, budget, grow=True)
    s.admit_waiting(scheduled, budget)
    return scheduled
