"""One model iteration, the same for the engine and for `bench simulate`:

    schedule -> build_batch -> runner.execute -> scheduler.postprocess

`run_step` is the whole of it. What runs the batch is a `StepRunner`: the `ModelRunner` (the
compiled model on the device) in the engine, the cost model's stand-in in `bench simulate`, a
wrapper or a fake in tests. The engine takes the runner through `LLMEngine(make_runner=...)`;
everything after the step that is about requests (detokenizing, log-probabilities, outputs)
stays in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from orca_jax.batch import Batch, build_batch
from orca_jax.config import EngineConfig
from orca_jax.sampling import SampleOutput
from orca_jax.scheduler import ScheduledBatch, Scheduler, StepUpdate, StopRule

if TYPE_CHECKING:  # the runner module imports the models; the protocol only names its report
    from orca_jax.runner import WarmupReport


class StepRunner(Protocol):
    """Runs one padded batch; returns host arrays whose row i belongs to the batch's sequence i."""

    def execute(self, batch: Batch) -> SampleOutput: ...


class EngineRunner(StepRunner, Protocol):
    """What LLMEngine needs of its runner besides `execute` (ModelRunner is the one in use)."""

    config: EngineConfig  # the engine settings as the runner fixed them (max_model_len fits the pool)
    num_pages: int  # KV pages the device cache holds
    kv_dtype: Any  # the cache's dtype, for the start-up log
    timings: dict[str, float]  # seconds per start-up phase

    def warmup(self) -> WarmupReport: ...  # build every bucket's program before serving

    @property
    def kv_cache_lost(self) -> bool: ...  # a failed step consumed the donated cache

    def reset_kv_cache(self) -> None: ...


@dataclass(frozen=True)
class StepResult:
    scheduled: ScheduledBatch  # the step's sequences and their new-token counts, row order
    output: SampleOutput  # what the runner returned (rows past len(scheduled) are padding)
    update: StepUpdate  # which sequences got a token, which finished

    @property
    def advanced(self):
        return self.update.advanced

    @property
    def finished(self):
        return self.update.finished


class StepFailed(Exception):
    """The runner raised on a batch; `scheduled` says which sequences were in it. The schedule
    stands (sequences admitted, pages allocated) but nothing was postprocessed: no token
    appended, no cached count advanced."""

    def __init__(self, scheduled: ScheduledBatch, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.scheduled = scheduled
        self.cause = cause


def run_step(scheduler: Scheduler, runner: StepRunner, config: EngineConfig,
             stop_rule: StopRule | None = None) -> StepResult | None:
    """Schedule, run and postprocess one iteration; None when nothing is schedulable."""
    scheduled = scheduler.schedule()
    if not scheduled:
        return None
    try:
        output = runner.execute(build_batch(config, scheduled))
    except Exception as exc:  # noqa: BLE001 - handed to the caller with the step's sequences
        raise StepFailed(scheduled, exc) from exc
    return StepResult(scheduled, output, scheduler.postprocess(scheduled, output.tokens, stop_rule))


def recompute_running(scheduler: Scheduler) -> None:
    """After the KV cache was lost (a failed step consumed the donated buffer): every running
    sequence goes back to waiting, to be recomputed. Newest first, since each preemption
    requeues at the front: arrival order survives."""
    for seq in reversed(list(scheduler.running)):
        scheduler.preempt(seq)
