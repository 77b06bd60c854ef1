"""Run a session plan (benchmarks/session_plan.py) with summary.json written first and kept valid.

    python benchmarks/session_runner.py --plan gpu --out "$OUT"     # what gpu_session.sh runs
    python benchmarks/session_runner.py --plan-file plan.json --out /tmp/x   # any plan (the tests)

Before anything runs, `OUT/summary.json` holds the plan (every stage with its limit and what it
checks), the machine facts that need no accelerator (nvidia-smi, package versions) and every
stage "pending". After each stage it is rewritten, atomically (a temporary file renamed over
it), with the stage's status (passed, failed, timed_out, skipped), exit code, seconds, its
whole JSON record and the key numbers lifted from it; so a stage cut by its limit, a crash, or
the device tool's own limit stopping this runner still leaves a summary that parses.

Everything comes back in two files, well within the device tool's 8: summary.json and
session.log (every stage's output, each under a header). The stages' own JSON files go to
`--work` (outside OUT) and are merged into the summary.

The runner never imports jax: initialising the accelerator here would hold it (a TPU admits one
process) and its memory while the stages run. Each stage runs in its own process group, killed
whole at its limit; the plan's deadline (`--budget-seconds`) shortens a stage that would
outrun it and skips one that has too little time left.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: benchmarks/ is importable from the checkout's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.session_plan import DEVICE_COMMAND_LIMIT_S, PLANS, START_ALLOWANCE_S, Stage  # noqa: E402

SUMMARY, LOG = "summary.json", "session.log"
MIN_STAGE_SECONDS = 5  # a stage with less time left than this is skipped, not started
KILL_GRACE_S = 3  # after SIGTERM at a stage's limit, before SIGKILL
MAX_KEYS = 60  # key numbers lifted per stage (the whole record is in the summary too)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_atomically(path: Path, record: dict) -> None:
    """`record` as JSON at `path`, never half-written: a temporary file beside it, renamed over it."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(record, indent=1, default=str, allow_nan=False) + "\n")
    os.replace(temporary, path)


def nvidia_smi() -> str | None:
    """nvidia-smi's GPU line(s), or None where there is none (a TPU VM, a CPU)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,compute_cap",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "nvidia-smi timed out"
    return (done.stdout or done.stderr).strip()


def plan_record(stage: Stage) -> dict:
    return {"name": stage.name, "limit_s": stage.limit_s, "checks": stage.checks, "command": list(stage.argv),
            "status": "pending"}


def finite(value):
    """JSON has no inf or NaN: such numbers become their text."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def key_numbers(record, keys: tuple[str, ...]) -> dict:
    """Leaves of `record` whose key contains one of `keys`, by path; list items that name
    themselves ("name", "case") go by that name, others by index."""
    found: dict = {}

    def walk(node, path: str) -> None:
        if len(found) >= MAX_KEYS:
            return
        if isinstance(node, dict):
            for key, value in node.items():
                child = f"{path}/{key}" if path else str(key)
                if isinstance(value, (dict, list)):
                    walk(value, child)
                elif any(k in str(key) for k in keys) and len(found) < MAX_KEYS:
                    found[child] = value
        elif isinstance(node, list):
            for i, item in enumerate(node):
                label = item.get("name", item.get("case", i)) if isinstance(item, dict) else i
                walk(item, f"{path}/{label}")

    walk(record, "")
    return finite(found)


def read_stage_json(path: Path) -> tuple[dict | None, str | None]:
    """(record, None), or (None, why not): a stage killed while writing leaves a torn file."""
    if not path.exists():
        return None, "the stage wrote no JSON"
    try:
        return json.loads(path.read_text()), None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f"unreadable JSON ({e})"


