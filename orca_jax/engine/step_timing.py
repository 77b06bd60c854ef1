"""The step timeline: where each engine step's host time goes, and when the device finished it.

The engine always owns one `StepTimeline` (`LLMEngine.timeline`), off by default. While it is
enabled, the engine appends one `StepTiming` per dispatched step, fills its host parts with
`time.perf_counter()` deltas, and calls `timeline.watch(timing, device_output)` right after the
dispatch. A daemon `ReadyWatcher` thread then waits for that output
(`jax.block_until_ready`, which releases the GIL) and stamps `ready_at`, so the device's
schedule is known without the host loop ever blocking for it. `bench host` reads the records.

What the timestamps give, per step k (`derive`), with the steps in dispatch order:

    device_step_k = ready_k - max(dispatched_k, ready_{k-1})   # the device busy on step k
    device_idle_k = max(0, dispatched_k - ready_{k-1})         # the device waiting for the host
    host_critical_k = device_idle_k                            # host time on the critical path
    host_total_k = schedule + build + dispatch + postprocess + detokenize + outputs

`gc_s` is the garbage collection that happened during the step's host work; a collection runs
inside one of the parts, so it is already counted there, and is reported as "of which gc", not
added to host_total. `wait_s` (blocked on the result) is not host work either.

`ready_at` is read when the watcher thread gets the GIL back after the device finished, which
takes up to `sys.getswitchinterval()` (5 ms by default) while the host loop runs Python; a
measurement lowers it (bench host sets 1e-4 s and records the value).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

# The host parts of a step, in the order they happen; their sum is the step's host work.
HOST_PARTS = ("schedule", "build", "dispatch", "postprocess", "detokenize", "outputs")
# Fields of a derived step that `summarize` takes medians and 90th percentiles of.
SUMMARY_FIELDS = (*(f"{p}_s" for p in HOST_PARTS), "gc_s", "wait_s", "host_total_s", "host_critical_s",
                  "device_step_s", "device_idle_s", "device_idle_frac", "period_s",
                  "h2d_bytes", "h2d_arrays", "d2h_bytes", "num_seqs", "num_tokens")


@dataclass(slots=True)
class StepTiming:
    step: int  # engine step number at dispatch
    mode: str  # "sync" or "async"
    num_seqs: int  # rows scheduled
    num_tokens: int  # tokens scheduled
    bucket: int  # token bucket (program)
    has_prefill: bool  # some row was not a one-token decode
    schedule_s: float = 0.0  # Scheduler.schedule
    build_s: float = 0.0  # host side of building the step inputs
    dispatch_s: float = 0.0  # handing the inputs to the device and enqueueing the program (after build)
    wait_s: float = 0.0  # blocked on the step's result
    postprocess_s: float = 0.0  # Scheduler.postprocess incl. stop rules, EXCLUDING detokenize_s
    detokenize_s: float = 0.0
    outputs_s: float = 0.0  # building RequestOutputs
    gc_s: float = 0.0  # garbage collection during this step's host work (inside the parts above)
    dispatched_at: float = 0.0  # time.perf_counter() when dispatch returned
    ready_at: float = 0.0  # perf_counter when the device result was ready (set by ReadyWatcher); 0: unknown
    h2d_bytes: int = 0  # bytes of host arrays sent for this step
    h2d_arrays: int = 0
    d2h_bytes: int = 0


class ReadyWatcher:
    """One daemon thread that waits, in dispatch order, for each watched step's device output
    and stamps its `ready_at`. Steps run on the device in the order they were dispatched, so a
    FIFO queue and one thread see each finish about when it happens."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self.errors = 0  # outputs that raised instead of becoming ready (a failed step)
        self._thread = threading.Thread(target=self._run, name="orca-jax-ready-watcher", daemon=True)
        self._thread.start()

    def put(self, timing: StepTiming, arrays: Any) -> None:
        self._queue.put((timing, arrays))

    def wait_idle(self) -> None:
        """Until every output queued so far has been waited for."""
        self._queue.join()

    def stop(self) -> None:
        """Finish what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        import jax

        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                timing, arrays = item
                try:
                    jax.block_until_ready(arrays)  # releases the GIL while the device works
                except Exception:  # noqa: BLE001 - a failed step is the engine's to report
                    self.errors += 1  # ready_at stays 0: unknown
                else:
                    timing.ready_at = time.perf_counter()
                del item, arrays  # do not keep the step's output alive until the next one
            finally:
                self._queue.task_done()


class StepTimeline:
    """A bounded record of the engine's steps, off until `enable()`.

    While enabled: the engine appends `StepTiming`s to `records` and hands each step's device
    output to `watch`; `gc_seconds()` counts the time spent in garbage collection (through
    `gc.callbacks`). `disable()` stops the watcher (after it has finished what is queued) and
    the gc callback; `records` stay until `clear()`."""

    def __init__(self, maxlen: int = 8192):
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self.enabled = False
        self.records: deque[StepTiming] = deque(maxlen=maxlen)
        self._watcher: ReadyWatcher | None = None
        self._gc_total = 0.0
        self._gc_started: float | None = None

    def enable(self) -> None:
        if self.enabled:
            return
        self._gc_total, self._gc_started = 0.0, None
        gc.callbacks.append(self._on_gc)
        self._watcher = ReadyWatcher()
        self.enabled = True

    def disable(self) -> None:
        if not self.enabled:
            return
        self.enabled = False
        self._watcher.stop()
        self._watcher = None
        gc.callbacks.remove(self._on_gc)

    def clear(self) -> None:
        """Forget the records (the gc counter keeps running: it is read as differences)."""
        self.records.clear()

    def gc_seconds(self) -> float:
        """Seconds spent in garbage collection since `enable()` (0 while disabled)."""
        return self._gc_total

    def watch(self, timing: StepTiming, arrays: Any) -> None:
        """Stamp `timing.ready_at` once `arrays` (the step's device output) are ready; a no-op
        while disabled."""
        if self.enabled:
            self._watcher.put(timing, arrays)

    @property
    def watch_errors(self) -> int:
        return self._watcher.errors if self._watcher is not None else 0

    def wait_idle(self) -> None:
        """Until the watcher has stamped every step handed to it so far."""
        if self._watcher is not None:
            self._watcher.wait_idle()

    def _on_gc(self, phase: str, _info: dict) -> None:
        # A collection runs with the GIL held and does not nest, so start/stop pair up.
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif phase == "stop" and self._gc_started is not None:
            self._gc_total += time.perf_counter() - self._gc_started
            self._gc_started = None


# ---- what the records say ------------------------------------------------------------------------
def derive(records: Iterable[StepTiming]) -> list[dict[str, Any]]:
    """Per step, its fields plus host_total_s, device_step_s, device_idle_s, host_critical_s,
    device_idle_frac and period_s (ready_k - ready_{k-1}).

    `records` is one contiguous run of dispatches (what was recorded between `clear()` and
    now); they are taken in dispatch order. A step whose ready time is unknown, and the first
    step (no previous finish to measure from), get NaN for what needs those times; a step
    after one of unknown ready time measures its device time from its own dispatch."""
    ordered = sorted(records, key=lambda t: t.dispatched_at)
    derived, previous_ready = [], math.nan
    for t in ordered:
        row = {f.name: getattr(t, f.name) for f in dataclasses.fields(t)}
        row["host_total_s"] = sum(getattr(t, f"{p}_s") for p in HOST_PARTS)
        ready = t.ready_at if t.ready_at > 0 else math.nan
        if math.isnan(previous_ready):
            row["device_idle_s"] = math.nan
            row["device_step_s"] = ready - t.dispatched_at
            row["period_s"] = math.nan
        else:
            row["device_idle_s"] = max(0.0, t.dispatched_at - previous_ready)
            row["device_step_s"] = ready - max(t.dispatched_at, previous_ready)
            row["period_s"] = ready - previous_ready
        row["host_critical_s"] = row["device_idle_s"]
        busy_and_idle = row["device_step_s"] + row["device_idle_s"]
        row["device_idle_frac"] = row["device_idle_s"] / busy_and_idle if busy_and_idle > 0 else math.nan
        derived.append(row)
        previous_ready = ready
    return derived


def summarize(derived: list[dict[str, Any]], decode_only: bool = True) -> dict[str, Any]:
    """Medians and 90th percentiles of every field in SUMMARY_FIELDS over the derived steps
    (only steps without prefill rows when `decode_only`; NaNs left out per field), the number
    of steps, and `device_idle_frac` over all of them together: total idle / (total idle +
    total device step)."""
    rows = [r for r in derived if not (decode_only and r["has_prefill"])]
    summary: dict[str, Any] = {"steps": len(rows), "decode_only": decode_only, "median": {}, "p90": {}}
    for name in SUMMARY_FIELDS:
        values = np.array([r[name] for r in rows], np.float64)
        values = values[~np.isnan(values)]
        summary["median"][name] = float(np.median(values)) if values.size else None
        summary["p90"][name] = float(np.percentile(values, 90)) if values.size else None
    timed = [r for r in rows if not (math.isnan(r["device_idle_s"]) or math.isnan(r["device_step_s"]))]
    idle = sum(r["device_idle_s"] for r in timed)
    busy = sum(r["device_step_s"] for r in timed)
    summary["device_idle_frac"] = idle / (idle + busy) if idle + busy > 0 else None
    summary["timed_steps"] = len(timed)
    return summary
