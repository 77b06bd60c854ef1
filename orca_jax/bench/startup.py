"""`orca-jax bench startup`: process start to first token of `orca-jax generate --chat`, cold
and warm, phase by phase.

Each run is a fresh process (`python -m orca_jax.cli generate ... --startup-json FILE`): cold
with an empty cache root (`ORCA_JAX_CACHE_DIR`, so no compiled programs and no converted
weights), warm with the same root again. The child writes its phases (the loader's, the
engine's, the first step's) with wall-clock timestamps; the parent adds the time from launching
the process to the engine's start (Python, imports) and to its exit. Medians over the
repetitions. The operating system's file cache is warm in both (the GGUF file was read before).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_PROMPT = "What is the capital of France?"
# Issue 11's targets for the default model on a 2-core CPU, process start to first token.
TARGET_FIRST_TOKEN_S = {"cold": 15.0, "warm": 5.0}
# Phases of one run, in the order they happen; those with a child key are parts of the one above.
PHASES = (
    ("python_and_imports_s", "python + imports (jax)"),
    ("load_model_s", "model load"),
    ("engine_init_s", "engine init (weights to device, KV cache)"),
    ("warmup_s", "warm-up"),
    ("prompt_s", "prompt (chat template, tokenize)"),
    ("first_step_s", "first step (program builds + prefill)"),
)
SUB_PHASES = {
    "engine_init_s": ("weights_to_device_s", "kv_cache_alloc_s"),
    # With overlapped steps the decode bucket is built before the prefill's token is read.
    "first_step_s": ("first_step_build_s", "second_bucket_build_s"),
}


@dataclasses.dataclass(frozen=True)
class StartupSettings:
    model: str | None = None
    prompt: str = DEFAULT_PROMPT
    max_tokens: int = 8
    repeats: int = 3
    generate_args: tuple[str, ...] = ()  # more `orca-jax generate` flags, e.g. engine settings
    timeout_s: float = 900.0

    def __post_init__(self):
        if self.repeats < 1 or self.max_tokens < 1:
            raise ValueError(f"repeats and max_tokens must be >= 1, got {self.repeats} and {self.max_tokens}")


# ---- the child: `orca-jax generate --startup-json` ---------------------------------------------------
def generate_record(engine, output) -> dict[str, Any]:
    """What one `generate` run says about its start: wall-clock timestamps (comparable with the
    parent's) of the engine's start and readiness, the request's arrival, its first token and
    now; the engine's phase timings; the programs built and how many came from the cache."""
    from orca_jax.worker.compile_guard import compile_counts

    to_wall = time.time() - time.monotonic()
    counts = compile_counts()
    completion = output.outputs[0]
    return {
        "engine_start": engine.ready_at - engine.startup_timings["startup_s"] + to_wall,
        "engine_ready": engine.ready_at + to_wall,
        "request_arrival": output.arrival_time + to_wall,
        "first_token": output.first_token_time + to_wall,
        "finished": time.time(),
        "engine": dict(engine.startup_timings),
        # In build order: the first is the first step's (the prompt's bucket).
        "first_use_build_s": [[bucket, s] for bucket, s in engine.runner.first_use_build_s.items()],
        "programs": counts.programs,
        "cache_hits": counts.cache_hits,
        "prompt_tokens": len(output.prompt_token_ids),
        "output_tokens": len(completion.token_ids),
        "text": completion.text,
    }


def write_generate_record(path: str, engine, output) -> None:
    Path(path).write_text(json.dumps(generate_record(engine, output), indent=2) + "\n")


# ---- the parent -------------------------------------------------------------------------------------
def generate_command(s: StartupSettings, record_path: Path) -> list[str]:
    words = [sys.executable, "-m", "orca_jax.cli", "generate", s.prompt, "--chat", "--max-tokens", str(s.max_tokens),
             "--startup-json", str(record_path), *s.generate_args]
    return words + (["--model", s.model] if s.model else [])


def run_once(s: StartupSettings, cache_root: Path, record_path: Path) -> dict[str, Any]:
    """One fresh `generate` process with `cache_root` as its cache; its phases in seconds."""
    from orca_jax.cache_dirs import CACHE_DIR_ENV

    env = dict(os.environ, **{CACHE_DIR_ENV: str(cache_root)})
    load = os.getloadavg()[0]
    launched = time.time()
    proc = subprocess.run(generate_command(s, record_path), capture_output=True, text=True, env=env,
                          timeout=s.timeout_s)
    exited = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"generate exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    child = json.loads(record_path.read_text())
    return {**run_phases(child, launched, exited), "load_average_1m": load, "text": child["text"]}


def run_phases(child: dict[str, Any], launched: float, exited: float) -> dict[str, Any]:
    """Seconds per phase of one run, from the child's record and the parent's clock."""
    engine = child["engine"]
    builds = child["first_use_build_s"]
    phases: dict[str, Any] = {
        "python_and_imports_s": child["engine_start"] - launched,
        "load_model_s": engine["load_model_s"],
        **{k: v for k, v in engine.items() if k.startswith("loader_")},  # the loader's own phases
        "engine_init_s": engine["engine_init_s"],
        "weights_to_device_s": engine["weights_to_device_s"],
        "kv_cache_alloc_s": engine["kv_cache_alloc_s"],
        "warmup_s": engine.get("warmup_s", 0.0),
        "prompt_s": child["request_arrival"] - child["engine_ready"],
        "first_step_s": child["first_token"] - child["request_arrival"],
        "first_step_build_s": builds[0][1] if builds else 0.0,
        "second_bucket_build_s": builds[1][1] if len(builds) > 1 else 0.0,
        "first_token_s": child["first_token"] - launched,
        "rest_of_generation_s": child["finished"] - child["first_token"],
        "process_total_s": exited - launched,
        "programs": child["programs"],
        "cache_hits": child["cache_hits"],
        "compiled": child["programs"] - child["cache_hits"],
        "output_tokens": child["output_tokens"],
    }
    # What the listed phases leave out of process start -> first token (logging, the engine's
    # bookkeeping between its phases): small, or a phase is missing.
    listed = sum(phases[key] for key, _ in PHASES)
    phases["unaccounted_s"] = phases["first_token_s"] - listed
    return phases


def run_startup(s: StartupSettings, command: str, progress=print) -> dict[str, Any]:
    from orca_jax.bench.environment import now_utc, record_header

    started = now_utc()
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="orca-jax-bench-startup-") as tmp:
        for i in range(s.repeats):
            cache_root = Path(tmp) / f"cache-{i}"  # empty: cold; then the same root again: warm
            for kind in ("cold", "warm"):
                run = run_once(s, cache_root, Path(tmp) / f"record-{kind}-{i}.json")
                runs[kind].append(run)
                progress(f"{kind} {i + 1}/{s.repeats}: first token {run['first_token_s']:.2f} s, "
                         f"{run['compiled']} compiled / {run['cache_hits']} from cache, "
                         f"load average {run['load_average_1m']:.2f}")
    return {
        **record_header("startup", command, started),
        "settings": dataclasses.asdict(s), "generate_command": shlex.join(generate_command(s, Path("RECORD.json"))),
        "targets_first_token_s": TARGET_FIRST_TOKEN_S if s.model is None else None,
        "median": {kind: median_phases(kind_runs) for kind, kind_runs in runs.items()},
        "runs": runs,
    }


