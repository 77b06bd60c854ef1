"""Prometheus metrics of the server, all prefixed `orca_`.

Per-request numbers (finish reasons, latencies, token counts) are observed from the engine
thread as outputs arrive (`ServerMetrics.observe`). Engine state (queue lengths, KV pages,
preemptions) is read from the async engine's latest stats snapshot at scrape time by a custom
collector, so a scrape never touches the engine itself. Each server owns its registry: two
servers in one process (tests) do not share counters.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from orca_jax.engine.async_engine import EngineStats
from orca_jax.engine.outputs import RequestOutput

FINISH_REASONS = ("stop", "length", "abort", "error")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineStatsCollector:
    """The engine-state families. `stats` returns one EngineStats, or with data parallelism
    {replica index: EngineStats}: then every sample carries a `replica` label."""

    def __init__(self, stats: Callable[[], EngineStats | dict[int, EngineStats]],
                 routed: Callable[[], dict[tuple[int, str], int]] | None = None):
        self._stats = stats
        self._routed = routed

    def collect(self):
        stats = self._stats()
        per_replica = stats if isinstance(stats, dict) else None
        for family in self._families(per_replica if per_replica is not None else {None: stats}):
            yield family
        if self._routed is not None:
            routed = CounterMetricFamily("orca_dp_routed_requests", "Data parallelism: requests routed to each "
                                         "replica, by why (least_loaded, prefix, queue_full).",
                                         labels=["replica", "reason"])
            for (replica, reason), count in sorted(self._routed().items()):
                routed.add_metric([str(replica), reason], count)
            yield routed

    def _families(self, by_replica: dict):
        labels = ["replica"] if None not in by_replica else []
        gauge_rows, counter_rows = [], []
        for replica, stats in by_replica.items():
            gauges, counters = _engine_samples(stats)
            gauge_rows.append((replica, gauges))
            counter_rows.append((replica, counters))
        yield from _labelled(GaugeMetricFamily, gauge_rows, labels)
        yield from _labelled(CounterMetricFamily, counter_rows, labels)


def _labelled(kind, rows, labels):
    """One family per metric name, one sample per replica (unlabelled without replicas)."""
    for i, (name, doc, _) in enumerate(rows[0][1]):
        if not labels:
            yield kind(name, doc, value=rows[0][1][i][2])
            continue
        family = kind(name, doc, labels=labels)
        for replica, samples in rows:
            family.add_metric([str(replica)], samples[i][2])
        yield family


def _engine_samples(stats: EngineStats) -> tuple[list, list]:
    """(gauges, counters) of one engine: (name, help, value) each."""
    gauges = [
        ("orca_num_requests_running", "Requests with a sequence in the running batch.", stats.num_running),
        ("orca_num_requests_waiting", "Requests waiting for admission (including preempted ones).", stats.num_waiting),
        ("orca_kv_cache_usage_ratio", "Fraction of usable KV pages held by sequences (cached pages "
         "nobody holds count as free).", stats.kv_cache_usage),
        ("orca_kv_pages_used", "KV pages held by sequences.", stats.kv_pages_used),
        ("orca_kv_pages_total", "Usable KV pages.", stats.kv_pages_total),
        ("orca_prefix_cache_pages", "KV pages in the prefix cache (held or evictable).", stats.kv_pages_cached),
    ]
    # vLLM's mean acceptance length: tokens a verifying row emits on average (its accepted
    # drafts plus the target's own token); 0 before any row verified drafts.
    drafts = stats.spec_decode_num_drafts
    gauges.append(("orca_spec_decode_mean_acceptance_length", "Speculative decoding: mean tokens emitted per "
                   "row that verified drafts (1 + accepted / rows).",
                   1 + stats.spec_decode_num_accepted_tokens / drafts if drafts else 0.0))
    counters = [
        ("orca_num_preemptions", "Sequences preempted (to be recomputed).", stats.num_preemptions),
        ("orca_engine_steps", "Model steps run.", stats.num_steps),
        ("orca_prefix_cache_queries", "Tokens looked up in the prefix cache at admission.",
         stats.prefix_cache_queries),
        ("orca_prefix_cache_hits", "Tokens found in the prefix cache at admission.", stats.prefix_cache_hits),
        ("orca_spec_decode_num_drafts", "Speculative decoding: sequence rows that verified draft tokens.",
         stats.spec_decode_num_drafts),
        ("orca_spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
         stats.spec_decode_num_draft_tokens),
        ("orca_spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
         stats.spec_decode_num_accepted_tokens),
    ]
    return gauges, counters


class ServerMetrics:
    """`stats`: the engine's latest EngineStats, or {replica index: EngineStats} for
    data-parallel replicas (`routed` then gives the routing counts)."""

    def __init__(self, stats: Callable[[], EngineStats | dict[int, EngineStats]],
                 routed: Callable[[], dict[tuple[int, str], int]] | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("orca_requests", "Finished requests, by finish reason.", ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:  # export zeros, so rates work from the first scrape
            self.requests.labels(reason)
        self.rejected = Counter("orca_requests_rejected", "Requests refused before queueing, by reason.", ["reason"], registry=r)
        self.prompt_tokens = Counter("orca_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("orca_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("orca_time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("orca_time_per_output_token_seconds", "Mean time per generated token after the first, per request.",
                              buckets=_PER_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("orca_e2e_request_latency_seconds", "Time from arrival to finish.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineStatsCollector(stats, routed))
        # Per live request, tokens generated per sample so far: outputs may be deltas (streams),
        # so a request's length is summed from them rather than read from its last output.
        self._generated: dict[str, dict[int, int]] = {}

    def observe(self, output: RequestOutput) -> None:
        """Called with every engine output (on the engine thread)."""
        per_sample = self._generated.setdefault(output.request_id, {})
        for c in output.outputs:
            per_sample[c.index] = per_sample.get(c.index, 0) + len(c.delta_token_ids)
        self.generation_tokens.inc(sum(len(c.delta_token_ids) for c in output.outputs))
        if output.finished:
            self._observe_finished(output, max(self._generated.pop(output.request_id).values(), default=0))

    def _observe_finished(self, output: RequestOutput, generated: int) -> None:
        self.requests.labels(_finish_reason(output)).inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        if output.finish_time is None or output.arrival_time is None:
            return
        self.e2e.observe(output.finish_time - output.arrival_time)
        if output.first_token_time is None:
            return  # aborted or failed before its first token
        self.ttft.observe(output.first_token_time - output.arrival_time)
        if generated > 1:
            self.tpot.observe((output.finish_time - output.first_token_time) / (generated - 1))

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _finish_reason(output: RequestOutput) -> str:
    if output.error:
        return "error"
    reasons = [c.finish_reason for c in output.outputs]
    return "abort" if "abort" in reasons else (reasons[0] or "abort")
