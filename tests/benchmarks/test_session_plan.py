"""The accelerator session's plan fits the device tool's limit, every stage's flags parse, and
the runner writes summary.json first and keeps it valid JSON through failures, timeouts, budget
skips and its own death (benchmarks/session_plan.py, benchmarks/session_runner.py)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan_module(load_benchmark):
    return load_benchmark("session_plan")


@pytest.mark.parametrize("name", ["gpu", "tpu"])
def test_plan_fits_the_device_command_limit_with_checks_first(plan_module, name):
    plan = plan_module.PLANS[name]
    assert plan_module.stage_budget_s(plan) <= plan_module.DEVICE_COMMAND_LIMIT_S == 590
    assert plan_module.stage_budget_s(plan) == sum(s.limit_s for s in plan) + plan_module.START_ALLOWANCE_S
    names = [s.name for s in plan]
    assert len(set(names)) == len(names)
    # Facts, then the feature check, then only timings.
    assert names[:2] == ["machine_facts", "feature_check"]
    for stage in plan:
        assert stage.argv[0] == "{python}" and (ROOT / stage.argv[1]).is_file(), stage.argv
        assert "{json}" in stage.argv and stage.checks and stage.keys


def test_tpu_plan_leaves_out_the_gpu_only_scripts(plan_module):
    scripts = {s.argv[1] for s in plan_module.TPU_PLAN}
    assert not scripts & {"benchmarks/kernel_bench.py", "benchmarks/step_bench.py", "benchmarks/gpu_engine_check.py"}
    assert "pallas_gpu" not in " ".join(a for s in plan_module.TPU_PLAN for a in s.argv)


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("plan_name", ["gpu", "tpu"])
def test_every_stage_command_parses_with_its_script(plan_module, load_benchmark, monkeypatch, tmp_path, plan_name):
    """Each stage's flags are ones its script takes: the script's own parser runs on them and
    the run stops right after it (a misspelt flag would exit with 'unrecognized arguments')."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    for stage in plan_module.PLANS[plan_name]:
        module = load_benchmark(Path(stage.argv[1]).stem)
        argv = [a.replace("{json}", str(tmp_path / "x.json")) for a in stage.argv[2:]]
        with pytest.raises(_Parsed) as parsed:
            module.main(argv)
        assert vars(parsed.value.args[0]), stage.name


def fake_plan(path: Path, out: Path) -> Path:
    """A stage that asserts the summary exists before it with every later stage pending, one that
    writes a JSON record, one that fails, one that sleeps past its limit, one the budget skips."""
    first_sees = (
        "import json, os, sys; s = json.load(open(os.path.join(sys.argv[1], 'summary.json'))); "
        "assert [x['status'] for x in s['stages']] == ['running'] + ['pending'] * 4, s; "
        "assert s['overall'] == 'running' and s['stages'][1]['limit_s'] == 10")
    writes = "import json, sys; json.dump({'rows': [{'case': 'a', 'ms': 2.5, 'junk': 1}], 'max_abs_err': 1e-6}, open(sys.argv[1], 'w'))"
    plan = [
        {"name": "sees_summary", "limit_s": 20, "argv": ["{python}", "-c", first_sees, str(out)]},
        {"name": "writes", "limit_s": 10, "argv": ["{python}", "-c", writes, "{json}"], "keys": ["ms", "max_abs_err"]},
        {"name": "fails", "limit_s": 10, "argv": ["false"]},
        {"name": "sleeps", "limit_s": 2, "argv": ["sleep", "30"]},
        {"name": "over_budget", "limit_s": 10, "argv": ["true"]},
    ]
    path.write_text(json.dumps(plan))
    return path


def session_env(out: Path) -> dict:
    return {**os.environ, "OUT": str(out), "PYTHON": sys.executable}


def test_session_script_writes_the_summary_first_and_keeps_it_valid(tmp_path):
    out = tmp_path / "out"
    plan = fake_plan(tmp_path / "plan.json", out)
    # Budget: the first three take well under a second, the sleep its 2 s limit; 6 s leaves the
    # last stage under the runner's 5 s minimum, so it is skipped, not started.
    done = subprocess.run(["bash", "benchmarks/gpu_session.sh", "--plan-file", str(plan), "--budget-seconds", "6",
                           "--work", str(tmp_path / "work")],
                          cwd=ROOT, env=session_env(out), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr  # a stage failed
    summary = json.loads((out / "summary.json").read_text())
    stages = {s["name"]: s for s in summary["stages"]}
    assert {n: s["status"] for n, s in stages.items()} == {
        "sees_summary": "passed", "writes": "passed", "fails": "failed", "sleeps": "timed_out", "over_budget": "skipped"}
    assert stages["fails"]["exit_code"] == 1 and stages["sleeps"]["seconds"] < 10
    assert stages["writes"]["key"] == {"rows/a/ms": 2.5, "max_abs_err": 1e-6}
    assert stages["writes"]["report"]["rows"][0]["junk"] == 1  # the whole record merged
    assert "out of time" in stages["over_budget"]["reason"]
    assert summary["overall"] == "failed" and "nvidia_smi" in summary["machine"]
    assert sorted(p.name for p in out.iterdir()) == ["session.log", "summary.json"]  # well within 8 files
    log = (out / "session.log").read_text()
    assert "=== sleeps timed_out" in log and "=== fails failed exit 1" in log


def test_summary_stays_valid_when_the_runner_itself_is_killed(tmp_path):
    out = tmp_path / "out"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"name": "long", "limit_s": 60, "argv": ["sleep", "60"]},
                                {"name": "never", "limit_s": 5, "argv": ["true"]}]))
    runner = subprocess.Popen([sys.executable, "benchmarks/session_runner.py", "--plan-file", str(plan),
                               "--out", str(out), "--work", str(tmp_path / "work")], cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if (out / "summary.json").exists() and '"running"' in (out / "summary.json").read_text():
                break
            time.sleep(0.05)
    finally:
        os.killpg(runner.pid, signal.SIGKILL)  # the device tool's limit: the whole command dies
        runner.wait()
    summary = json.loads((out / "summary.json").read_text())
    assert [s["status"] for s in summary["stages"]] == ["running", "pending"]
    assert not (out / "summary.json.tmp").exists()


def test_key_numbers_name_list_items_and_drop_non_finite(load_benchmark):
    runner = load_benchmark("session_runner")
    record = {"checks": [{"name": "k", "status": "passed", "max_abs_err": float("inf")}, {"status": "failed"}],
              "copy_gbs": 3000.0, "other": 1}
    assert runner.key_numbers(record, ("status", "max_abs_err", "gbs")) == {
        "checks/k/status": "passed", "checks/k/max_abs_err": "inf", "checks/1/status": "failed", "copy_gbs": 3000.0}
