"""The synthetic trace: Orca's length distributions (scaled), Poisson arrivals, seeding."""

from __future__ import annotations

import numpy as np
import pytest

from orca_jax.bench.trace import ORCA_INPUT_RANGE, ORCA_OUTPUT_RANGE, make_trace, poisson_arrival_times, scaled_range


def test_full_scale_lengths_are_uniform_over_orcas_ranges():
    trace = make_trace(20_000, scale=1.0, seed=1)
    assert (trace.input_range, trace.output_range) == (ORCA_INPUT_RANGE, ORCA_OUTPUT_RANGE)
    ins, outs = np.array(trace.input_lens), np.array(trace.output_lens)
    assert (ins.min(), ins.max(), outs.min(), outs.max()) == (32, 512, 1, 128)  # both ends are drawn
    # Uniform: mean at the midpoint, and each quarter of the range holds about a quarter.
    assert ins.mean() == pytest.approx(272, rel=0.02) and outs.mean() == pytest.approx(64.5, rel=0.02)
    quarters = np.histogram(ins, bins=4, range=(32, 513))[0] / len(ins)
    assert np.all(np.abs(quarters - 0.25) < 0.02)


def test_scale_shrinks_both_ranges_and_never_empties_them():
    assert scaled_range(ORCA_INPUT_RANGE, 0.25) == (8, 128)
    assert scaled_range(ORCA_OUTPUT_RANGE, 0.25) == (1, 32)
    assert scaled_range((1, 2), 0.01) == (1, 1)
    trace = make_trace(500, scale=0.5, seed=0)
    assert all(16 <= n <= 256 for n in trace.input_lens) and all(1 <= n <= 64 for n in trace.output_lens)
    with pytest.raises(ValueError):
        scaled_range(ORCA_INPUT_RANGE, 0)


def test_a_seed_names_one_workload():
    a = make_trace(50, 0.5, seed=3, vocab_size=100, exclude_ids=(0, 1, 2), rate=2.0)
    b = make_trace(50, 0.5, seed=3, vocab_size=100, exclude_ids=(0, 1, 2), rate=2.0)
    c = make_trace(50, 0.5, seed=4, vocab_size=100, exclude_ids=(0, 1, 2), rate=2.0)
    assert a == b
    assert a.input_lens != c.input_lens and a.arrival_times != c.arrival_times
    assert [len(p) for p in a.prompts] == a.input_lens
    assert all(3 <= t < 100 for p in a.prompts for t in p)  # special ids excluded


def test_other_rates_replay_the_same_requests():
    base = make_trace(100, 0.25, seed=7, vocab_size=64)
    slow, fast = base.with_arrivals(0.5, seed=7), base.with_arrivals(4.0, seed=7)
    assert slow.prompts == fast.prompts == base.prompts and slow.output_lens == base.output_lens
    assert (slow.rate, fast.rate) == (0.5, 4.0)
    # One seeded stream of exponential gaps, scaled by 1/rate: the schedules are proportional.
    assert np.allclose(np.array(slow.arrival_times), 8.0 * np.array(fast.arrival_times))
    assert base.arrival_times == [0.0] * 100 and base.rate is None


def test_poisson_arrivals_have_exponential_gaps_at_the_rate():
    times = np.array(poisson_arrival_times(20_000, rate=5.0, seed=0))
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() == pytest.approx(0.2, rel=0.05)  # exponential: std equals mean
    # Counts per one-second window are Poisson(5): variance about equal to the mean.
    counts = np.bincount(times.astype(int))[:-1]
    assert counts.mean() == pytest.approx(5.0, rel=0.03) and counts.var() == pytest.approx(5.0, rel=0.1)
    assert poisson_arrival_times(3, None, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrival_times(3, -1.0, 0)


def test_describe_counts_useful_tokens():
    trace = make_trace(10, 0.1, seed=2)
    d = trace.describe()
    assert d["useful_output_tokens"] == sum(trace.output_lens)
    assert d["useful_processed_tokens"] == sum(trace.input_lens) + sum(trace.output_lens)