def run_stage(stage: Stage, limit_s: float, work: Path, log) -> dict:
    """Run one stage under `limit_s`, its output appended to `log`; its result fields."""
    stage_json = work / f"{stage.name}.json"
    stage_json.unlink(missing_ok=True)
    argv = [part.replace("{python}", sys.executable).replace("{json}", str(stage_json)) for part in stage.argv]
    log.write(f"\n=== {stage.name} (limit {limit_s:.0f}s) {now()}\n$ {' '.join(argv)}\n")
    log.flush()
    started = time.monotonic()
    try:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        return {"status": "failed", "exit_code": None, "seconds": 0.0, "error": f"could not start: {e}"}
    try:
        code = process.wait(timeout=limit_s)
        status = "passed" if code == 0 else "failed"
    except subprocess.TimeoutExpired:
        stop_group(process)
        code, status = process.returncode, "timed_out"
    seconds = round(time.monotonic() - started, 2)
    log.write(f"=== {stage.name} {status} exit {code} after {seconds}s\n")
    log.flush()
    result = {"status": status, "exit_code": code, "seconds": seconds}
    record, problem = read_stage_json(stage_json)
    if record is None:
        result["report_missing"] = problem
    else:
        result["key"] = key_numbers(record, stage.keys)
        result["report"] = finite(record)
    return result


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the stage's whole process group, SIGKILL if it has not gone after a grace."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def machine_from_facts(summary: dict) -> None:
    """The facts stage's record (if it ran) becomes the summary's machine section."""
    facts = next((s for s in summary["stages"] if s["name"] == "machine_facts"), None)
    if facts and "report" in facts:
        summary["machine"].update(facts["report"])


def overall(stages: list[dict]) -> str:
    statuses = {s["status"] for s in stages}
    if statuses & {"pending", "running"}:
        return "running"
    return "failed" if statuses & {"failed", "timed_out"} else "passed"


def run_plan(plan: list[Stage], out: Path, work: Path, budget_s: float, plan_name: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    summary = {"plan": plan_name, "budget_s": budget_s, "started": now(), "updated": now(), "elapsed_s": 0.0,
               "overall": "running", "files": [SUMMARY, LOG],
               "machine": {"nvidia_smi": nvidia_smi(), "hostname": os.uname().nodename},
               "stages": [plan_record(stage) for stage in plan]}

    def save() -> None:
        summary.update(updated=now(), elapsed_s=round(time.monotonic() - started, 2), overall=overall(summary["stages"]))
        write_atomically(out / SUMMARY, summary)

    save()  # the plan, before anything runs
    with open(out / LOG, "a") as log:
        for stage, entry in zip(plan, summary["stages"]):
            left = budget_s - (time.monotonic() - started)
            if left < MIN_STAGE_SECONDS:
                entry.update(status="skipped", reason=f"out of time: {left:.0f}s of the {budget_s:.0f}s budget left")
                save()
                continue
            limit = min(stage.limit_s, left)
            entry.update(status="running", limit_applied_s=round(limit, 1))
            save()
            try:
                entry.update(run_stage(stage, limit, work, log))
            except Exception as e:  # the runner's own fault: record it, keep the other stages
                entry.update(status="failed", exit_code=None, error=f"runner: {type(e).__name__}: {e}")
            machine_from_facts(summary)
            save()
            print(f"{stage.name}: {entry['status']} (exit {entry['exit_code']}, {entry['seconds']}s)", flush=True)
    return summary


def load_plan_file(path: Path) -> list[Stage]:
    """A plan as JSON: [{"name", "limit_s", "checks", "argv": [...], "keys": [...]}, ...]."""
    return [Stage(s["name"], s["limit_s"], s.get("checks", ""), tuple(s["argv"]), tuple(s.get("keys", ())))
            for s in json.loads(Path(path).read_text())]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--plan", choices=sorted(PLANS))
    which.add_argument("--plan-file", type=Path, help="a plan as JSON (tests)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/orca_jax_session")))
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "orca_jax_session_work",
                        help="where the stages write their own JSON (outside OUT: it comes back merged)")
    parser.add_argument("--budget-seconds", type=float, default=DEVICE_COMMAND_LIMIT_S - START_ALLOWANCE_S)
    args = parser.parse_args(argv)
    plan = PLANS[args.plan] if args.plan else load_plan_file(args.plan_file)
    summary = run_plan(plan, args.out, args.work, args.budget_seconds, args.plan or str(args.plan_file))
    print(f"summary: {args.out / SUMMARY} ({summary['overall']}, {summary['elapsed_s']:.0f}s)", flush=True)
    return 0 if summary["overall"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
