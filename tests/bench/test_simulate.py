"""`bench simulate`: the real scheduler and allocator on the cost model's clock."""

from __future__ import annotations

import json

import pytest

from orca_jax import cli
from orca_jax.bench.cost_model import load_cost_model
from orca_jax.bench.simulate import PAPER, simulate_run
from orca_jax.bench.trace import make_trace


@pytest.fixture(scope="module")
def gpt3():
    return load_cost_model("gpt3-175b-16xa100")


def test_every_request_runs_to_its_length_and_pages_come_back(gpt3):
    trace = make_trace(60, 1.0, seed=0, rate=4.0)
    for policy in ("iteration", "request"):
        run = simulate_run(trace, gpt3, policy)  # raises if a page is left in use
        s = run["summary"]
        assert s["num_requests"] == 60 and s["output_tokens"] == trace.useful_output_tokens
        assert s["duration_s"] >= run["busy_s"] - 1e-9  # every step lies between first arrival and last finish
        assert run["preemptions"] == 0


def test_unloaded_request_costs_one_prefill_and_its_decodes(gpt3):
    """One request alone: its latency is one prefill step plus (out - 1) decode steps."""
    trace = make_trace(1, 1.0, seed=5, rate=1.0)
    run = simulate_run(trace, gpt3, "iteration")
    out = trace.output_lens[0]
    assert run["engine_steps"] == out  # prompt in one step (budget 8192), then one token per step
    s = run["summary"]
    assert s["ttft_ms"]["p50"] == pytest.approx(s["e2e_ms"]["p50"] - (out - 1) * (s["tpot_ms"]["p50"] or 0))


def test_request_level_waits_for_the_batch_and_iteration_level_does_not(gpt3):
    """Under load the request-level policy runs fewer, fuller batches that wait for their
    longest member: higher median normalized latency at the same offered rate."""
    trace = make_trace(150, 1.0, seed=1, rate=5.0)
    iteration = simulate_run(trace, gpt3, "iteration")["summary"]
    request = simulate_run(trace, gpt3, "request")["summary"]
    assert request["normalized_latency_ms"]["p50"] > 1.5 * iteration["normalized_latency_ms"]["p50"]
    assert request["ttft_ms"]["p50"] > iteration["ttft_ms"]["p50"]


def test_a_small_pool_forces_preemption_and_smaller_batches(gpt3):
    trace = make_trace(20, 1.0, seed=2, rate=50.0)
    pages = -(-(512 + 128) // gpt3.engine["page_size"]) + 1  # one full-length sequence
    small = {p: simulate_run(trace, gpt3, p, num_pages=pages) for p in ("iteration", "request")}
    full = {p: simulate_run(trace, gpt3, p) for p in ("iteration", "request")}
    assert all(r["summary"]["num_requests"] == 20 for r in (*small.values(), *full.values()))
    assert small["iteration"]["preemptions"] > 0 == full["iteration"]["preemptions"]
    # Request-level reserves whole lengths up front: fewer fit, so more, smaller batches.
    assert small["request"]["engine_steps"] > full["request"]["engine_steps"]
    assert small["request"]["preemptions"] == 0


def test_bench_simulate_cli_writes_json_and_figure(tmp_path, capsys):
    out, fig = tmp_path / "sim.json", tmp_path / "sim.png"
    code = cli.main(["bench", "simulate", "--num-requests", "80", "--rates", "0.5,3,8", "--json", str(out),
                     "--plot", str(fig), "--quiet"])
    assert code == 0
    record = json.loads(out.read_text())
    assert {r["policy"] for r in record["runs"]} == {"iteration", "request"} and len(record["runs"]) == 6
    assert record["paper"] == PAPER and record["slo_ms_per_token"] == 190.0
    assert record["cost_model"]["derived"]["num_params"] == pytest.approx(175e9, rel=0.01)
    assert set(record["headline"]) >= {"ratio", "fast_requests_per_s", "slow_requests_per_s"}
    assert record["command"].startswith("orca-jax bench simulate") and "--rates 0.5,3.0,8.0" in record["command"]
    assert fig.stat().st_size > 10_000 and fig.read_bytes()[:4] == b"\x89PNG"
    assert "SIMULATED" in capsys.readouterr().out


def test_held_static_batches_return_with_their_longest_member(gpt3):
    """With FasterTransformer's returns, every request of a static batch ends when its longest
    member does, so normalized latency can only grow against returning early."""
    trace = make_trace(80, 1.0, seed=2, rate=2.0)
    held = simulate_run(trace, gpt3, "request", request_returns="batch")["summary"]
    early = simulate_run(trace, gpt3, "request", request_returns="early")["summary"]
    assert held["e2e_ms"]["p50"] > early["e2e_ms"]["p50"]
    assert held["normalized_latency_ms"]["p50"] > early["normalized_latency_ms"]["p50"]
    assert held["ttft_ms"] == early["ttft_ms"]  # the schedule itself is the same
