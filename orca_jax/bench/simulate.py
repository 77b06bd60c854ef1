"""`orca-jax bench simulate`: Orca's experiment at the paper's scale, without the model.

The engine's own step (`orca_jax.step.run_step`: the real `Scheduler`, `PageAllocator`
and postprocess) runs on a virtual clock, with a runner that stands in for the
model (`ZeroTokenRunner`: every sampled token is 0, EOS is ignored). Before each step the
requests whose arrival time has passed join the scheduler; each step advances the clock by the
cost model's step time (cost_model.py) for the batch it ran; postprocess appends a token to
every sequence that completed its tokens and retires one that reached its drawn length.
Everything the scheduler decides (admission, chunking, page allocation, preemption, the
request-level batch boundaries) is the engine's own code; only the model is replaced.

Timings are in virtual seconds, so the summaries and curves are those of latency.py and the
headline is read as in `bench orca`, here at Orca's 190 ms/token next to the paper's 36.9x.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from orca_jax.bench.cost_model import CostModel, StepWork
from orca_jax.bench.driver import BatchReturns
from orca_jax.bench.latency import RequestTiming, curve_from_runs, summarize, throughput_ratio_at_latency
from orca_jax.bench.orca import POLICIES, RATIO_FACTORS
from orca_jax.bench.trace import Trace, make_trace
from orca_jax.sampling import SampleOutput
from orca_jax.step import Ready, run_step

# Orca, section 6.2, GPT-3 175B on 16 A100s: at a median normalized latency of 190 ms/token,
# 6.81 requests/s for Orca against 0.185 for FasterTransformer.
PAPER = {"slo_ms_per_token": 190.0, "orca_requests_per_s": 6.81, "fastertransformer_requests_per_s": 0.185,
         "ratio": 36.9}
DEFAULT_RATES = (0.05, 0.1, 0.2, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0)


def scheduler_for(cost: CostModel, policy: str, max_model_len: int, num_pages: int | None = None):
    """The engine's scheduler and page pool, sized as the cost model's engine, for a model of
    the cost model's shape (GPT-3 style: multi-head attention, a 4x MLP)."""
    from orca_jax.config import EngineConfig, ModelConfig
    from orca_jax.kv_cache import PageAllocator
    from orca_jax.scheduler import Scheduler

    e, m = cost.engine, cost.model
    model = ModelConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                        intermediate_size=4 * m["hidden_size"], num_layers=m["num_layers"], num_heads=m["num_heads"],
                        num_kv_heads=m["num_heads"], head_dim=m["hidden_size"] // m["num_heads"],
                        max_position_embeddings=max_model_len, model_type="gpt2", hidden_act="gelu_new")
    config = EngineConfig(max_num_seqs=e["max_num_seqs"], max_num_batched_tokens=e["max_num_batched_tokens"],
                          page_size=e["page_size"], num_pages=num_pages or cost.kv_pool_pages() + 1,
                          max_model_len=max_model_len, scheduling=policy,
                          # The trace holds lengths only (every prompt token is 0, as is every
                          # sampled one), so caching would share what Orca's requests never do.
                          enable_prefix_caching=False).resolve(model)
    return Scheduler(config, PageAllocator(config.num_pages, config.page_size))


def step_work(result) -> StepWork:
    """FLOP and byte counts of one step (`orca_jax.step.StepResult`): its new tokens, the
    cached tokens they read, and the rows that produced a token."""
    new = kv_read = pairs = 0
    for n_new, cached in zip(result.scheduled.num_new, result.scheduled.starts):
        new += n_new
        kv_read += cached
        pairs += n_new * cached + n_new * (n_new + 1) // 2  # causal within the new tokens
    return StepWork(new, kv_read, pairs, len(result.advanced))


class ZeroTokenRunner:
    """The model's stand-in: token 0 for every row (EOS is ignored), no log-probabilities."""

    def dispatch(self, scheduled):
        S = len(scheduled)
        return Ready(SampleOutput(tokens=np.zeros(S, np.int32), logprobs=np.zeros(S, np.float32),
                            top_ids=np.zeros((S, 0), np.int32), top_logprobs=np.zeros((S, 0), np.float32)))


