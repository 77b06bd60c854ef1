"""The accelerator feature check (benchmarks/feature_check.py) on the CPU: tiny random models of
each family load, a kernel and an engine check pass, a failing, crashing or slow check is
recorded as such, and the near-tie rule of benchmarks/greedy_compare.py holds."""

from __future__ import annotations

import json
import time

import pytest


@pytest.fixture(scope="module")
def feature_check(load_benchmark):
    return load_benchmark("feature_check")


@pytest.fixture(scope="module")
def compare(load_benchmark):
    return load_benchmark("greedy_compare").compare_runs


def run(tokens, logprobs):
    return {"r": (tokens, logprobs, None)}


def test_identical_runs_agree_and_a_logprob_off_by_more_than_tol_does_not(compare):
    want = run([5, 6], [{5: -0.1, 7: -2.0}, {6: -0.5, 8: -1.5}])
    assert compare(want, want, 1e-3)["ok"]
    off = run([5, 6], [{5: -0.1, 7: -2.0}, {6: -0.5 + 2e-3, 8: -1.5}])
    result = compare(off, want, 1e-3)
    assert not result["ok"] and result["max_logprob_diff"] == pytest.approx(2e-3)


def test_a_flip_at_a_near_tie_passes_and_a_real_difference_fails(compare):
    want = run([5, 6, 9], [{5: -0.1, 7: -2.0}, {6: -0.7000, 8: -0.7015}, {9: -0.1}])
    tie = run([5, 8, 1], [{5: -0.1, 7: -2.0}, {8: -0.7012, 6: -0.7003}, {1: -3.0}])
    result = compare(tie, want, 1e-3)
    assert result["ok"] and not result["tokens_identical"]
    assert result["near_ties"] == [{"request": "r", "position": 1, "margin": pytest.approx(0.0015)}]
    assert result["compared_tokens"] == 2  # nothing after the flip is compared
    # Same log-probabilities, another token: the reference's margin (1.9) is no rounding.
    wide = run([5, 8], [{5: -0.1, 7: -2.0}, {6: -0.1, 8: -2.0}])
    assert not compare(wide, run([5, 6], [{5: -0.1, 7: -2.0}, {6: -0.1, 8: -2.0}]), 1e-3)["ok"]
    outside = run([5, 4], [{5: -0.1, 7: -2.0}, {4: -0.7}])  # a token the reference did not rank
    result = compare(outside, want, 1e-3)
    assert not result["ok"] and result["near_ties"][0]["margin"] is None


def test_every_family_builds_a_model_from_its_own_parser(load_benchmark):
    families = load_benchmark("tiny_families")
    for family in families.FAMILIES:
        config = families.model_config(family)
        assert config.head_dim == 128 and config.vocab_size == families.VOCAB_SIZE, family
    assert families.model_config("qwen3_moe").is_moe and families.model_config("gpt_oss").attention_sinks
    assert families.model_config("gemma2").mixes_attention_types


def run_checks(feature_check, tmp_path, names: str) -> dict:
    out = tmp_path / "features.json"
    assert feature_check.main(["--allow-cpu", "--checks", names, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "cpu" and report["failed"] == []
    return {c["name"]: c for c in report["checks"]}


def test_the_kernel_check_passes_on_the_cpu(feature_check, tmp_path):
    kernel = run_checks(feature_check, tmp_path, "kernel_float32")["kernel_float32"]
    assert kernel["status"] == "passed" and kernel["impl"] == "cpu" and 0 < kernel["max_abs_err"] < 1e-5
    assert len(kernel["errors"]) == 4 and not kernel["cases_skipped"]  # the window + cap and the sinks mixes too


def test_an_engine_check_passes_on_the_cpu(feature_check, tmp_path):
    """Two engines (the CPU kernel overlapped, the reference one step at a time): ~15 s on 2 cores."""
    engine = run_checks(feature_check, tmp_path, "engine_llama")["engine_llama"]
    assert engine["status"] == "passed" and engine["attention_impl"] == "cpu" and engine["tokens_identical"]
    assert engine["compared_tokens"] == 3 * feature_check.MAX_TOKENS and engine["max_logprob_diff"] < 1e-3


def test_failing_crashing_and_slow_checks_are_recorded(feature_check):
    def fails(runs):
        return {"ok": False, "max_logprob_diff": 1.0}

    def crashes(runs):
        raise RuntimeError("boom")

    def hangs(runs):
        time.sleep(5)

    assert feature_check.run_check("a", "", 1e-3, fails, None, 10)["status"] == "failed"
    crashed = feature_check.run_check("b", "", 1e-3, crashes, None, 10)
    assert crashed["status"] == "failed" and "boom" in crashed["error"]
    started = time.monotonic()
    assert feature_check.run_check("c", "", 1e-3, hangs, None, 0.3)["status"] == "timed_out"
    assert time.monotonic() - started < 2


def test_checks_past_the_budget_are_skipped_and_structured_outputs_says_why(feature_check, tmp_path, monkeypatch):
    out = tmp_path / "late.json"
    assert feature_check.main(["--allow-cpu", "--checks", "kernel_float32", "--budget-seconds", "1",
                               "--json", str(out)]) == 0
    assert json.loads(out.read_text())["checks"][0]["status"] == "skipped"
    monkeypatch.setitem(feature_check.SKIP_REASONS, "structured_regex", lambda: "llguidance missing")
    record = feature_check.run_check("structured_regex", "", 1e-3, None, None, 10)
    assert record == {"name": "structured_regex", "what": "", "tolerance": 1e-3, "status": "skipped",
                      "reason": "llguidance missing"}
