"""`orca-jax bench simulate`: Orca's experiment at the paper's scale, without the model.

The engine's own step halves (`orca_jax.engine.step.dispatch_step` / `complete_step`: the real
`Scheduler`, `PageAllocator` and postprocess) run on a virtual clock, with a runner that
stands in for the model (`ZeroTokenRunner`: every sampled token is 0, EOS is ignored).
Everything the scheduler decides (admission, chunking, page allocation, preemption, the
request-level batch boundaries, which sequences a batch may hold while others are in flight)
is the engine's own code; only the model is replaced.

The event model is Orca's pipeline (section 4.2, Algorithm 1). The cost model's
`pipeline_parallel` = P stages each run their share of the layers (`CostModel.stage_times`),
and up to `batches_in_flight` batches (default P, one per stage, as Orca) are in flight:

- The host dispatches a batch whenever fewer than that are in flight and the scheduler
  returns a non-empty one (the scheduler is built with `pipeline_parallel_size=P`, so it never
  puts a sequence into a batch while the sequence is in one in flight). Dispatching costs the
  host `step_overhead_s`, after which the batch reaches stage 0.
- Stage s of a batch starts at max(its arrival at stage s, the end of stage s's previous
  batch) and takes stage_times[s]; the activations reach stage s + 1 `hop_time` later.
- A batch returns when it leaves the last stage: `complete_step` postprocesses it (tokens
  appended, requests finished, its sequences schedulable again) at that time.
- When nothing more can be dispatched, the clock moves to the earliest return or arrival;
  the requests whose arrival time has passed join the scheduler before each dispatch.

With one batch in flight (`batches_in_flight=1`) a batch crosses every stage before the next
is scheduled, and each step takes `CostModel.step_time` (the simulator before pipelining).

Timings are in virtual seconds, so the summaries and curves are those of latency.py and the
headlines are read as in `bench orca`, here at Orca's 190 ms/token next to the paper's 36.9x:
iteration-level against "request" (static batches, selective batching kept) and against
"request_padded" (FasterTransformer as Orca measured it: prompts padded, finished slots
computed until the batch ends).
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from orca_jax.bench.cost_model import CostModel, StepWork
from orca_jax.bench.driver import BatchReturns, holds_until_batch_ends
from orca_jax.bench.latency import RequestTiming, summarize
from orca_jax.bench.orca import BASELINE_KEYS, POLICIES, analyze
from orca_jax.bench.trace import Trace, make_trace
from orca_jax.worker.sampling import SampleOutput
from orca_jax.engine.step import Ready, complete_step, dispatch_step

# Orca, section 6.2, GPT-3 175B on 16 A100s: at a median normalized latency of 190 ms/token,
# 6.81 requests/s for Orca against 0.185 for FasterTransformer.
PAPER = {"slo_ms_per_token": 190.0, "orca_requests_per_s": 6.81, "fastertransformer_requests_per_s": 0.185,
         "ratio": 36.9}
DEFAULT_RATES = (0.05, 0.1, 0.2, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0)


def scheduler_for(cost: CostModel, policy: str, max_model_len: int, num_pages: int | None = None):
    """The engine's scheduler and page pool, sized as the cost model's engine, for a model of
    the cost model's shape (GPT-3 style: multi-head attention, a 4x MLP), with the cost model's
    pipeline stages (`pipeline_parallel_size`: Orca's rule on sequences in flight)."""
    from orca_jax.config import EngineConfig, ModelConfig
    from orca_jax.core.kv_cache import PageAllocator
    from orca_jax.core.scheduler import Scheduler

    e, m = cost.engine, cost.model
    model = ModelConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                        intermediate_size=4 * m["hidden_size"], num_layers=m["num_layers"], num_heads=m["num_heads"],
                        num_kv_heads=m["num_heads"], head_dim=m["hidden_size"] // m["num_heads"],
                        max_position_embeddings=max_model_len, model_type="gpt2", hidden_act="gelu_new")
    config = EngineConfig(max_num_seqs=e["max_num_seqs"], max_num_batched_tokens=e["max_num_batched_tokens"],
                          page_size=e["page_size"], num_pages=num_pages or cost.kv_pool_pages() + 1,
                          max_model_len=max_model_len, scheduling=policy,
                          pipeline_parallel_size=cost.num_stages,
                          # The trace holds lengths only (every prompt token is 0, as is every
                          # sampled one), so caching would share what Orca's requests never do.
                          enable_prefix_caching=False).resolve(model)
    return Scheduler(config, PageAllocator(config.num_pages, config.page_size))


