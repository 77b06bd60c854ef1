"""`orca-jax bench orca`: Orca's experiment on the real engine, in-process.

The trace (trace.py) is replayed at each arrival rate of a sweep, for the scheduling policies
asked (`--policies`): `"iteration"` (Orca) against the static request-level baselines,
`"request"` (static batching with selective batching kept) and `"request_padded"`
(FasterTransformer as Orca measured it: padded prompts, finished slots computed until the batch
ends), with the same weights, the same max batch size and the same KV page pool. By default
iteration and request run (three compiled engines are slow on a 2-core CPU). Per rate and policy
it records throughput and latency (latency.py); per policy the points form a curve of median
normalized latency against throughput, and the headline is the throughput ratio of iteration's
curve over a baseline's at one median normalized latency (the SLO line), one per baseline run.

Every engine is built (and compiled) before any timing, and the policies take turns at each
rate, so noise from other jobs on a shared machine hits all alike.
"""

from __future__ import annotations

import dataclasses
import logging

from orca_jax.bench.driver import (check_pages_returned, decode_step_times, holds_until_batch_ends, run_open_loop,
                                   warm_up)
from orca_jax.bench.latency import curve_from_runs, summarize, throughput_ratio_at_latency
from orca_jax.bench.trace import ORCA_INPUT_RANGE, ORCA_OUTPUT_RANGE, Trace, make_trace, scaled_range

logger = logging.getLogger(__name__)

POLICIES = ("iteration", "request", "request_padded")
DEFAULT_POLICIES = ("iteration", "request")
# The baselines iteration-level is compared with, and the record's keys of each comparison.
BASELINE_KEYS = {"request": ("headline", "ratios"), "request_padded": ("headline_padded", "ratios_padded")}
BASELINE_TITLES = {"request": "request-level", "request_padded": "padded request-level (FasterTransformer)"}
# Without an SLO given, the headline latency is this multiple of the lowest median normalized
# latency measured for Orca's policy: "some slack over an unloaded server", the way Orca's
# 190 ms/token sits above GPT-3's unloaded per-token time.
DEFAULT_SLO_FACTOR = 2.0
# Extra latencies (multiples of that unloaded latency) at which the ratio is also reported, so
# the headline is not one cherry-picked point.
RATIO_FACTORS = (1.5, 2.0, 3.0, 5.0)
REQUEST_RETURNS = ("batch", "early")


@dataclasses.dataclass(frozen=True)
class SweepSettings:
    model: str | None = None
    scale: float = 0.25
    num_requests: int = 48
    rates: tuple[float, ...] = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)  # a 2-core CPU at scale 0.25
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    page_size: int = 16
    num_pages: int | None = None  # None: every sequence at full length fits (no preemption)
    dtype: str = "float32"
    seed: int = 0
    slo_ms_per_token: float | None = None
    policies: tuple[str, ...] = DEFAULT_POLICIES
    # "batch": request-level responses return together when their static batch ends, as with
    # FasterTransformer in Orca's experiment; "early": each as soon as it finishes.
    request_returns: str = "batch"
    # Orca's distributed setting on this machine's devices: stages x devices per stage.
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1

    def __post_init__(self):
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be positive, got {self.rates}")
        if unknown := [p for p in self.policies if p not in POLICIES]:
            raise ValueError(f"unknown policies {unknown}; choose from {POLICIES}")
        if self.request_returns not in REQUEST_RETURNS:
            raise ValueError(f"request_returns must be one of {REQUEST_RETURNS}, got {self.request_returns!r}")


