"""`orca-jax bench prefix`: automatic prefix caching on against off, in one process.

The workload is the one prefix caching is for: every request starts with the same system
prompt (1,024 tokens by default) and adds its own question (32-128 tokens), 32 output tokens,
EOS ignored, greedy. It runs with all requests at t=0 and again at a Poisson rate, through two
engines built alike but for `enable_prefix_caching`, taking turns, so noise on a shared
machine hits both. The caching engine's cache is emptied before each of its runs: the first
request computes the system prompt in every run. Per run: throughput, TTFT p50/p99, and the
prompt tokens the steps computed (with caching off, all of them).

Two more checks: `n = 4` samples of one such prompt, whose prompt tokens computed should be
about one prefill, not four; and Orca's random trace (no sharing at all), where caching on
should cost next to nothing against off (`overhead_rounds` alternating runs, medians).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import numpy as np

from orca_jax.bench import environment
from orca_jax.bench.driver import BenchmarkError, check_pages_returned, run_open_loop, warm_up
from orca_jax.bench.latency import summarize
from orca_jax.bench.trace import ORCA_INPUT_RANGE, ORCA_OUTPUT_RANGE, Trace, make_trace, scaled_range


@dataclasses.dataclass(frozen=True)
class PrefixSettings:
    model: str | None = None
    num_requests: int = 64
    prefix_len: int = 1024
    question_range: tuple[int, int] = (32, 128)
    output_len: int = 32
    rate: float | None = 1.0  # the Poisson run's requests/s; None skips it
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    page_size: int = 16
    dtype: str = "float32"
    seed: int = 0
    n_samples: int = 4  # the n > 1 check; 0 skips it
    overhead_requests: int = 48  # Orca's trace for the no-sharing overhead; 0 skips it
    overhead_scale: float = 0.25
    overhead_rounds: int = 3

    def __post_init__(self):
        lo, hi = self.question_range
        if not 1 <= lo <= hi:
            raise ValueError(f"question_range must be 1 <= low <= high, got {self.question_range}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")

    @property
    def max_model_len(self) -> int:
        """The longest request of either workload, page-aligned (small page tables)."""
        longest = self.prefix_len + self.question_range[1] + self.output_len
        if self.overhead_requests:
            longest = max(longest, scaled_range(ORCA_INPUT_RANGE, self.overhead_scale)[1]
                          + scaled_range(ORCA_OUTPUT_RANGE, self.overhead_scale)[1])
        return -(-longest // self.page_size) * self.page_size


def shared_prefix_trace(s: PrefixSettings, vocab_size: int, exclude_ids=(), rate: float | None = None) -> Trace:
    """`num_requests` prompts: one system prompt of `prefix_len` random tokens, then each its
    own question of a length uniform in `question_range`; `output_len` tokens each."""
    rng = np.random.default_rng(s.seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(exclude_ids), dtype=np.int64))
    system = rng.choice(allowed, size=s.prefix_len).tolist()
    lengths = rng.integers(s.question_range[0], s.question_range[1] + 1, size=s.num_requests).tolist()
    prompts = [system + rng.choice(allowed, size=n).tolist() for n in lengths]
    trace = Trace([len(p) for p in prompts], [s.output_len] * s.num_requests, (min(lengths), max(lengths)),
                  (s.output_len, s.output_len), [0.0] * s.num_requests, prompts)
    return trace.with_arrivals(rate, s.seed) if rate is not None else trace


class PromptTokensComputed:
    """Counts the prompt tokens an engine's steps compute (wraps its scheduler's schedule)."""

    def __init__(self, engine):
        self.engine = engine
        self.count = 0

    def __enter__(self):
        real = self.engine.scheduler.schedule

        def counting():
            scheduled = real()
            for seq, n, start in zip(scheduled.seqs, scheduled.num_new, scheduled.starts):
                self.count += max(0, min(start + n, seq.num_prompt_tokens) - start)
            return scheduled

        self._real, self.engine.scheduler.schedule = real, counting
        return self

    def __exit__(self, *exc):
        self.engine.scheduler.schedule = self._real


def build_engines(s: PrefixSettings) -> dict[bool, Any]:
    from orca_jax.engine.engine import LLMEngine

    common = dict(model=s.model, dtype=s.dtype, max_num_seqs=s.max_num_seqs,
                  max_num_batched_tokens=s.max_num_batched_tokens, page_size=s.page_size,
                  max_model_len=s.max_model_len, seed=s.seed,
                  # every running sequence at full length, plus the system prompt's pages
                  num_pages=(s.max_num_seqs + 1) * (s.max_model_len // s.page_size) + 1)
    return {on: LLMEngine(enable_prefix_caching=on, **common) for on in (True, False)}


def timed_run(engine, trace: Trace) -> dict[str, Any]:
    """One open-loop run with the cache emptied first; summary, prompt tokens computed, hits."""
    from orca_jax.worker.compile_guard import compile_count

    engine.reset_prefix_cache()
    compiles, hits, steps = compile_count(), engine.scheduler.prefix_cache_hits, engine.num_steps
    with PromptTokensComputed(engine) as computed:
        timings = run_open_loop(engine, trace)
    check_pages_returned(engine)
    return {"summary": summarize(timings), "prompt_tokens": sum(trace.input_lens),
            "prompt_tokens_computed": computed.count,
            "prefix_cache_hit_tokens": engine.scheduler.prefix_cache_hits - hits,
            "engine_steps": engine.num_steps - steps,
            "xla_compiles_during_run": compile_count() - compiles}


def n_samples_run(engine, prompt: list[int], n: int, output_len: int) -> dict[str, int]:
    from orca_jax.core.sampling_params import SamplingParams

    engine.reset_prefix_cache()
    with PromptTokensComputed(engine) as computed:
        engine.add_request("n-samples", prompt, SamplingParams(n=n, max_tokens=output_len, temperature=1.0,
                                                                seed=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.error:
                    raise BenchmarkError(f"the n={n} request failed: {out.error}")
    check_pages_returned(engine)
    return {"n": n, "prompt_tokens": len(prompt), "prompt_tokens_computed": computed.count,
            "prefills": computed.count / len(prompt)}


def _pair(engines, trace: Trace, label: str, progress) -> dict[str, Any]:
    runs = {}
    for on in (True, False):
        runs["on" if on else "off"] = timed_run(engines[on], trace)
        r = runs["on" if on else "off"]["summary"]
        progress(f"{label} caching {'on' if on else 'off'}: {r['output_tokens_per_s']:.1f} tok/s, "
                 f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms, p99 {r['ttft_ms']['p99']:.0f} ms")
    on, off = runs["on"]["summary"], runs["off"]["summary"]
    runs["throughput_ratio"] = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    runs["ttft_p50_ratio"] = off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"]
    runs["ttft_p99_ratio"] = off["ttft_ms"]["p99"] / on["ttft_ms"]["p99"]
    return runs


def overhead_runs(engines, s: PrefixSettings, special_ids: tuple[int, ...], progress) -> dict[str, Any]:
    """Orca's random trace at t=0, caching on and off by turns: the cost of hashing and lookups
    when nothing is shared. The machine's noise between runs is larger than that cost, so it
    is also measured on the host alone (`scheduler_seconds_per_step`) and set against the
    measured step time."""
    trace = make_trace(s.overhead_requests, s.overhead_scale, s.seed + 1,
                       vocab_size=engines[True].model_config.vocab_size, exclude_ids=special_ids)
    rates, step_s = {"on": [], "off": []}, []
    for round_ in range(s.overhead_rounds):
        for on in (True, False) if round_ % 2 == 0 else (False, True):
            r = timed_run(engines[on], trace)
            rates["on" if on else "off"].append(r["summary"]["output_tokens_per_s"])
            step_s.append(r["summary"]["duration_s"] / r["engine_steps"])
            progress(f"no sharing, round {round_ + 1}, caching {'on' if on else 'off'}: "
                     f"{rates['on' if on else 'off'][-1]:.1f} tok/s")
    medians = {k: statistics.median(v) for k, v in rates.items()}
    host = {("on" if on else "off"): scheduler_seconds_per_step(engines[on].config, trace) for on in (True, False)}
    median_step_s = statistics.median(step_s)
    return {"trace": trace.describe(), "output_tokens_per_s": rates, "median_output_tokens_per_s": medians,
            "cost_of_caching": 1.0 - medians["on"] / medians["off"],
            "scheduler_seconds_per_step": host, "median_step_s": median_step_s,
            "host_cost_of_caching": (host["on"] - host["off"]) / median_step_s}


def scheduler_seconds_per_step(config, trace: Trace, repeats: int = 5) -> float:
    """Host seconds per step of schedule() + postprocess() on `trace` (all at t=0), with a
    model that samples token 0 and retires each request at its drawn length: what prefix
    caching adds on the host (hashing pages, lookups, publishing) without the device's noise.
    The best of `repeats` runs."""
    from orca_jax.core.kv_cache import PageAllocator
    from orca_jax.core.sampling_params import SamplingParams
    from orca_jax.core.scheduler import Scheduler
    from orca_jax.core.sequence import Sequence

    best = float("inf")
    for _ in range(repeats):
        scheduler = Scheduler(config, PageAllocator(config.num_pages, config.page_size))
        for i, (prompt, n) in enumerate(zip(trace.prompts, trace.output_lens)):
            scheduler.add(Sequence(i, str(i), 0, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True), i))
        steps, started = 0, time.perf_counter()
        while scheduler.has_unfinished():
            scheduled = scheduler.schedule()
            scheduler.postprocess(scheduled, [0] * len(scheduled))
            steps += 1
        best = min(best, (time.perf_counter() - started) / steps)
    return best


def run_prefix(s: PrefixSettings, command: str = "", progress=print) -> dict[str, Any]:
    engines = build_engines(s)
    engine = engines[True]
    special = tuple(getattr(engine.tokenizer, "all_special_ids", ()) or ())
    vocab = engine.model_config.vocab_size
    trace = shared_prefix_trace(s, vocab, special)
    for e in engines.values():
        warm_up(e, trace)
    record: dict[str, Any] = {
        **environment.record_header("prefix", command), "settings": dataclasses.asdict(s),
        "model": s.model or "default (SmolLM2-135M-Instruct, embedded)",
        "engine": {"token_buckets": list(engine.config.token_buckets), "num_pages": engine.allocator.num_pages,
                   "attention_impl": engine.attention_impl, "dtype": engine.config.dtype},
        "workload": trace.describe(),
        "at_t0": _pair(engines, trace, "all at t=0", progress),
    }
    if s.rate is not None:
        record["poisson"] = {"rate": s.rate, **_pair(engines, trace.with_arrivals(s.rate, s.seed),
                                                     f"Poisson {s.rate:g}/s", progress)}
    if s.n_samples:
        record["n_samples"] = {"on" if on else "off": n_samples_run(engines[on], trace.prompts[0], s.n_samples,
                                                                     s.output_len) for on in (True, False)}
    if s.overhead_requests:
        record["no_sharing"] = overhead_runs(engines, s, special, progress)
    compiles = [r["xla_compiles_during_run"] for key in ("at_t0", "poisson") if key in record
                for r in (record[key]["on"], record[key]["off"])]
    record["xla_compiles_during_runs"] = sum(compiles)
    return record


def format_report(record: dict[str, Any]) -> str:
    lines = [f"prefix caching, {record['model']}: {record['workload']['num_requests']} requests, "
             f"{record['settings']['prefix_len']}-token shared prefix"]
    lines.append("| arrivals | caching | out tok/s | TTFT p50 ms | TTFT p99 ms | prompt tokens computed |")
    lines.append("|---|---|---|---|---|---|")
    for key, label in (("at_t0", "t=0"), ("poisson", f"Poisson {record.get('poisson', {}).get('rate')}/s")):
        if key not in record:
            continue
        for mode in ("on", "off"):
            r = record[key][mode]
            s = r["summary"]
            lines.append(f"| {label} | {mode} | {s['output_tokens_per_s']:.1f} | {s['ttft_ms']['p50']:.0f} | "
                         f"{s['ttft_ms']['p99']:.0f} | {r['prompt_tokens_computed']} of {r['prompt_tokens']} |")
        p = record[key]
        lines.append(f"| {label} | on/off | {p['throughput_ratio']:.2f}x | {p['ttft_p50_ratio']:.1f}x lower | "
                     f"{p['ttft_p99_ratio']:.1f}x lower | |")
    if "n_samples" in record:
        n = record["n_samples"]
        lines.append(f"n={n['on']['n']}: {n['on']['prefills']:.2f} prefills with caching, "
                     f"{n['off']['prefills']:.2f} without")
    if "no_sharing" in record:
        m = record["no_sharing"]["median_output_tokens_per_s"]
        host = record["no_sharing"]["scheduler_seconds_per_step"]
        lines.append(f"no sharing (Orca's trace): on {m['on']:.1f} / off {m['off']:.1f} tok/s, "
                     f"caching costs {100 * record['no_sharing']['cost_of_caching']:.1f}% (noise included); "
                     f"on the host {1e6 * host['on']:.0f} vs {1e6 * host['off']:.0f} us per step, "
                     f"{100 * record['no_sharing']['host_cost_of_caching']:.2f}% of a step")
    lines.append(f"XLA compiles during the runs: {record['xla_compiles_during_runs']}")
    return "\n".join(lines)
