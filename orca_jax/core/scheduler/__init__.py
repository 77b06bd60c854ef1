"""The scheduler: what runs in each step (scheduler.py and a module per policy) over the shared
queues, admission, preemption and postprocess (base.py)."""

from orca_jax.core.scheduler.base import SchedulerBase, StepUpdate, StopRule
from orca_jax.core.scheduler.scheduled_batch import ScheduledBatch, SlotAllocator
from orca_jax.core.scheduler.scheduler import POLICIES, Scheduler

__all__ = ["POLICIES", "ScheduledBatch", "Scheduler", "SchedulerBase", "SlotAllocator", "StepUpdate", "StopRule"]