def engine_settings(s: SweepSettings) -> dict:
    """Engine arguments shared by every policy. max_model_len is the trace's longest request
    (page-aligned), which keeps page tables small; the default pool holds max_num_seqs
    sequences at that length, plus the padding page, so no policy ever runs out."""
    longest = scaled_range(ORCA_INPUT_RANGE, s.scale)[1] + scaled_range(ORCA_OUTPUT_RANGE, s.scale)[1]
    max_model_len = -(-longest // s.page_size) * s.page_size
    num_pages = s.num_pages or s.max_num_seqs * (max_model_len // s.page_size) + 1
    return dict(model=s.model, dtype=s.dtype, max_num_seqs=s.max_num_seqs,
                max_num_batched_tokens=s.max_num_batched_tokens, page_size=s.page_size,
                num_pages=num_pages, max_model_len=max_model_len, seed=s.seed,
                pipeline_parallel_size=s.pipeline_parallel_size, tensor_parallel_size=s.tensor_parallel_size)


def build_engines(s: SweepSettings) -> dict:
    from orca_jax.engine.engine import LLMEngine

    common = engine_settings(s)
    return {policy: LLMEngine(scheduling=policy, **common) for policy in s.policies}


def trace_for(engine, s: SweepSettings) -> Trace:
    special = tuple(getattr(engine.tokenizer, "all_special_ids", ()) or ())
    return make_trace(s.num_requests, s.scale, s.seed, vocab_size=engine.model_config.vocab_size,
                      exclude_ids=special)


def timed_run(engine, trace: Trace, hold_until_batch_ends: bool = False) -> dict:
    """One open-loop run; the summary plus what the engine did (steps, preemptions, compiles)."""
    from orca_jax.worker.compile_guard import compile_count

    compiles, steps, preemptions = compile_count(), engine.num_steps, engine.scheduler.num_preemptions
    timings = run_open_loop(engine, trace, hold_until_batch_ends=hold_until_batch_ends)
    check_pages_returned(engine)
    summary = summarize(timings)
    return {
        "summary": summary,
        "engine_steps": engine.num_steps - steps,
        "preemptions": engine.scheduler.num_preemptions - preemptions,
        "xla_compiles_during_run": compile_count() - compiles,
    }


def run_sweep(s: SweepSettings, command: str = "", progress=print) -> dict:
    """Build every policy's engine, then for each rate run every policy; return the JSON record."""
    from orca_jax.bench.environment import now_utc, record_header

    started = now_utc()
    engines = build_engines(s)
    first = engines[s.policies[0]]
    base = trace_for(first, s)
    for engine in engines.values():
        warm_up(engine, base)
    batch_sizes = tuple(sorted({1, max(1, s.max_num_seqs // 4), s.max_num_seqs}))
    step_ms = {k: 1000 * v for k, v in decode_step_times(first, base, batch_sizes).items()}
    progress("decode step (ms) by batch size: " + ", ".join(f"{k}: {v:.1f}" for k, v in step_ms.items()))
    runs = []
    for rate in sorted(s.rates):
        trace = base.with_arrivals(rate, s.seed)
        for policy, engine in engines.items():
            hold = holds_until_batch_ends(policy, s.request_returns)
            record = {"policy": policy, "rate": rate, **timed_run(engine, trace, hold)}
            if record["xla_compiles_during_run"]:
                logger.warning("%s at %.3g req/s: %d XLA compile(s) during the timed run", policy, rate,
                               record["xla_compiles_during_run"])
            runs.append(record)
            progress(format_run(record))
    return {
        **record_header("orca", command, started),
        "settings": dataclasses.asdict(s),
        "engine": {**engine_settings(s), "token_buckets": list(first.config.token_buckets),
                   "attention_impl": first.attention_impl},
        "model": first.config.model or _default_model_name(),
        "trace": base.describe(),
        "decode_step_ms_by_batch_size": step_ms,
        "runs": runs,
        **analyze(runs, s.policies, s.slo_ms_per_token),
    }


def analyze(runs: list[dict], policies: tuple[str, ...], slo_ms_per_token: float | None) -> dict:
    """Curves per policy and, with iteration-level and a baseline, the throughput ratio of
    iteration over each baseline run at the SLO latency and at a few multiples of the unloaded
    latency: "headline"/"ratios" over "request", "headline_padded"/"ratios_padded" over
    "request_padded" (`BASELINE_KEYS`)."""
    curves = {p: curve_from_runs([r for r in runs if r["policy"] == p]) for p in policies}
    result: dict = {"curves": {p: [dataclasses.asdict(pt) for pt in c] for p, c in curves.items()}}
    baselines = [b for b in BASELINE_KEYS if b in curves]
    if "iteration" not in curves or not baselines:
        return result
    unloaded = min(pt.latency for pt in curves["iteration"])
    slo = slo_ms_per_token or DEFAULT_SLO_FACTOR * unloaded
    result["unloaded_latency_ms_per_token"] = unloaded
    result["slo_ms_per_token"] = slo
    result["slo_source"] = "given" if slo_ms_per_token else f"{DEFAULT_SLO_FACTOR} x unloaded iteration-level latency"
    for baseline in baselines:
        headline, ratios = BASELINE_KEYS[baseline]
        result[headline] = throughput_ratio_at_latency(curves["iteration"], curves[baseline], slo)
        result[ratios] = [throughput_ratio_at_latency(curves["iteration"], curves[baseline], f * unloaded)
                          for f in RATIO_FACTORS]
    return result


def _default_model_name() -> str:
    from orca_jax.loading.loader import default_model_path

    return str(default_model_path())


# ---- report ---------------------------------------------------------------------------------------
def format_run(r: dict) -> str:
    s = r["summary"]
    return (f"{r['policy']:>14} @ {r['rate']:6.3g} req/s: {s['requests_per_s']:6.3f} req/s, "
            f"{s['output_tokens_per_s']:7.1f} out tok/s, norm. latency p50 {s['normalized_latency_ms']['p50']:8.1f} "
            f"p90 {s['normalized_latency_ms']['p90']:8.1f} ms/tok, TTFT p50 {s['ttft_ms']['p50']:8.1f} ms, "
            f"{r['engine_steps']} steps, {r['xla_compiles_during_run']} compiles")


def format_table(runs: list[dict]) -> str:
    header = ("| policy | rate (req/s) | throughput (req/s) | out tok/s | norm. latency p50 (ms/tok) | p90 | "
              "TTFT p50 (ms) | TTFT p99 | TPOT p50 (ms) | TPOT p99 | steps | compiles |")
    lines = [header, "|" + " --- |" * (header.count("|") - 1)]
    for r in sorted(runs, key=lambda r: (r["policy"], r["rate"])):
        s = r["summary"]
        cells = [r["policy"], f"{r['rate']:g}", f"{s['requests_per_s']:.3f}", f"{s['output_tokens_per_s']:.1f}",
                 f"{s['normalized_latency_ms']['p50']:.1f}", f"{s['normalized_latency_ms']['p90']:.1f}",
                 f"{s['ttft_ms']['p50']:.0f}", f"{s['ttft_ms']['p99']:.0f}", _fmt(s["tpot_ms"]["p50"]),
                 _fmt(s["tpot_ms"]["p99"]), str(r["engine_steps"]), str(r["xla_compiles_during_run"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def format_ratio(h: dict, fast: str = "iteration", slow: str = "request") -> str:
    def side(tp, how):
        return "n/a" if tp is None else f"{tp:.3f}" + ("" if how == "interpolated" else f" ({how})")

    ratio = "n/a" if h["ratio"] is None else f"{h['ratio']:.1f}x"
    return (f"at {h['latency_ms_per_token']:.1f} ms/token: {fast} {side(h['fast_requests_per_s'], h['fast_how'])} "
            f"req/s, {slow} {side(h['slow_requests_per_s'], h['slow_how'])} req/s -> {ratio}")


def format_report(record: dict) -> str:
    lines = [f"model: {record['model']}", f"trace: {record['trace']}",
             "decode step (ms) by batch size: "
             + ", ".join(f"{k}: {v:.1f}" for k, v in record["decode_step_ms_by_batch_size"].items()),
             "", format_table(record["runs"])]
    baselines = [b for b, (headline, _) in BASELINE_KEYS.items() if headline in record]
    if baselines:
        lines += ["", f"unloaded median normalized latency (iteration-level, lowest median): "
                  f"{record['unloaded_latency_ms_per_token']:.1f} ms/token",
                  f"SLO {record['slo_ms_per_token']:.1f} ms/token ({record['slo_source']})"]
    for baseline in baselines:
        ratios = BASELINE_KEYS[baseline][1]
        lines.append(f"ratios over {baseline} at other latencies: "
                     + "; ".join(format_ratio(h, slow=baseline) for h in record[ratios]))
    for baseline in baselines:
        headline = BASELINE_KEYS[baseline][0]
        lines += ["", f"HEADLINE: iteration-level / {BASELINE_TITLES[baseline]} throughput "
                  + format_ratio(record[headline], slow=baseline)]
    return "\n".join(lines)
