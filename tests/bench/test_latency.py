"""Normalized latency, run summaries and curve interpolation on hand-made numbers."""

from __future__ import annotations

import pytest

from orca_jax.bench.latency import (CurvePoint, RequestTiming, curve_from_runs, percentile, summarize,
                                    throughput_at_latency, throughput_ratio_at_latency)


def test_request_timing_arithmetic():
    t = RequestTiming(arrival=10.0, first_token=10.5, finish=12.0, num_output_tokens=4)
    assert t.e2e == 2.0 and t.ttft == 0.5
    assert t.normalized_latency == 0.5  # 2 s over 4 tokens
    assert t.tpot == pytest.approx(0.5)  # 1.5 s over the 3 tokens after the first
    assert RequestTiming(0.0, 1.0, 1.0, 1).tpot is None


def test_summarize_hand_made_run():
    timings = [
        RequestTiming(0.0, 0.1, 1.0, 10),  # 100 ms/token
        RequestTiming(1.0, 1.2, 2.0, 5),  # 200 ms/token
        RequestTiming(2.0, 2.5, 5.0, 1),  # 3000 ms/token, no TPOT
        RequestTiming(3.0, 3.1, 3.4, 4),  # 100 ms/token
    ]
    s = summarize(timings)
    assert s["duration_s"] == 5.0  # first arrival to last finish
    assert s["requests_per_s"] == pytest.approx(0.8) and s["output_tokens_per_s"] == pytest.approx(4.0)
    assert s["normalized_latency_ms"]["p50"] == pytest.approx(150.0)  # between 100 and 200
    assert s["normalized_latency_ms"]["mean"] == pytest.approx(850.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(150.0)
    # TPOT over the three multi-token requests: 100, 200, 100 ms.
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0) and s["tpot_ms"]["mean"] == pytest.approx(400 / 3)
    assert "itl_ms" not in s
    with pytest.raises(ValueError):
        summarize([])


def test_inter_token_latency_from_token_times():
    s = summarize([RequestTiming(0.0, 0.1, 0.4, 3, (0.1, 0.2, 0.4)), RequestTiming(0.0, 0.3, 0.3, 1, (0.3,))])
    assert s["itl_ms"]["p50"] == pytest.approx(150.0) and s["itl_ms"]["mean"] == pytest.approx(150.0)


def test_percentile_interpolates_and_skips_missing():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([None, 5.0], 99) == 5.0
    assert percentile([], 50) is None


CURVE = [CurvePoint(rate=1, throughput=1.0, latency=50), CurvePoint(2, 2.0, 60),
         CurvePoint(4, 3.0, 100), CurvePoint(8, 3.2, 400)]


def test_throughput_at_latency_interpolates_inside_the_crossing_segment():
    assert throughput_at_latency(CURVE, 80) == (pytest.approx(2.5), "interpolated")
    assert throughput_at_latency(CURVE, 250) == (pytest.approx(3.1), "interpolated")
    assert throughput_at_latency(CURVE, 50) == (1.0, "interpolated")
    assert throughput_at_latency(list(reversed(CURVE)), 80)[0] == pytest.approx(2.5)  # sorted by rate


def test_throughput_at_latency_outside_the_curve():
    assert throughput_at_latency(CURVE, 40) == (None, "below_curve")
    assert throughput_at_latency(CURVE, 1000) == (3.2, "beyond_sweep")


def test_first_crossing_wins_on_a_noisy_curve():
    noisy = [CurvePoint(1, 1.0, 50), CurvePoint(2, 2.0, 120), CurvePoint(3, 2.5, 90), CurvePoint(4, 2.8, 300)]
    assert throughput_at_latency(noisy, 100)[0] == pytest.approx(1 + 50 / 70)


def test_ratio_at_latency():
    slow = [CurvePoint(0.5, 0.5, 55), CurvePoint(1, 0.9, 120), CurvePoint(2, 1.0, 500)]
    r = throughput_ratio_at_latency(CURVE, slow, 100)
    assert r["fast_requests_per_s"] == pytest.approx(3.0)
    assert r["slow_requests_per_s"] == pytest.approx(0.5 + 0.4 * 45 / 65)
    assert r["ratio"] == pytest.approx(3.0 / (0.5 + 0.4 * 45 / 65))
    assert throughput_ratio_at_latency(CURVE, slow, 52)["ratio"] is None  # slow curve never that fast


def test_curve_from_runs_reads_median_normalized_latency():
    runs = [{"rate": 2.0, "summary": {"requests_per_s": 1.9, "normalized_latency_ms": {"p50": 70.0}}}]
    assert curve_from_runs(runs) == [CurvePoint(2.0, 1.9, 70.0)]
