"""`bench simulate`: the real scheduler and allocator on the cost model's clock."""

from __future__ import annotations

import json

import pytest

from orca_jax import cli
from orca_jax.bench.cost_model import StepWork, load_cost_model
from orca_jax.bench.simulate import PAPER, simulate_run, step_work
from orca_jax.bench.trace import make_trace


@pytest.fixture(scope="module")
def gpt3():
    return load_cost_model("gpt3-175b-16xa100")


def test_every_request_runs_to_its_length_and_pages_come_back(gpt3):
    trace = make_trace(60, 1.0, seed=0, rate=4.0)
    for policy in ("iteration", "request", "request_padded"):
        for depth in (1, 2):
            run = simulate_run(trace, gpt3, policy, batches_in_flight=depth)  # raises if a page is left in use
            s = run["summary"]
            assert s["num_requests"] == 60 and s["output_tokens"] == trace.useful_output_tokens
            assert s["duration_s"] >= run["busy_s"] - 1e-9  # every step lies between first arrival and last finish
            assert run["preemptions"] == 0 and run["batches_in_flight"] == depth
            assert all(0 < f <= 1 for f in run["stage_busy_fraction"])


# ---- padding ------------------------------------------------------------------------------------
def test_padding_is_charged_as_computed_tokens():
    """Padded prefill: every row to the longest prompt, causal pairs included; padded decode
    rows (finished members): a token, its logits and the step's longest context each."""
    from orca_jax.core.scheduler import ScheduledBatch

    def batch(rows, pad):
        b = ScheduledBatch()
        b.num_new, b.starts, b.samples = [n for n, _ in rows], [c for _, c in rows], [True] * len(rows)
        b.num_padding_tokens = pad
        return b

    prefill = step_work(batch([(10, 0), (4, 0)], 6))
    assert prefill == StepWork(20, 0, 2 * 55, 2)
    assert step_work(batch([(10, 0), (4, 0)], 0)) == StepWork(14, 0, 55 + 10, 2)
    decode = step_work(batch([(1, 40), (1, 30)], 3))
    assert decode == StepWork(5, 40 + 30 + 3 * 40, 41 + 31 + 3 * 41, 5)


# ---- Orca's pipeline: a batch per stage in flight ------------------------------------------------
def test_two_batches_in_flight_keep_both_stages_busier_and_finish_sooner(gpt3):
    """Under load, with Orca's two batches in flight (one per stage) the same requests finish
    sooner than with one batch crossing both stages at a time, and each stage is busy for a
    larger share of the run."""
    trace = make_trace(200, 1.0, seed=1, rate=100.0)
    one = simulate_run(trace, gpt3, "iteration", batches_in_flight=1)
    two = simulate_run(trace, gpt3, "iteration")
    assert two["batches_in_flight"] == 2 == gpt3.parallelism["pipeline_parallel"]
    assert two["summary"]["duration_s"] < one["summary"]["duration_s"]
    # One batch at a time: each stage works about half the time (its half of every step).
    assert all(0.4 < f < 0.5 for f in one["stage_busy_fraction"])
    assert all(f > 0.7 for f in two["stage_busy_fraction"])
    # The running sequences are split over the two batches, so there are more, smaller steps.
    assert two["engine_steps"] > one["engine_steps"]


