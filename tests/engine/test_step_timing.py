"""The step timeline: what `derive` and `summarize` compute from the timestamps, and the watcher
thread that stamps when the device finished a step (waiting without holding the GIL)."""

from __future__ import annotations

import gc
import math
import threading
import time

import jax
import jax.numpy as jnp
import pytest

from orca_jax.engine.step_timing import HOST_PARTS, StepTimeline, StepTiming, derive, summarize


def timing(step, dispatched_at, ready_at, has_prefill=False, **parts) -> StepTiming:
    return StepTiming(step=step, mode="sync", num_seqs=4, num_tokens=4, bucket=8, has_prefill=has_prefill,
                      dispatched_at=dispatched_at, ready_at=ready_at, **parts)


def test_derive_measures_device_busy_and_idle_from_the_timestamps():
    # Step 1 is dispatched while step 0 still runs (overlapped); step 2 after the device went idle.
    records = [
        timing(0, dispatched_at=10.0, ready_at=10.5, schedule_s=0.1, build_s=0.2),
        timing(1, dispatched_at=10.3, ready_at=11.2, dispatch_s=0.05),
        timing(2, dispatched_at=11.5, ready_at=11.9, postprocess_s=0.1, detokenize_s=0.2, outputs_s=0.3,
               gc_s=0.25, wait_s=7.0),
    ]
    first, second, third = derive(reversed(records))  # taken in dispatch order whatever the input order
    assert [r["step"] for r in (first, second, third)] == [0, 1, 2]
    assert math.isnan(first["device_idle_s"]) and math.isnan(first["period_s"])
    assert first["device_step_s"] == pytest.approx(0.5)  # from its own dispatch: nothing before it
    # Step 1 waits for step 0 to finish: busy 10.5 -> 11.2, never idle.
    assert second["device_step_s"] == pytest.approx(0.7) and second["device_idle_s"] == 0.0
    assert second["period_s"] == pytest.approx(0.7) and second["device_idle_frac"] == 0.0
    # Step 2: idle 11.2 -> 11.5 (the host's critical path), busy 11.5 -> 11.9.
    assert third["device_idle_s"] == pytest.approx(0.3) and third["host_critical_s"] == third["device_idle_s"]
    assert third["device_step_s"] == pytest.approx(0.4)
    assert third["device_idle_frac"] == pytest.approx(0.3 / 0.7)
    # Host work: the parts, without the wait and without gc (which happened inside a part).
    assert first["host_total_s"] == pytest.approx(0.3)
    assert third["host_total_s"] == pytest.approx(0.6)
    assert set(HOST_PARTS) == {"schedule", "build", "dispatch", "postprocess", "detokenize", "outputs"}


def test_a_step_of_unknown_finish_breaks_the_chain_but_not_the_others():
    first, unknown, after = derive([timing(0, 1.0, 1.4), timing(1, 1.2, 0.0), timing(2, 1.6, 2.0)])
    assert math.isnan(unknown["device_step_s"]) and unknown["device_idle_s"] == 0.0
    # The step after it cannot know when the device became free: idle unknown, busy from its dispatch.
    assert math.isnan(after["device_idle_s"]) and after["device_step_s"] == pytest.approx(0.4)


def test_summarize_takes_medians_of_decode_steps_and_the_idle_share_of_all_time():
    records = [timing(0, 0.0, 1.0)]
    # Decode steps: each dispatched `idle` after the previous finished, busy 1.0.
    for step, idle in enumerate((0.1, 0.3, 0.2, 0.4), start=1):
        dispatched = records[-1].ready_at + idle
        records.append(timing(step, dispatched, dispatched + 1.0, schedule_s=idle / 10, h2d_bytes=100 * step))
    prefill_at = records[-1].ready_at + 5.0
    records.append(timing(5, prefill_at, prefill_at + 9.0, has_prefill=True, schedule_s=9.0))
    derived = derive(records)

    summary = summarize(derived)
    assert summary["steps"] == 5 and summary["decode_only"]  # the first step counts, the prefill does not
    assert summary["timed_steps"] == 4  # the first has no idle time
    assert summary["median"]["device_idle_s"] == pytest.approx(0.25)
    assert summary["median"]["device_step_s"] == pytest.approx(1.0)
    assert summary["median"]["schedule_s"] == pytest.approx(0.02)
    assert summary["p90"]["device_idle_s"] == pytest.approx(0.37)  # numpy's linear interpolation
    assert summary["median"]["h2d_bytes"] == 200
    assert summary["device_idle_frac"] == pytest.approx(1.0 / 5.0)  # 1.0 idle over 4.0 busy

    everything = summarize(derived, decode_only=False)
    assert everything["steps"] == 6 and everything["median"]["schedule_s"] == pytest.approx(0.025)
    assert everything["device_idle_frac"] == pytest.approx(6.0 / 19.0)

    empty = summarize([])
    assert empty["steps"] == 0 and empty["median"]["host_total_s"] is None and empty["device_idle_frac"] is None


