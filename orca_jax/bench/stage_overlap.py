"""How the batches in flight overlap on a pipeline, from the stage clock's timestamps
(`orca_jax.worker.pipeline.StageTimeline`: per batch and stage, when it was enqueued and when its
output was ready).

A stage runs its batches in order, and a batch's stage s cannot start before stage s - 1 has
handed it its activations, so stage s of batch b ran from

    start = max(enqueued(b, s), done(b, s - 1), done(b', s))   (b' the batch before b on s)

to done(b, s). From those intervals: per stage, the seconds it computed (busy) and the
fraction of the run it waited; and the fraction of the run during which two or more stages
computed at once, which is what pipelining buys (on one device it is 0 by construction).
"""

from __future__ import annotations

from collections import defaultdict


def stage_intervals(records) -> dict[int, list[tuple[int, float, float]]]:
    """Per stage, (batch, start, end) of each batch it ran, in order."""
    done = {(batch, stage): end for batch, stage, _, end in records}
    by_stage: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
    for batch, stage, enqueued, end in sorted(records, key=lambda r: (r[1], r[0])):
        start = enqueued
        if (batch, stage - 1) in done:
            start = max(start, done[(batch, stage - 1)])
        if by_stage[stage]:
            start = max(start, by_stage[stage][-1][2])
        by_stage[stage].append((batch, min(start, end), end))
    return dict(by_stage)


def _covered(intervals: list[tuple[float, float]], at_least: int) -> float:
    """Seconds during which at least `at_least` of the intervals are open (a sweep)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    open_, last, total = 0, None, 0.0
    for time, delta in events:
        if last is not None and open_ >= at_least:
            total += time - last
        open_ += delta
        last = time
    return total


def analyze(records) -> dict:
    """Busy seconds and waiting fraction per stage, the fraction of the run with two or more
    stages computing, and the batches seen."""
    if not records:
        raise ValueError("no stage records: was the stage clock enabled?")
    by_stage = stage_intervals(records)
    begin = min(r[2] for r in records)
    end = max(r[3] for r in records)
    makespan = end - begin
    stages = []
    for stage in sorted(by_stage):
        busy = sum(b - a for _, a, b in by_stage[stage])
        stages.append({"stage": stage, "batches": len(by_stage[stage]), "busy_s": busy,
                       "busy_fraction": busy / makespan, "waiting_fraction": 1.0 - busy / makespan,
                       "median_batch_ms": 1e3 * sorted(b - a for _, a, b in by_stage[stage])[len(by_stage[stage]) // 2]})
    every = [(a, b) for intervals in by_stage.values() for _, a, b in intervals]
    return {"makespan_s": makespan, "stages": stages,
            "two_or_more_stages_busy_fraction": _covered(every, 2) / makespan,
            "any_stage_busy_fraction": _covered(every, 1) / makespan}