def simulate_run(trace: Trace, cost: CostModel, policy: str, num_pages: int | None = None,
                 request_returns: str = "batch") -> dict:
    """Replay `trace` on the virtual clock; the summary plus the scheduler's counters.
    `request_returns`: "batch" (FasterTransformer: a static batch's responses return together)
    or "early" (each when it finishes); iteration-level always returns each at once."""
    from orca_jax import SamplingParams
    from orca_jax.sequence import Sequence

    max_model_len = max(i + o for i, o in zip(trace.input_lens, trace.output_lens))
    scheduler = scheduler_for(cost, policy, max(max_model_len, trace.input_range[1] + trace.output_range[1]), num_pages)
    n, now, next_request, steps, busy = trace.num_requests, 0.0, 0, 0, 0.0
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    held = BatchReturns(policy == "request" and request_returns == "batch")
    runner = ZeroTokenRunner()
    while next_request < n or scheduler.has_unfinished():
        while next_request < n and trace.arrival_times[next_request] <= now:
            params = SamplingParams(max_tokens=trace.output_lens[next_request], ignore_eos=True)
            seq = Sequence(next_request, str(next_request), 0, [0] * trace.input_lens[next_request], params, 0)
            seq.arrival_time = trace.arrival_times[next_request]
            scheduler.add(seq)
            next_request += 1
        if not scheduler.has_unfinished():
            now = trace.arrival_times[next_request]  # idle: jump to the next arrival
            continue
        result = run_step(scheduler, runner)
        if result is None:
            raise RuntimeError(f"{policy}: the scheduler returned an empty step with requests waiting "
                               "(a request larger than the KV pool?)")
        duration = cost.step_time(step_work(result))
        now, busy, steps = now + duration, busy + duration, steps + 1
        for _, seq in result.advanced:
            first.setdefault(seq.seq_id, now)
        finished = [seq.seq_id for seq in result.finished]
        for i in finished:
            finish[i] = now
        held.after_step(finished, batch_running=bool(scheduler.running), now=now, finish=finish)
    if scheduler.allocator.num_used:
        raise RuntimeError(f"{policy}: {scheduler.allocator.num_used} pages in use after the run")
    timings = [RequestTiming(trace.arrival_times[i], first[i], finish[i], trace.output_lens[i]) for i in range(n)]
    return {"summary": summarize(timings), "engine_steps": steps, "preemptions": scheduler.num_preemptions,
            "busy_s": busy, "num_pages": scheduler.config.num_pages}


def run_simulation(cost: CostModel, *, rates=DEFAULT_RATES, num_requests: int = 1000, scale: float = 1.0,
                   seed: int = 0, slo_ms_per_token: float = PAPER["slo_ms_per_token"], num_pages: int | None = None,
                   request_returns: str = "batch", command: str = "", progress=print) -> dict:
    """Both policies at every rate on the same requests; the JSON record."""
    from orca_jax.bench.environment import now_utc
    from orca_jax.bench.orca import format_run

    base = make_trace(num_requests, scale, seed)
    runs = []
    for rate in sorted(rates):
        trace = base.with_arrivals(rate, seed)
        for policy in POLICIES:
            record = {"policy": policy, "rate": rate, **simulate_run(trace, cost, policy, num_pages, request_returns),
                      "xla_compiles_during_run": 0}
            runs.append(record)
            progress(format_run(record))
    curves = {p: curve_from_runs([r for r in runs if r["policy"] == p]) for p in POLICIES}
    unloaded = min(pt.latency for pt in curves["iteration"])
    return {
        "benchmark": "simulate", "date": now_utc(), "command": command,
        "settings": {"rates": list(rates), "num_requests": num_requests, "scale": scale, "seed": seed,
                     "num_pages": num_pages, "request_returns": request_returns},
        "cost_model": cost.describe(),
        "trace": base.describe(),
        "runs": runs,
        "curves": {p: [dataclasses.asdict(pt) for pt in c] for p, c in curves.items()},
        "slo_ms_per_token": slo_ms_per_token,
        "headline": throughput_ratio_at_latency(curves["iteration"], curves["request"], slo_ms_per_token),
        # The ratio depends on where the SLO sits on the curves: also at multiples of the
        # unloaded latency, as `bench orca` reports.
        "unloaded_latency_ms_per_token": unloaded,
        "ratios": [throughput_ratio_at_latency(curves["iteration"], curves["request"], f * unloaded)
                   for f in RATIO_FACTORS],
        "paper": PAPER,
    }


def format_report(record: dict) -> str:
    from orca_jax.bench.orca import format_ratio, format_table

    d = record["cost_model"]["derived"]
    p = record["paper"]
    return "\n".join([
        f"cost model: {record['cost_model']['description']} ({d['num_params'] / 1e9:.1f}B params, "
        f"{d['weight_bytes_per_gpu'] / 1e9:.1f} GB weights per GPU, KV pool {d['kv_pool_tokens']} tokens)",
        f"trace: {record['trace']}", "", format_table(record["runs"]), "",
        f"unloaded median normalized latency (iteration-level, lowest median): "
        f"{record['unloaded_latency_ms_per_token']:.1f} ms/token",
        "ratios at other latencies: " + "; ".join(format_ratio(h) for h in record["ratios"]),
        "SIMULATED: iteration-level / request-level throughput " + format_ratio(record["headline"]),
        f"PAPER (Orca vs FasterTransformer, GPT-3 175B, 16 A100): at {p['slo_ms_per_token']:.0f} ms/token "
        f"{p['orca_requests_per_s']} vs {p['fastertransformer_requests_per_s']} req/s -> {p['ratio']}x",
    ])
