"""`orca-jax bench host`: where the host's time goes in one engine step, and how long the device
waits for it, in both scheduling modes side by side (issue 13).

The engine records each dispatched step in `LLMEngine.timeline` (`orca_jax.engine.step_timing`): the
host parts (schedule, build, dispatch, postprocess, detokenize, outputs, gc), the bytes sent to
the device, and, from a watcher thread, when the device finished it. From those: the device step
time, the device's idle time between consecutive steps (what the host left on the critical
path), and the host work in total.

Workload, per model and max_model_len: one engine per mode (`async_scheduling=False/True`),
both alive in this process; cells alternate the order of the modes so machine drift hits both.
A cell is N requests of `prompt_len` random tokens in one mix, run until `warm_steps`
decode-only steps in a row, then `steps` recorded steps (a request that finishes is replaced,
and steps with prefill rows are left out of the medians), then aborted and drained. Mixes:
`greedy`; `realistic`, by request index i % 4: greedy | temperature 0.8, top_p 0.95, seeded |
temperature 0.7, top_k 50, repetition 1.1, presence 0.3, frequency 0.2 | greedy, logprobs 5,
stop ["\\n\\n\\n", "###"]. EOS is ignored. The `long` cell is N=256 realistic after `long_steps`
decode steps (outputs of ~1,000 tokens). `--offline` adds `bench offline`'s timed run (48
requests at t=0, input U[16, 256], output U[1, 64], the default model) at max_num_seqs 16 and
64 in both modes.

Models (orca_jax/bench/random_model.py, random weights, the default model's tokenizer):
- `tiny`: Llama, hidden 64, 2 layers, vocabulary 49,152: the host parts at their real cost.
  On this 2-core CPU its device step is *not* small: at N=256 the step's vocabulary-wide work
  (log-softmax and argmax over [256, 49152]: 182 of the 250 ms of a greedy step, measured
  alone) costs about 8x the host total (device 172-255 ms against host 23-32 ms, sync, greedy,
  at load average 3-3.6), and the top-k/top-p rows of the realistic mix sort [S, 49152] (1.3 s
  per step at N=64, so several seconds at 256: these cells make most of a full run's hours;
  pick a subset with the flags for a quick one).
- `balanced`: the same layers over the first 8,192 ids of the vocabulary (real tokens, so the
  text is still real). Chosen once so that the sync device step at N=256 greedy is 2-4x the
  host total here: 64 ms device against 24.5 ms host (2.6x) on the synchronous engine before
  issue 13 (max_model_len 2048, load average ~5), 42 ms against 12.9 ms (3.3x) on the issue-13
  engine in progress (max_model_len 4096, load ~3). Layers barely move it on this CPU (hidden
  128 with 2 or 4 layers measured 85-122 ms, within the noise of the shared machine); the
  vocabulary does. It is the model for the "device idle <= 5% when the device step is longer
  than the host work" target, and, its realistic steps being ~6x cheaper than tiny's (0.6-0.9
  s at N=256), the default model of the long cell. When the host total falls further, the
  ratio grows: re-measure, and lower `vocab_size` in HOST_MODELS to keep it at 2-4x.

`sys.setswitchinterval(switch_interval_s)` while the cells run (recorded): the watcher needs the
GIL to stamp a step's end, and would wait up to 5 ms for it by default.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from orca_jax.bench.driver import BenchmarkError
from orca_jax.engine.step_timing import HOST_PARTS, derive, summarize

MIXES = ("greedy", "realistic")
MODES = ("sync", "async")
REALISTIC_STOP = ["\n\n\n", "###"]
# Steps a cell may take past its estimate: a replaced request's prefill restarts the warm-up streak.
_STEP_MARGIN = 16


@dataclasses.dataclass(frozen=True)
class HostSettings:
    models: tuple[str, ...] = ("tiny", "balanced")
    num_seqs: tuple[int, ...] = (32, 64, 128, 256)
    max_model_lens: tuple[int, ...] = (2048, 4096, 8192)
    mixes: tuple[str, ...] = MIXES
    modes: tuple[str, ...] = MODES
    warm_steps: int = 8
    steps: int = 32
    prompt_len: int = 32
    long_steps: int = 1000  # decode steps before the long cell records; 0: no long cell
    long_model: str = "balanced"
    # The long cell is realistic; on a CPU its sampler (a full-vocabulary sort for
    # top-p/top-k) makes 1,000 steps take ~10 min per mode, so "greedy" is the quick variant.
    long_mix: str = "realistic"
    long_num_seqs: int = 256
    long_max_model_len: int = 4096
    offline: bool = False
    offline_max_num_seqs: tuple[int, ...] = (16, 64)
    # Above the largest N: filling N sequences through a budget of N tokens takes ~6x more
    # steps (the decodes of those already admitted crowd the prefill chunks out).
    max_num_batched_tokens: int = 512
    page_size: int = 16
    switch_interval_s: float = 1e-4
    seed: int = 0

    def __post_init__(self):
        from orca_jax.bench.random_model import HOST_MODELS

        errors = []
        for name, values, known in (("models", self.models, HOST_MODELS), ("mixes", self.mixes, MIXES),
                                    ("modes", self.modes, MODES)):
            if unknown := [v for v in values if v not in known]:
                errors.append(f"unknown {name} {unknown}; choose from {list(known)}")
        if not self.modes:
            errors.append("modes must name at least one of sync, async")
        if self.long_mix not in MIXES:
            errors.append(f"unknown long_mix {self.long_mix!r}; choose from {list(MIXES)}")
        if self.long_steps and self.long_model not in HOST_MODELS:
            errors.append(f"unknown long_model {self.long_model!r}; choose from {list(HOST_MODELS)}")
        ints = dict(warm_steps=self.warm_steps, steps=self.steps, prompt_len=self.prompt_len,
                    page_size=self.page_size, long_num_seqs=self.long_num_seqs)
        errors += [f"{k} must be >= 1, got {v}" for k, v in ints.items() if v < 1]
        if self.long_steps < 0 or self.switch_interval_s <= 0:
            errors.append("long_steps must be >= 0 and switch_interval_s > 0")
        if any(n < 1 for n in (*self.num_seqs, *self.max_model_lens, *self.offline_max_num_seqs)):
            errors.append("num_seqs, max_model_lens and offline_max_num_seqs must be >= 1")
        if self.max_num_batched_tokens <= max(self.all_num_seqs, default=0):
            errors.append(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must exceed the largest "
                          f"num_seqs ({max(self.all_num_seqs)}), or prefill cannot fill the batch")
        for cell in self.cells():
            if self.prompt_len + cell_step_limit(self, cell) + 2 > cell.max_model_len:
                errors.append(f"{cell.label}: {self.prompt_len}-token prompts and up to "
                              f"{cell_step_limit(self, cell)} steps do not fit max_model_len {cell.max_model_len}")
        if not (self.cells() or self.offline):
            errors.append("nothing to run: no cells (models x max_model_lens x mixes x num_seqs) and no --offline")
        if errors:
            raise ValueError("invalid bench host settings: " + "; ".join(errors))

    @property
    def all_num_seqs(self) -> tuple[int, ...]:
        return (*self.num_seqs, *((self.long_num_seqs,) if self.long_steps else ()))

    def cells(self) -> list["Cell"]:
        """Every cell but the modes, grouped by (model, max_model_len): the grid, then `long`."""
        cells = [Cell(model, length, mix, n, self.warm_steps)
                 for model in self.models for length in self.max_model_lens for mix in self.mixes
                 for n in self.num_seqs]
        if self.long_steps:
            cells.append(Cell(self.long_model, self.long_max_model_len, self.long_mix, self.long_num_seqs,
                              self.long_steps, long=True))
        return sorted(cells, key=lambda c: (self._group_order(c), c.long))

    def _group_order(self, cell: "Cell") -> tuple[int, int]:
        models = list(dict.fromkeys((*self.models, self.long_model)))
        lengths = list(dict.fromkeys((*self.max_model_lens, self.long_max_model_len)))
        return models.index(cell.model), lengths.index(cell.max_model_len)


@dataclasses.dataclass(frozen=True)
class Cell:
    model: str
    max_model_len: int
    mix: str
    num_seqs: int
    warm_steps: int  # grid: decode-only steps in a row; long: decode steps in all
    long: bool = False

    @property
    def label(self) -> str:
        return (f"{self.model} L={self.max_model_len} {'long ' if self.long else ''}{self.mix} "
                f"N={self.num_seqs}")


def cell_step_limit(s: HostSettings, cell: Cell) -> int:
    """Engine steps a cell may take at most (the pool and the lengths are sized for it):
    filling the batch, warm-up, recording, and a margin for replaced requests."""
    fill = math.ceil(cell.num_seqs * s.prompt_len / max(1, s.max_num_batched_tokens - cell.num_seqs)) + 2
    return fill + cell.warm_steps + s.steps + _STEP_MARGIN


def mix_params(mix: str, index: int, max_tokens: int):
    """SamplingParams of request `index` in `mix` (EOS ignored; deltas when the engine has them)."""
    from orca_jax.core.sampling_params import SamplingParams

    common: dict[str, Any] = dict(max_tokens=max_tokens, ignore_eos=True)
    if delta_outputs_supported():
        common["output_kind"] = "delta"
    if mix == "greedy" or index % 4 == 0:
        return SamplingParams(temperature=0.0, **common)
    if index % 4 == 1:
        return SamplingParams(temperature=0.8, top_p=0.95, seed=index, **common)
    if index % 4 == 2:
        return SamplingParams(temperature=0.7, top_k=50, repetition_penalty=1.1, presence_penalty=0.3,
                              frequency_penalty=0.2, **common)
    return SamplingParams(temperature=0.0, logprobs=5, stop=list(REALISTIC_STOP), **common)


def delta_outputs_supported() -> bool:
    from orca_jax.core.sampling_params import SamplingParams

    return "output_kind" in {f.name for f in dataclasses.fields(SamplingParams)}


def available_modes(requested: tuple[str, ...], config_fields: set[str]) -> tuple[list[str], dict[str, str]]:
    """The requested modes this engine can run, and why the others cannot."""
    if "async_scheduling" in config_fields:
        return list(requested), {}
    reason = "EngineConfig has no async_scheduling field: this engine steps synchronously only"
    return [m for m in requested if m == "sync"], ({"async": reason} if "async" in requested else {})


def engine_config_fields() -> set[str]:
    from orca_jax.config import EngineConfig

    return {f.name for f in dataclasses.fields(EngineConfig)}


def require_timeline(engine) -> None:
    from orca_jax.engine.step_timing import StepTimeline

    if not isinstance(getattr(engine, "timeline", None), StepTimeline):
        raise BenchmarkError(
            "bench host reads LLMEngine.timeline, an orca_jax.engine.step_timing.StepTimeline that the engine fills "
            "with one StepTiming per dispatched step (and watch()es its device output); this engine has "
            f"{type(getattr(engine, 'timeline', None)).__name__!s} there. The engine of issue 13 adds it.")


# ---- one cell -------------------------------------------------------------------------------------
class RequestFeeder:
    """Keeps N requests of one mix running: adds them, replaces those that finish, and counts
    the tokens each has produced (from the outputs' deltas)."""

    def __init__(self, engine, mix: str, prompt_len: int, tag: str, rng: np.random.Generator):
        self.engine, self.mix, self.prompt_len, self.tag, self.rng = engine, mix, prompt_len, tag, rng
        special = set(getattr(engine.tokenizer, "all_special_ids", ()) or ())
        vocab = engine.model_config.vocab_size
        self.allowed = np.setdiff1d(np.arange(vocab), np.fromiter(special, np.int64, len(special)))
        self.max_tokens = engine.config.max_model_len - prompt_len
        self.counter = itertools.count()
        self.tokens: dict[str, int] = {}  # live request -> tokens so far
        self.replaced = 0

    def add(self, count: int) -> None:
        for _ in range(count):
            i = next(self.counter)
            request_id = f"{self.tag}-{i}"
            prompt = self.rng.choice(self.allowed, self.prompt_len).tolist()
            self.engine.add_request(request_id, prompt, mix_params(self.mix, i, self.max_tokens))
            self.tokens[request_id] = 0

    def on_outputs(self, outputs, replace: bool = True) -> None:
        finished = 0
        for out in outputs:
            if out.request_id not in self.tokens:
                continue
            if out.error is not None:
                raise BenchmarkError(f"request {out.request_id} failed: {out.error}")
            # delta_token_ids: what is new since the last output, whatever the output kind.
            self.tokens[out.request_id] += len(out.outputs[0].delta_token_ids)
            if out.finished:
                del self.tokens[out.request_id]
                finished += 1
        if replace and finished:
            self.replaced += finished
            self.add(finished)

    def mean_output_len(self) -> float:
        return float(np.mean(list(self.tokens.values()))) if self.tokens else 0.0

    def abort_all(self) -> None:
        for request_id in list(self.tokens):
            self.engine.abort(request_id)
        while self.engine.has_unfinished_requests():
            self.on_outputs(self.engine.step(), replace=False)
        self.tokens.clear()


def warm_up(engine, feeder: RequestFeeder, cell: Cell, limit: int) -> int:
    """Step until the cell is steady (see Cell.warm_steps); returns the steps taken. The
    timeline keeps only the newest record, whose finish the next step is measured from."""
    timeline, streak, decode_steps = engine.timeline, 0, 0
    for taken in range(1, limit + 1):
        carried = len(timeline.records)
        feeder.on_outputs(engine.step())
        for record in list(timeline.records)[carried:]:
            streak = 0 if record.has_prefill else streak + 1
            decode_steps += not record.has_prefill
        if timeline.records:
            last = timeline.records[-1]
            timeline.clear()
            timeline.records.append(last)
        if (decode_steps >= cell.warm_steps) if cell.long else (streak >= cell.warm_steps):
            return taken
    raise BenchmarkError(f"{cell.label}: not steady after {limit} steps (streak {streak}, "
                         f"{decode_steps} decode steps, {feeder.replaced} requests replaced)")


def run_cell(engine, cell: Cell, mode: str, s: HostSettings) -> dict[str, Any]:
    from orca_jax.worker.compile_guard import compile_count

    timeline = engine.timeline
    feeder = RequestFeeder(engine, cell.mix, s.prompt_len, f"{mode}-{cell.label}".replace(" ", "-"),
                           np.random.default_rng([s.seed, cell.num_seqs, cell.max_model_len]))
    compiles, preemptions = compile_count(), engine.scheduler.num_preemptions
    timeline.clear()
    timeline.enable()
    try:
        feeder.add(cell.num_seqs)
        warm_taken = warm_up(engine, feeder, cell, cell_step_limit(s, cell))
        output_len_before = feeder.mean_output_len()
        walls = []
        for _ in range(s.steps):
            start = time.perf_counter()
            outputs = engine.step()
            walls.append(time.perf_counter() - start)
            feeder.on_outputs(outputs)
        timeline.wait_idle()
        records = list(timeline.records)
        watch_errors = timeline.watch_errors
    finally:
        timeline.disable()
        timeline.clear()
    feeder.abort_all()
    compiles = compile_count() - compiles
    if engine.allocator.num_used:
        raise BenchmarkError(f"{cell.label} ({mode}): {engine.allocator.num_used} KV pages in use after the drain")
    if modes := {r.mode for r in records} - {mode}:
        raise BenchmarkError(f"{cell.label}: the {mode} engine recorded steps of mode {sorted(modes)}")
    derived = derive(records)[1:]  # the first is the warm-up's last step: only its finish is needed
    return cell_record(cell, mode, summarize(derived), len(derived), dict(
        output_len_before=output_len_before, step_wall_us=_us(float(np.median(walls))), warm_steps_taken=warm_taken,
        replaced_requests=feeder.replaced, preemptions=engine.scheduler.num_preemptions - preemptions,
        compiles_after_warmup=compiles, watch_errors=watch_errors, load_average=list(os.getloadavg())))


def _us(seconds):
    return None if seconds is None else round(seconds * 1e6, 1)


def cell_record(cell: Cell, mode: str, summary: dict[str, Any], recorded: int, extra: dict) -> dict[str, Any]:
    """A cell's JSON: medians (and 90th percentiles) in microseconds per decode step."""
    med, p90 = summary["median"], summary["p90"]
    parts = (*HOST_PARTS, "gc")
    return {
        "model": cell.model, "mode": mode, "max_model_len": cell.max_model_len, "mix": cell.mix,
        "num_seqs": cell.num_seqs, "long": cell.long, "steps": summary["steps"], "timed_steps": summary["timed_steps"],
        "recorded_steps": recorded, "prefill_steps": recorded - summary["steps"],
        "parts_us": {p: _us(med[f"{p}_s"]) for p in parts}, "parts_us_p90": {p: _us(p90[f"{p}_s"]) for p in parts},
        "wait_us": _us(med["wait_s"]),
        **{f"{name}_us": _us(med[f"{name}_s"]) for name in ("host_total", "host_critical", "device_step",
                                                             "device_idle", "period")},
        **{f"{name}_us_p90": _us(p90[f"{name}_s"]) for name in ("host_total", "host_critical", "device_step")},
        "device_idle_frac": summary["device_idle_frac"],
        **{name: med[name] for name in ("h2d_bytes", "h2d_arrays", "d2h_bytes")},
        "scheduled_seqs": med["num_seqs"],
        **extra,
    }


# ---- the run --------------------------------------------------------------------------------------
def build_engine(model_dir: Path, mode: str, max_model_len: int, max_num_seqs: int, num_pages: int,
                 s: HostSettings, config_fields: set[str]):
    from orca_jax.engine.engine import LLMEngine

    args = dict(model=str(model_dir), max_num_seqs=max_num_seqs,
                max_num_batched_tokens=s.max_num_batched_tokens, max_model_len=max_model_len,
                page_size=s.page_size, num_pages=num_pages, seed=s.seed)
    if "async_scheduling" in config_fields:
        args["async_scheduling"] = mode == "async"
    engine = LLMEngine(**args)
    require_timeline(engine)
    return engine


def pool_pages(s: HostSettings, cells: list[Cell], max_model_len: int) -> int:
    """Pages for every sequence of the largest cell at its longest (plus one in flight), and
    at least one sequence of max_model_len (the engine checks a request could reach it)."""
    per_cell = [c.num_seqs * -(-(s.prompt_len + cell_step_limit(s, c) + 2) // s.page_size) for c in cells]
    return max(*per_cell, -(-max_model_len // s.page_size) + 1) + 1


def run_host(s: HostSettings, command: str = "", progress: Callable[[str], None] = print) -> dict[str, Any]:
    from orca_jax.bench import environment
    from orca_jax.bench.random_model import default_model_tokenizer, host_model_config, write_host_model

    config_fields = engine_config_fields()
    modes, unavailable = available_modes(s.modes, config_fields)
    if not modes:
        raise BenchmarkError(f"none of the modes {list(s.modes)} can run: {unavailable}")
    for mode, why in unavailable.items():
        progress(f"mode {mode} skipped: {why}")
    record: dict[str, Any] = {
        **environment.record_header("host", command),
        "settings": dataclasses.asdict(s), "modes": modes, "modes_unavailable": unavailable,
        "output_kind": "delta" if delta_outputs_supported() else None, "models": {}, "cells": [], "offline": None,
    }
    previous_interval = sys.getswitchinterval()
    sys.setswitchinterval(s.switch_interval_s)
    record["switch_interval_s"] = sys.getswitchinterval()
    try:
        with tempfile.TemporaryDirectory(prefix="orca-jax-bench-host-") as tmp:
            cells = s.cells()
            tokenizer = default_model_tokenizer() if cells else None
            for (model, length), group in itertools.groupby(cells, key=lambda c: (c.model, c.max_model_len)):
                group = list(group)
                model_dir = Path(tmp) / model
                if model not in record["models"]:
                    write_host_model(model_dir, model, tokenizer, seed=s.seed)
                    record["models"][model] = host_model_config(model, tokenizer)
                record["cells"] += _run_group(model_dir, length, group, modes, s, config_fields, progress)
    finally:
        sys.setswitchinterval(previous_interval)
    if s.offline:  # as `bench offline` runs: no timeline, the default switch interval
        record["offline"] = run_offline_modes(s, modes, progress)
    record["machine"]["load_average_end"] = environment.load_average()
    return record


def _run_group(model_dir: Path, max_model_len: int, cells: list[Cell], modes: list[str], s: HostSettings,
               config_fields: set[str], progress) -> list[dict[str, Any]]:
    """One engine per mode for this model and max_model_len; every cell in both, alternating."""
    max_num_seqs = max(c.num_seqs for c in cells)
    num_pages = pool_pages(s, cells, max_model_len)
    engines = {}
    for mode in modes:
        start = time.perf_counter()
        engines[mode] = build_engine(model_dir, mode, max_model_len, max_num_seqs, num_pages, s, config_fields)
        progress(f"{model_dir.name} max_model_len {max_model_len}: {mode} engine in "
                 f"{time.perf_counter() - start:.1f} s ({num_pages} pages)")
    results = []
    for i, cell in enumerate(cells):
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            result = run_cell(engines[mode], cell, mode, s)
            results.append(result)
            progress(f"{cell.label} {mode}: host total {result['host_total_us']} us, device step "
                     f"{result['device_step_us']} us, idle {_percent(result['device_idle_frac'])}, "
                     f"h2d {result['h2d_bytes']} B, {result['compiles_after_warmup']} compiles")
    del engines
    gc.collect()  # free both KV pools before the next group allocates its own
    return results


def run_offline_modes(s: HostSettings, modes: list[str], progress) -> list[dict[str, Any]]:
    """`bench offline`'s timed orca_jax run (`run_orca`, its trace) at each max_num_seqs, per mode."""
    from orca_jax.entrypoints.llm import LLM
    from orca_jax.bench.offline import OfflineSettings, run_orca
    from orca_jax.bench.trace import make_trace

    results = []
    for i, max_num_seqs in enumerate(s.offline_max_num_seqs):
        o = OfflineSettings(max_num_seqs=max_num_seqs, peers=(), seed=s.seed)
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            mode_args = {"async_scheduling": mode == "async"} if "async_scheduling" in engine_config_fields() else {}
            start = time.perf_counter()
            llm = LLM(model=o.model, max_num_seqs=o.max_num_seqs, max_num_batched_tokens=o.max_num_batched_tokens,
                      dtype=o.dtype, page_size=o.page_size, **mode_args)
            startup_s = time.perf_counter() - start
            special = tuple(getattr(llm.get_tokenizer(), "all_special_ids", ()) or ())
            trace = make_trace(o.num_requests, o.scale, o.seed, vocab_size=llm.engine.model_config.vocab_size,
                               exclude_ids=special)
            run = run_orca(llm, trace)
            results.append({"max_num_seqs": max_num_seqs, "mode": mode, "startup_s": startup_s,
                            "load_average": list(os.getloadavg()), **{k: run[k] for k in (
                                "requests", "useful_output_tokens", "wall_s", "useful_output_tokens_per_s",
                                "engine_steps", "xla_compiles_during_run")}})
            progress(f"offline max_num_seqs {max_num_seqs} {mode}: {run['wall_s']:.2f} s, "
                     f"{run['useful_output_tokens_per_s']:.1f} useful tok/s")
            del llm
            gc.collect()
    return results


# ---- report ---------------------------------------------------------------------------------------
_ROWS = (  # (label, cell -> value, format)
    *((p, lambda c, p=p: c["parts_us"][p], "us") for p in HOST_PARTS),
    ("  of which gc", lambda c: c["parts_us"]["gc"], "us"),
    ("host total", lambda c: c["host_total_us"], "us"),
    ("host total p90", lambda c: c["host_total_us_p90"], "us"),
    ("host critical (device idle)", lambda c: c["host_critical_us"], "us"),
    ("device step", lambda c: c["device_step_us"], "us"),
    ("device idle share", lambda c: c["device_idle_frac"], "percent"),
    ("engine.step() wall", lambda c: c["step_wall_us"], "us"),
    ("host -> device per step", lambda c: c["h2d_bytes"], "bytes"),
    ("compiles after warm-up", lambda c: c["compiles_after_warmup"], "int"),
)


def _percent(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _format(value, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "us":
        return f"{value:,.0f}"
    if kind == "percent":
        return _percent(value)
    if kind == "bytes":
        return f"{value / 2**20:.2f} MB" if value >= 2**20 else f"{value / 2**10:.1f} KB"
    return f"{value:g}"


def _table(title: str, columns: list[str], cells_by_column: list[dict[str, dict]], modes: list[str]) -> str:
    rows = [["part", *columns]]
    for label, get, kind in _ROWS:
        rows.append([label, *(" / ".join(_format(get(by_mode[m]), kind) if m in by_mode else "-" for m in modes)
                              for by_mode in cells_by_column)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join([title, lines[0], "-" * len(lines[0]), *lines[1:]])


def format_report(record: dict[str, Any]) -> str:
    modes = record["modes"]
    pair = " / ".join(modes)
    out = [f"bench host: medians over decode-only steps, us per step; each entry {pair}"]
    grid = [c for c in record["cells"] if not c["long"]]
    groups = dict.fromkeys((c["model"], c["max_model_len"], c["mix"]) for c in grid)
    for model, length, mix in groups:
        cells = [c for c in grid if (c["model"], c["max_model_len"], c["mix"]) == (model, length, mix)]
        sizes = sorted({c["num_seqs"] for c in cells})
        by_size = [{c["mode"]: c for c in cells if c["num_seqs"] == n} for n in sizes]
        out += ["", _table(f"{model}, max_model_len {length}, {mix}", [f"{n} seqs" for n in sizes], by_size, modes)]
    long_cells = {c["mode"]: c for c in record["cells"] if c["long"]}
    if long_cells:
        c = next(iter(long_cells.values()))
        out += ["", _table(f"long: {c['model']}, max_model_len {c['max_model_len']}, {c['mix']}, outputs of "
                           f"~{c['output_len_before']:.0f} tokens", [f"{c['num_seqs']} seqs"], [long_cells], modes)]
    if record.get("offline"):
        out += ["", "offline (48 requests at t=0, default model): wall s / useful output tok/s"]
        for n in dict.fromkeys(r["max_num_seqs"] for r in record["offline"]):
            runs = {r["mode"]: r for r in record["offline"] if r["max_num_seqs"] == n}
            out.append(f"  max_num_seqs {n:>3}: " + ", ".join(
                f"{m} {runs[m]['wall_s']:.2f} s / {runs[m]['useful_output_tokens_per_s']:.1f}"
                for m in modes if m in runs))
    for mode, why in record.get("modes_unavailable", {}).items():
        out.append(f"mode {mode} not run: {why}")
    loads = [c["load_average"][0] for c in record["cells"]]
    out.append(f"switch interval {record['switch_interval_s']:g} s; output_kind {record.get('output_kind')}"
               + (f"; load average (1 min) {min(loads):.2f}-{max(loads):.2f}" if loads else ""))
    return "\n".join(out)