def test_timeline_is_off_until_enabled_and_bounded():
    timeline = StepTimeline(maxlen=3)
    assert not timeline.enabled and len(timeline.records) == 0
    idle = timing(0, 1.0, 0.0)
    timeline.watch(idle, jnp.ones(3))
    timeline.wait_idle()
    assert idle.ready_at == 0.0, "a disabled timeline watches nothing"
    for step in range(5):
        timeline.records.append(timing(step, step, 0.0))
    assert [r.step for r in timeline.records] == [2, 3, 4]
    timeline.clear()
    assert len(timeline.records) == 0
    with pytest.raises(ValueError, match="maxlen"):
        StepTimeline(maxlen=0)


def test_watcher_stamps_each_step_in_dispatch_order_and_stops_on_disable():
    timeline = StepTimeline()
    callbacks_before = list(gc.callbacks)
    timeline.enable()
    try:
        assert len(gc.callbacks) == len(callbacks_before) + 1
        square = jax.jit(lambda x: x @ x)
        steps = []
        for step in range(5):
            out = square(jnp.full((64, 64), float(step)))
            steps.append(timing(step, time.perf_counter(), 0.0))
            timeline.watch(steps[-1], out)
        timeline.wait_idle()
        stamps = [t.ready_at for t in steps]
        assert all(t.ready_at >= t.dispatched_at for t in steps)
        assert stamps == sorted(stamps)
        watcher = [t for t in threading.enumerate() if t.name == "orca-jax-ready-watcher"]
        assert len(watcher) == 1 and watcher[0].daemon
    finally:
        timeline.disable()
    assert not watcher[0].is_alive()
    assert gc.callbacks == callbacks_before


def test_watcher_survives_a_step_whose_output_is_gone():
    timeline = StepTimeline()
    timeline.enable()
    try:
        lost = jnp.ones(4) + 1
        lost.delete()  # as a donated or failed step's buffer
        failed, fine = timing(0, time.perf_counter(), 0.0), timing(1, time.perf_counter(), 0.0)
        timeline.watch(failed, lost)
        timeline.watch(fine, jnp.ones(4) * 2)
        timeline.wait_idle()
        assert failed.ready_at == 0.0 and fine.ready_at > 0.0
        assert timeline.watch_errors == 1
    finally:
        timeline.disable()


def test_gc_seconds_counts_collections_while_enabled():
    timeline = StepTimeline()
    garbage = [[i] for i in range(200_000)]
    gc.collect()
    assert timeline.gc_seconds() == 0.0
    timeline.enable()
    try:
        before = timeline.gc_seconds()
        start = time.perf_counter()
        gc.collect()
        elapsed = time.perf_counter() - start
        spent = timeline.gc_seconds() - before
        assert 0.0 < spent <= elapsed
    finally:
        timeline.disable()
    del garbage


def test_watcher_waits_without_holding_the_gil():
    """While the device runs a long step, the host thread keeps running Python: the watcher's
    wait (block_until_ready) has released the GIL."""
    spin = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda _, y: jnp.tanh(y @ y), x))
    x = jnp.full((256, 256), 0.01)
    jax.block_until_ready(spin(x, 1))  # compiled; n is traced, so no compile below
    start = time.perf_counter()
    jax.block_until_ready(spin(x, 20))
    iterations = max(20, int(0.5 / ((time.perf_counter() - start) / 20)))  # about half a second

    timeline = StepTimeline()
    timeline.enable()
    try:
        out = spin(x, iterations)
        step = timing(0, time.perf_counter(), 0.0)
        timeline.watch(step, out)
        gaps, last = [], time.perf_counter()
        while step.ready_at == 0.0 and last - step.dispatched_at < 60:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        waited = last - step.dispatched_at
        timeline.wait_idle()
    finally:
        timeline.disable()
    assert step.ready_at > step.dispatched_at
    assert len(gaps) > 1000, "the host loop barely ran while the device worked"
    # Holding the GIL while waiting would stall this loop for the whole step.
    assert max(gaps) < waited / 2, (max(gaps), waited)
