"""Iteration-level scheduler (Orca) and the request-level baselines.

`Scheduler.schedule()` is called before every model step and returns that step's batch
(`ScheduledBatch`: per row the sequence, its new tokens, where they start and whether the row
samples). One module per policy, each a function of the shared state (`SchedulerBase`):

- "iteration" (iteration.py): Orca's. When the page pool runs dry the most recently admitted
  sequence is preempted: its pages are freed and it is recomputed later (its generated tokens
  are kept; with prefix caching its full pages stay cached, so its recompute will likely find
  them).
- "request" (request.py): static batches, selective batching kept.
- "request_padded" (request_padded.py): static batches run as FasterTransformer's rectangle.

A new policy is a module here with `schedule_<name>(s: SchedulerBase) -> ScheduledBatch`, every
row added through `s.grant`, and an entry in `POLICIES` (and `EngineConfig.scheduling`).
"""

from __future__ import annotations

from collections.abc import Callable

from orca_jax.core.scheduler.base import SchedulerBase
from orca_jax.core.scheduler.iteration import schedule_iteration_level
from orca_jax.core.scheduler.request import schedule_request_level
from orca_jax.core.scheduler.request_padded import schedule_padded_batch
from orca_jax.core.scheduler.scheduled_batch import ScheduledBatch

POLICIES: dict[str, Callable[[SchedulerBase], ScheduledBatch]] = {
    "iteration": schedule_iteration_level,
    "request": schedule_request_level,
    "request_padded": schedule_padded_batch,
}


class Scheduler(SchedulerBase):
    def schedule(self) -> ScheduledBatch:
        """This step's batch under the configured policy; its sequences count as in flight
        until the batch returns (`batch_returned`)."""
        self.num_schedules += 1
        scheduled = POLICIES[self.config.scheduling](self)
        scheduled.in_flight = bool(scheduled)  # an empty step is never dispatched
        for seq in scheduled.seqs:
            seq.num_in_flight += 1
        return scheduled
