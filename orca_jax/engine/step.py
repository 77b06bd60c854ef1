"""One model iteration, the same for the engine and for `bench simulate`, in two halves:

    dispatch_step: schedule -> runner.dispatch (build the inputs, enqueue the program)
    complete_step: wait for the result -> scheduler.postprocess (tokens, stop rules, retiring)

`run_step` is one after the other. The engine's overlapped loop (`orca_jax.engine.engine`) dispatches
step N+1 before it completes step N. What runs the batch is a `StepRunner`: the `ModelRunner`
(the compiled model on the device) in the engine, the cost model's stand-in in `bench
simulate`, a wrapper or a fake in tests. The engine takes the runner through
`LLMEngine(make_runner=...)`; everything after the step that is about requests (detokenizing,
log-probabilities, outputs) stays in the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from orca_jax.config import EngineConfig
from orca_jax.worker.sampling import SampleOutput
from orca_jax.core.scheduler import ScheduledBatch, Scheduler, StepUpdate, StopRule
from orca_jax.engine.step_timing import StepTiming, StepTimeline

if TYPE_CHECKING:  # the runner module imports the models; the protocol only names its report
    from orca_jax.worker.runner_base import WarmupReport


class PendingResult(Protocol):
    def result(self) -> SampleOutput: ...  # host arrays; row i belongs to the step's row i


class StepRunner(Protocol):
    """Runs one scheduled step: `dispatch` returns once the step is under way."""

    def dispatch(self, scheduled: ScheduledBatch) -> PendingResult: ...


class EngineRunner(StepRunner, Protocol):
    """What LLMEngine needs of its runner besides `dispatch` (ModelRunner is the one in use)."""

    config: EngineConfig  # the engine settings as the runner fixed them (max_model_len fits the pool)
    num_pages: int  # KV pages the device cache holds
    kv_dtype: Any  # the cache's dtype, for the start-up log
    timings: dict[str, float]  # seconds per start-up phase

    def warmup(self) -> WarmupReport: ...  # build every bucket's program before serving

    @property
    def kv_cache_lost(self) -> bool: ...  # a failed step consumed the donated cache or state

    def reset_kv_cache(self) -> None: ...


class Ready:
    """A step whose result is already on the host (runners without a device)."""

    def __init__(self, output: SampleOutput):
        self.output = output

    def result(self) -> SampleOutput:
        return self.output


@dataclass(frozen=True)
class InFlightStep:
    scheduled: ScheduledBatch
    pending: PendingResult
    timing: StepTiming | None = None  # while the engine's timeline is enabled


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
    """The runner raised on a step; `scheduled` says which sequences were in it. The schedule
    stands (sequences admitted, pages allocated) but nothing was postprocessed: no token
    appended, and (for a failed dispatch) no cached count advanced. `dispatched`: the step had
    been enqueued, so steps dispatched after it may depend on its broken state."""

    def __init__(self, scheduled: ScheduledBatch, cause: BaseException, dispatched: bool = False):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.scheduled = scheduled
        self.cause = cause
        self.dispatched = dispatched


def dispatch_step(scheduler: Scheduler, runner: StepRunner, timeline: StepTimeline | None = None,
                  step_number: int = 0, mode: str = "sync") -> InFlightStep | None:
    """Schedule the next iteration and start it; None when nothing is schedulable. With an
    enabled `timeline`, the step's host parts are timed into a StepTiming appended to it."""
    started = time.perf_counter()
    scheduled = scheduler.schedule()
    if not scheduled:
        return None
    scheduled_at = time.perf_counter()
    try:
        pending = runner.dispatch(scheduled)
    except Exception as exc:  # noqa: BLE001 - handed to the caller with the step's sequences
        scheduler.unschedule(scheduled)
        raise StepFailed(scheduled, exc) from exc
    timing = None
    if timeline is not None and timeline.enabled:
        timing = _dispatch_timing(scheduled, runner, step_number, mode, started, scheduled_at)
        timeline.records.append(timing)
        timeline.watch(timing, getattr(pending, "output", None))
    return InFlightStep(scheduled, pending, timing)


def _dispatch_timing(scheduled: ScheduledBatch, runner, step_number: int, mode: str, started: float,
                     scheduled_at: float) -> StepTiming:
    dispatched_at = time.perf_counter()
    build_s = getattr(runner, "last_build_s", 0.0)  # the runner times its own input build
    num_tokens = scheduled.num_tokens
    return StepTiming(
        step=step_number, mode=mode, num_seqs=len(scheduled), num_tokens=num_tokens,
        bucket=getattr(runner, "last_bucket", num_tokens),
        has_prefill=num_tokens != len(scheduled), schedule_s=scheduled_at - started, build_s=build_s,
        dispatch_s=dispatched_at - scheduled_at - build_s, dispatched_at=dispatched_at,
        h2d_bytes=getattr(runner, "last_h2d_bytes", 0), h2d_arrays=getattr(runner, "last_h2d_arrays", 0),
    )


def complete_step(scheduler: Scheduler, step: InFlightStep, stop_rule: StopRule | None = None) -> StepResult:
    """Wait for a dispatched step and postprocess it."""
    started = time.perf_counter()
    try:
        output = step.pending.result()
    except Exception as exc:  # noqa: BLE001 - handed to the caller with the step's sequences
        raise StepFailed(step.scheduled, exc, dispatched=True) from exc
    received = time.perf_counter()
    update = scheduler.postprocess(step.scheduled, output.tokens, stop_rule, output.num_accepted)
    if step.timing is not None:
        step.timing.wait_s = received - started
        step.timing.postprocess_s = time.perf_counter() - received  # the engine moves detokenizing out
        step.timing.d2h_bytes = sum(getattr(a, "nbytes", 0) for a in (output.tokens, output.logprobs,
                                                                        output.top_ids, output.top_logprobs))
    return StepResult(step.scheduled, output, update)


def run_step(scheduler: Scheduler, runner: StepRunner, stop_rule: StopRule | None = None) -> StepResult | None:
    """Schedule, run and postprocess one iteration; None when nothing is schedulable."""
    step = dispatch_step(scheduler, runner)
    return None if step is None else complete_step(scheduler, step, stop_rule)


def recompute_running(scheduler: Scheduler) -> None:
    """After the KV cache or batch state was lost (a failed step consumed the donated
    buffers): every running sequence goes back to waiting, to be recomputed. Newest first,
    since each preemption requeues at the front: arrival order survives. Tokens still in
    flight will never arrive (their steps are dropped): nothing stays pending. The prefix
    cache is forgotten with the cache it indexed."""
    for seq in reversed(list(scheduler.running)):
        scheduler.preempt(seq)
    scheduler.reset_prefix_cache()
    for seq in scheduler.waiting:
        seq.num_pending = 0
