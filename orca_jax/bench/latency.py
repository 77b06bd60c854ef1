"""Latency arithmetic: per-request timings, Orca's normalized latency, run summaries, and the
interpolation behind the headline ("throughput of A over B at the same median normalized
latency").

Orca's metric (section 6.1): *normalized latency* is a request's end-to-end latency divided by
the number of tokens it generated (ms/token), so that short and long requests weigh alike; a
curve plots its median against throughput as the arrival rate grows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class RequestTiming:
    """One request's clock readings (seconds, any common origin)."""

    arrival: float  # when it arrived (its scheduled arrival, not when the host got to it)
    first_token: float  # when its first generated token was available
    finish: float  # when its last token was available
    num_output_tokens: int
    token_times: tuple[float, ...] = ()  # every token's time, when measured (for inter-token latency)

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def normalized_latency(self) -> float:
        """End-to-end latency per generated token (Orca's metric), in seconds per token."""
        return self.e2e / self.num_output_tokens

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a one-token request."""
        if self.num_output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.num_output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation between order statistics); None if empty."""
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def _distribution_ms(values: Sequence[float | None]) -> dict[str, float | None]:
    present = [v for v in values if v is not None]
    return {
        "mean": _ms(float(np.mean(present))) if present else None,
        "p50": _ms(percentile(present, 50)),
        "p90": _ms(percentile(present, 90)),
        "p99": _ms(percentile(present, 99)),
    }


def inter_token_latencies(timings: Sequence[RequestTiming]) -> list[float]:
    """Gaps between consecutive tokens of each request (needs `token_times`)."""
    gaps = []
    for t in timings:
        gaps.extend(np.diff(t.token_times).tolist())
    return gaps


def summarize(timings: Sequence[RequestTiming]) -> dict:
    """Throughput and latency of one run. Duration runs from the first arrival to the last
    finish, so idle time before the first request or after the last is not counted and an
    overloaded run's backlog is. Latencies are in ms (normalized latency in ms/token)."""
    if not timings:
        raise ValueError("no requests to summarize")
    start = min(t.arrival for t in timings)
    duration = max(t.finish for t in timings) - start
    out_tokens = sum(t.num_output_tokens for t in timings)
    summary = {
        "num_requests": len(timings),
        "output_tokens": out_tokens,
        "duration_s": duration,
        "requests_per_s": len(timings) / duration if duration > 0 else math.inf,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else math.inf,
        "normalized_latency_ms": _distribution_ms([t.normalized_latency for t in timings]),
        "ttft_ms": _distribution_ms([t.ttft for t in timings]),
        "tpot_ms": _distribution_ms([t.tpot for t in timings]),
        "e2e_ms": _distribution_ms([t.e2e for t in timings]),
    }
    if any(t.token_times for t in timings):
        summary["itl_ms"] = _distribution_ms(inter_token_latencies(timings))
    return summary


# ---- curves and the headline --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CurvePoint:
    rate: float  # offered load, requests/s
    throughput: float  # achieved, requests/s
    latency: float  # median normalized latency, ms/token


def throughput_at_latency(curve: Sequence[CurvePoint], latency: float) -> tuple[float | None, str]:
    """The throughput a policy sustains while its median normalized latency is `latency`.

    Walks the curve in order of offered rate and interpolates linearly (throughput against
    latency) inside the first segment whose latencies straddle `latency`: the first crossing,
    the conservative reading of a noisy curve. Returns (throughput, how):
      "interpolated"  found on the curve;
      "below_curve"   even the lightest load measured is slower: no throughput qualifies (None);
      "beyond_sweep"  the curve never got this slow: the sweep's highest throughput, a lower
                      bound (the sweep should go to higher rates)."""
    points = sorted(curve, key=lambda p: p.rate)
    if not points:
        raise ValueError("empty curve")
    if latency < points[0].latency:
        return None, "below_curve"
    for lo, hi in zip(points, points[1:]):
        if lo.latency <= latency <= hi.latency:
            if hi.latency == lo.latency:
                return max(lo.throughput, hi.throughput), "interpolated"
            frac = (latency - lo.latency) / (hi.latency - lo.latency)
            return lo.throughput + frac * (hi.throughput - lo.throughput), "interpolated"
    if latency == points[0].latency:
        return points[0].throughput, "interpolated"
    return max(p.throughput for p in points), "beyond_sweep"


def throughput_ratio_at_latency(fast: Sequence[CurvePoint], slow: Sequence[CurvePoint], latency: float) -> dict:
    """Throughput of `fast` over `slow` at one median normalized latency (ms/token)."""
    fast_tp, fast_how = throughput_at_latency(fast, latency)
    slow_tp, slow_how = throughput_at_latency(slow, latency)
    ratio = fast_tp / slow_tp if fast_tp is not None and slow_tp else None
    return {"latency_ms_per_token": latency, "fast_requests_per_s": fast_tp, "fast_how": fast_how,
            "slow_requests_per_s": slow_tp, "slow_how": slow_how, "ratio": ratio}


def curve_from_runs(runs: Sequence[dict]) -> list[CurvePoint]:
    """Curve points from run records ({"rate", "summary"}) of one policy."""
    return [CurvePoint(r["rate"], r["summary"]["requests_per_s"], r["summary"]["normalized_latency_ms"]["p50"])
            for r in runs]
