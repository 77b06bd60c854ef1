"""What a benchmark record says about where it ran: machine, CPU flags, versions, the
orca_jax commit, memory, the date and the command. Every record, of `orca-jax bench` and of
the scripts in benchmarks/, starts with `record_header`."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

# The extensions a CPU number depends on: AVX-512 with bfloat16 and AMX against AVX2 alone
# changes a matmul's speed several times over.
_VECTOR_FLAG = re.compile(r"^(avx.*|amx.*|fma|f16c|vnni.*)$")


def record_header(benchmark: str, command: str, date: str | None = None) -> dict[str, Any]:
    """The first keys of every record: what ran, how to run it again, when it started (`date`,
    now by default), and where."""
    return {"benchmark": benchmark, "command": command, "date": date or now_utc(), "machine": machine_info()}


def machine_info() -> dict[str, Any]:
    import jax
    import numpy as np

    info: dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "jax": jax.__version__, "jax_backend": jax.default_backend(), "jax_devices": [str(d) for d in jax.devices()],
        "numpy": np.__version__, "orca_jax": source_revision(),
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    info["cpu_flags"] = cpu_flags(cpuinfo)
    info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                              if line.startswith("model name")), None)
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
        # Other jobs on a shared machine show here; a high load explains a noisy number.
        info["load_average"] = load_average()
    except (OSError, StopIteration, ValueError):
        pass  # not Linux: no /proc/meminfo
    for name in ("torch", "transformers"):
        # From the installed metadata: importing torch would cost seconds and its memory would
        # count in the benchmark's own.
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    return info


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The CPU's vector and matrix extensions (avx*, amx*, fma, f16c, vnni), sorted; `cpuinfo`
    is /proc/cpuinfo's text (read when None; none on a machine without it)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return sorted({flag for flag in line.split(":", 1)[-1].split() if _VECTOR_FLAG.match(flag)})


def source_revision() -> dict[str, Any]:
    """Which orca_jax ran (a PYTHONPATH worktree or the editable install), at what commit, and
    whether tracked files differed from it."""
    root = Path(__file__).resolve().parents[2]  # the checkout above orca_jax/bench/

    def git(*words):
        try:
            return subprocess.run(["git", "-C", str(root), *words], capture_output=True, text=True,
                                  timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    modified = None if commit is None else bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"path": str(root), "commit": commit, "modified": modified}


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages; None where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command_from_args(subcommand: str, args: argparse.Namespace, skip: tuple[str, ...] = ()) -> str:
    """`orca-jax bench SUBCOMMAND` with every option spelled out (defaults included), so the
    record reproduces the run even if a default changes later. The flags are the parser's own
    (`args.bench_options`, set by the harness), so `--no-x` and renamed destinations parse back."""
    options = getattr(args, "bench_options", {})
    words = ["orca-jax", "bench", subcommand]
    for name, value in vars(args).items():
        if name in ("func", "command", "bench_command", "bench_options", "log_level", *skip) or value is None:
            continue
        option = options.get(name)
        flag = option.option_strings[0] if option else "--" + name.replace("_", "-")
        if isinstance(option, argparse.BooleanOptionalAction):
            words.append(flag if value else "--no-" + flag[2:])
        elif value is True or value is False:
            if value:
                words.append(flag)
        else:
            words += [flag, ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
    return shlex.join(words)


def peak_rss_bytes() -> int:
    """Peak resident set of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