def median_phases(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per phase, the median over the runs that have it (a cache hit has phases a miss lacks)."""
    keys = dict.fromkeys(k for run in runs for k, v in run.items() if isinstance(v, (int, float)))
    return {k: statistics.median(run[k] for run in runs if k in run) for k in keys}


def format_report(record: dict[str, Any]) -> str:
    cold, warm = record["median"]["cold"], record["median"]["warm"]
    rows = [("phase (median seconds)", "cold", "warm")]

    def add(key: str, label: str) -> None:
        rows.append((label, _cell(cold.get(key)), _cell(warm.get(key))))

    for key, label in PHASES:
        add(key, label)
        if key == "load_model_s":
            for sub in sorted({k for k in (*cold, *warm) if k.startswith("loader_")}):
                add(sub, "  " + sub.removeprefix("loader_"))
        for sub in SUB_PHASES.get(key, ()):
            add(sub, "  " + sub)
    add("unaccounted_s", "(between phases)")
    add("first_token_s", "process start -> first token")
    targets = record.get("targets_first_token_s")
    if targets:
        rows.append(("  target", f"<= {targets['cold']:g}", f"<= {targets['warm']:g}"))
    add("rest_of_generation_s", f"rest of generation ({int(cold['output_tokens'])} tokens)")
    add("process_total_s", "process total")
    rows.append(("programs: compiled / from cache", f"{cold['compiled']:g} / {cold['cache_hits']:g}",
                 f"{warm['compiled']:g} / {warm['cache_hits']:g}"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{label:<{width}}  {c:>9}  {w:>9}" for label, c, w in rows]
    load = [run["load_average_1m"] for kind in ("cold", "warm") for run in record["runs"][kind]]
    lines.append(f"{record['settings']['repeats']} run(s) each; load average (1 min) before the runs "
                 f"{min(load):.2f}-{max(load):.2f} on {record['machine'].get('cpu_count')} CPUs")
    return "\n".join(lines)


def _cell(value) -> str:
    return "-" if value is None else f"{value:.2f}"