def step_work(scheduled) -> StepWork:
    """FLOP and byte counts of one step (a `ScheduledBatch`, or anything with `.scheduled`):
    its new tokens, the cached tokens they read, the query-key pairs, and the rows that
    produce a token (every sampling row: a token of a sequence finished meanwhile is still
    computed, then discarded).

    Padding ("request_padded": `ScheduledBatch.num_padding_tokens`, tokens the step computes
    beyond its real ones) is charged as computed tokens, approximated as follows:
    - a step with a prefill row (FasterTransformer's padded prompts): each row is padded up to
      the longest row's end, and a padded position attends causally to all positions before it,
      as a real one would (pairs L(L+1)/2 - n(n+1)/2 for a row of n tokens padded to L;
      scaled to the padding reported when it is not that rectangle). Padded positions write
      KV (they count as new tokens) but produce no logits.
    - a decode step: each padding token is a finished member's slot, still computed until the
      batch ends. It reads as much KV as the step's longest real context (in FasterTransformer
      every member of a padded batch sits at the same position: the longest prompt plus the
      steps so far), writes one token of KV, and runs the LM head."""
    scheduled = getattr(scheduled, "scheduled", scheduled)
    new = kv_read = pairs = 0
    for n_new, cached in zip(scheduled.num_new, scheduled.starts):
        new += n_new
        kv_read += cached
        pairs += n_new * cached + n_new * (n_new + 1) // 2  # causal within the new tokens
    logit_rows = sum(scheduled.samples)
    pad = getattr(scheduled, "num_padding_tokens", 0)
    if pad:
        if any(n > 1 for n in scheduled.num_new):  # padded prompts (prefill)
            ends = [c + n for n, c in zip(scheduled.num_new, scheduled.starts)]
            longest = max(ends)
            rect = sum(longest - e for e in ends)
            rect_pairs = sum(longest * (longest + 1) // 2 - e * (e + 1) // 2 for e in ends)
            pairs += rect_pairs if rect == pad else (rect_pairs * pad // rect if rect else pad * longest)
        else:  # finished members' slots in decode steps
            context = max(scheduled.starts, default=0)
            kv_read += pad * context
            pairs += pad * (context + 1)
            logit_rows += pad
        new += pad
    return StepWork(new, kv_read, pairs, logit_rows)


class ZeroTokenRunner:
    """The model's stand-in: token 0 for every row (EOS is ignored), no log-probabilities."""

    def dispatch(self, scheduled):
        S = len(scheduled)
        return Ready(SampleOutput(tokens=np.zeros(S, np.int32), logprobs=np.zeros(S, np.float32),
                            top_ids=np.zeros((S, 0), np.int32), top_logprobs=np.zeros((S, 0), np.float32)))


@dataclasses.dataclass
class _Pipeline:
    """The stages' timeline: when each is next free, how long each has been busy."""

    cost: CostModel
    free_at: list[float]
    busy_s: list[float]

    @classmethod
    def of(cls, cost: CostModel) -> _Pipeline:
        return cls(cost, [0.0] * cost.num_stages, [0.0] * cost.num_stages)

    def run(self, work: StepWork, reaches_first_stage: float) -> float:
        """Put a batch through every stage; the time it leaves the last one."""
        hop = self.cost.hop_time(work)
        arrives = reaches_first_stage
        for s, took in enumerate(self.cost.stage_times(work)):
            if s:
                arrives += hop
            self.free_at[s] = arrives = max(arrives, self.free_at[s]) + took
            self.busy_s[s] += took
        return arrives


def simulate_run(trace: Trace, cost: CostModel, policy: str, num_pages: int | None = None,
                 request_returns: str = "batch", batches_in_flight: int | None = None,
                 check_step=None) -> dict:
    """Replay `trace` on the virtual clock; the summary plus the scheduler's counters and the
    stages' busy time. `request_returns`: "batch" (FasterTransformer: a static batch's
    responses return together) or "early" (each when it finishes); iteration-level always
    returns each at once. `batches_in_flight`: at most this many batches in flight (default:
    the cost model's pipeline stages, Orca's; 1: each batch crosses every stage before the
    next is scheduled). `check_step(scheduler, in_flight)`, if given, is called after every
    dispatch with the steps in flight (tests)."""
    from orca_jax.core.sampling_params import SamplingParams
    from orca_jax.core.sequence import Sequence

    stages = cost.num_stages
    depth = stages if batches_in_flight is None else batches_in_flight
    if not 1 <= depth <= stages:
        raise ValueError(f"batches_in_flight must be between 1 and the {stages} pipeline stage(s), got {depth}")
    max_model_len = max(i + o for i, o in zip(trace.input_lens, trace.output_lens))
    scheduler = scheduler_for(cost, policy, max(max_model_len, trace.input_range[1] + trace.output_range[1]), num_pages)
    n, now, next_request, steps = trace.num_requests, 0.0, 0, 0
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    held = BatchReturns(holds_until_batch_ends(policy, request_returns))
    runner = ZeroTokenRunner()
    pipeline = _Pipeline.of(cost)
    in_flight: deque = deque()  # (InFlightStep, return time), in dispatch order = return order
    busy = covered_until = 0.0  # time with at least one batch in flight
    while next_request < n or scheduler.has_unfinished() or in_flight:
        while in_flight and in_flight[0][1] <= now:  # stages are FIFO: batches return in order
            step, returned = in_flight.popleft()
            result = complete_step(scheduler, step)
            for _, seq in result.advanced:
                first.setdefault(seq.seq_id, returned)
            finished = [seq.seq_id for seq in result.finished]
            for i in finished:
                finish[i] = returned
            held.after_step(finished, batch_running=bool(scheduler.running), now=returned, finish=finish)
        while next_request < n and trace.arrival_times[next_request] <= now:
            params = SamplingParams(max_tokens=trace.output_lens[next_request], ignore_eos=True)
            seq = Sequence(next_request, str(next_request), 0, [0] * trace.input_lens[next_request], params, 0)
            seq.arrival_time = trace.arrival_times[next_request]
            scheduler.add(seq)
            next_request += 1
        step = None
        if len(in_flight) < depth and scheduler.has_unfinished():
            step = dispatch_step(scheduler, runner)
        if step is not None:
            work = step_work(step.scheduled)
            returned = pipeline.run(work, now + cost.step_overhead_s)
            if depth == 1:  # alone on the stages: the same time, summed as step_time sums it
                returned = now + cost.step_time(work)
            busy += returned - max(now, covered_until)
            covered_until = returned
            in_flight.append((step, returned))
            steps += 1
            now += cost.step_overhead_s  # the host is busy dispatching
            if check_step is not None:
                check_step(scheduler, [s for s, _ in in_flight])
            continue
        # Nothing (more) to dispatch: wait for the earliest return, or arrival if one could go.
        upcoming = [in_flight[0][1]] if in_flight else []
        if next_request < n and len(in_flight) < depth:
            upcoming.append(trace.arrival_times[next_request])
        if not upcoming:
            if not scheduler.has_unfinished():
                break  # the last batch has returned
            raise RuntimeError(f"{policy}: the scheduler returned an empty step with requests waiting "
                               "(a request larger than the KV pool?)")
        now = max(now, min(upcoming))
    if scheduler.allocator.num_used:
        raise RuntimeError(f"{policy}: {scheduler.allocator.num_used} pages in use after the run")
    timings = [RequestTiming(trace.arrival_times[i], first[i], finish[i], trace.output_lens[i]) for i in range(n)]
    summary = summarize(timings)
    return {"summary": summary, "engine_steps": steps, "preemptions": scheduler.num_preemptions,
            "busy_s": busy, "num_pages": scheduler.config.num_pages, "batches_in_flight": depth,
            "stage_busy_s": pipeline.busy_s,
            "stage_busy_fraction": [b / summary["duration_s"] for b in pipeline.busy_s]}


def run_simulation(cost: CostModel, *, rates=DEFAULT_RATES, num_requests: int = 1000, scale: float = 1.0,
                   seed: int = 0, slo_ms_per_token: float = PAPER["slo_ms_per_token"], num_pages: int | None = None,
                   request_returns: str = "batch", batches_in_flight: int | None = None, policies=POLICIES,
                   command: str = "", progress=print) -> dict:
    """Every policy at every rate on the same requests; the JSON record."""
    from orca_jax.bench.environment import record_header
    from orca_jax.bench.orca import format_run

    depth = cost.num_stages if batches_in_flight is None else batches_in_flight
    base = make_trace(num_requests, scale, seed)
    runs = []
    for rate in sorted(rates):
        trace = base.with_arrivals(rate, seed)
        for policy in policies:
            record = {"policy": policy, "rate": rate,
                      **simulate_run(trace, cost, policy, num_pages, request_returns, depth),
                      "xla_compiles_during_run": 0}
            runs.append(record)
            progress(format_run(record) + ", stages busy "
                     + "/".join(f"{f:.0%}" for f in record["stage_busy_fraction"]))
    return {
        **record_header("simulate", command),
        "settings": {"rates": list(rates), "num_requests": num_requests, "scale": scale, "seed": seed,
                     "num_pages": num_pages, "request_returns": request_returns, "batches_in_flight": depth,
                     "pipeline_stages": cost.num_stages, "policies": list(policies)},
        "cost_model": cost.describe(),
        "trace": base.describe(),
        "runs": runs,
        # Curves, and iteration-level over each baseline at the SLO ("headline" over "request",
        # "headline_padded" over "request_padded") and at multiples of the unloaded latency
        # ("ratios", "ratios_padded"), as `bench orca` reports them.
        **analyze(runs, tuple(policies), slo_ms_per_token),
        "paper": PAPER,
    }


def format_report(record: dict) -> str:
    from orca_jax.bench.orca import format_ratio, format_table

    d = record["cost_model"]["derived"]
    p = record["paper"]
    settings = record["settings"]
    lines = [
        f"cost model: {record['cost_model']['description']} ({d['num_params'] / 1e9:.1f}B params, "
        f"{d['weight_bytes_per_gpu'] / 1e9:.1f} GB weights per GPU, KV pool {d['kv_pool_tokens']} tokens)",
        f"pipeline: {settings['pipeline_stages']} stage(s), "
        f"at most {settings['batches_in_flight']} batch(es) in flight",
        f"trace: {record['trace']}", "", format_table(record["runs"]), "",
        "pipeline stages busy (busy time / makespan, stage by stage) at each rate (req/s):",
        *(f"  {policy:>14}: " + ", ".join(f"{r['rate']:g}: " + "/".join(f"{f:.0%}" for f in r["stage_busy_fraction"])
                                          for r in runs)
          for policy, runs in _by_policy(record["runs"]).items()), "",
        f"unloaded median normalized latency (iteration-level, lowest median): "
        f"{record['unloaded_latency_ms_per_token']:.1f} ms/token",
    ]
    for slow, (headline, ratios) in BASELINE_KEYS.items():
        if headline in record:
            lines += [f"ratios over {slow} at other latencies: "
                      + "; ".join(format_ratio(h, slow=slow) for h in record[ratios]),
                      f"SIMULATED: iteration-level / {slow} throughput " + format_ratio(record[headline], slow=slow)]
    lines.append(f"PAPER (Orca vs FasterTransformer, GPT-3 175B, 16 A100): at {p['slo_ms_per_token']:.0f} ms/token "
                 f"{p['orca_requests_per_s']} vs {p['fastertransformer_requests_per_s']} req/s -> {p['ratio']}x")
    return "\n".join(lines)


def _by_policy(runs: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for r in sorted(runs, key=lambda r: r["rate"]):
        by.setdefault(r["policy"], []).append(r)
    return by