def test_no_sequence_is_in_two_batches_in_flight(gpt3):
    """Orca's rule, enforced by the scheduler: a sequence in a batch in flight is not put in
    another until that batch returns; and every page comes back (simulate_run raises if not)."""
    trace = make_trace(120, 1.0, seed=3, rate=20.0)
    for policy in ("iteration", "request", "request_padded"):
        depths = []

        def check(scheduler, in_flight):
            assert len(in_flight) <= 2
            depths.append(len(in_flight))
            ids = [seq.seq_id for step in in_flight for seq in step.scheduled.seqs]
            assert len(ids) == len(set(ids))
            for step in in_flight:
                assert all(seq.num_in_flight == 1 for seq in step.scheduled.seqs)

        run = simulate_run(trace, gpt3, policy, check_step=check)
        assert run["summary"]["num_requests"] == 120
        if policy == "iteration":
            assert max(depths) == 2  # the pipeline was really used
    small = simulate_run(trace, gpt3, "iteration", num_pages=-(-(512 + 128) // 16) * 3 + 1)
    assert small["preemptions"] > 0  # preemption under pipelining, pages still all returned


def test_one_batch_in_flight_is_the_step_time_clock(gpt3):
    """batches_in_flight=1: every step takes CostModel.step_time, one after the other."""
    trace = make_trace(1, 1.0, seed=5, rate=1.0)
    steps = []
    run = simulate_run(trace, gpt3, "iteration", batches_in_flight=1,
                       check_step=lambda scheduler, in_flight: steps.append(step_work(in_flight[0].scheduled)))
    s = run["summary"]
    assert s["e2e_ms"]["p50"] == pytest.approx(1000 * sum(gpt3.step_time(w) for w in steps))
    with pytest.raises(ValueError, match="between 1 and the 2"):
        simulate_run(trace, gpt3, "iteration", batches_in_flight=3)


def test_padded_static_batches_cost_more_than_selective_ones(gpt3):
    """FasterTransformer's rectangles (padding, finished slots computed) on the same requests:
    more device time and lower throughput than request-level batching without padding."""
    trace = make_trace(100, 1.0, seed=4, rate=50.0)
    request = simulate_run(trace, gpt3, "request")
    padded = simulate_run(trace, gpt3, "request_padded")
    assert sum(padded["stage_busy_s"]) > sum(request["stage_busy_s"])
    assert padded["summary"]["requests_per_s"] < request["summary"]["requests_per_s"]


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
    policies = {"iteration", "request", "request_padded"}
    assert {r["policy"] for r in record["runs"]} == policies and len(record["runs"]) == 9
    assert record["paper"] == PAPER and record["slo_ms_per_token"] == 190.0
    assert record["cost_model"]["derived"]["num_params"] == pytest.approx(175e9, rel=0.01)
    for key in ("headline", "headline_padded"):
        assert set(record[key]) >= {"ratio", "fast_requests_per_s", "slow_requests_per_s"}
    assert len(record["ratios"]) == len(record["ratios_padded"]) == 4
    assert record["settings"]["batches_in_flight"] == record["settings"]["pipeline_stages"] == 2
    assert all(r["batches_in_flight"] == 2 and len(r["stage_busy_fraction"]) == 2 for r in record["runs"])
    assert record["command"].startswith("orca-jax bench simulate") and "--rates 0.5,3.0,8.0" in record["command"]
    assert "--batches-in-flight 2" in record["command"]
    assert fig.stat().st_size > 10_000 and fig.read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "SIMULATED: iteration-level / request throughput" in printed
    assert "SIMULATED: iteration-level / request_padded throughput" in printed


def test_bench_simulate_cli_runs_one_batch_in_flight_on_request(tmp_path):
    out = tmp_path / "sim.json"
    assert cli.main(["bench", "simulate", "--num-requests", "20", "--rates", "2", "--batches-in-flight", "1",
                     "--json", str(out), "--plot", "", "--quiet"]) == 0
    record = json.loads(out.read_text())
    assert record["settings"]["batches_in_flight"] == 1 and "--batches-in-flight 1" in record["command"]
    with pytest.raises(SystemExit, match="at most one per pipeline stage"):
        cli.main(["bench", "simulate", "--num-requests", "20", "--rates", "2", "--batches-in-flight", "3",
                  "--json", "", "--plot", ""])


def test_held_static_batches_return_with_their_longest_member(gpt3):
    """With FasterTransformer's returns, every request of a static batch ends when its longest
    member does, so normalized latency can only grow against returning early."""
    trace = make_trace(80, 1.0, seed=2, rate=2.0)
    for policy in ("request", "request_padded"):
        held = simulate_run(trace, gpt3, policy, request_returns="batch")["summary"]
        early = simulate_run(trace, gpt3, policy, request_returns="early")["summary"]
        assert held["e2e_ms"]["p50"] > early["e2e_ms"]["p50"]
        assert held["normalized_latency_ms"]["p50"] > early["normalized_latency_ms"]["p50"]
        assert held["ttft_ms"] == early["ttft_ms"]  # the schedule itself is the same
