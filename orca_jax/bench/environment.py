"""What a benchmark record says about where it ran: machine, versions, memory, the command."""

from __future__ import annotations

import datetime
import os
import platform
import resource
import shlex
import sys
from typing import Any


def machine_info() -> dict[str, Any]:
    import jax
    import numpy as np

    info: dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "jax": jax.__version__, "jax_backend": jax.default_backend(), "jax_devices": [str(d) for d in jax.devices()],
        "numpy": np.__version__,
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
        # Other jobs on a shared machine show here; a high load explains a noisy number.
        info["load_average"] = list(os.getloadavg())
    except (OSError, StopIteration, ValueError):
        pass
    for name in ("torch", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command_from_args(subcommand: str, args, skip: tuple[str, ...] = ()) -> str:
    """`orca-jax bench SUBCOMMAND` with every option spelled out (defaults included), so the
    record reproduces the run even if a default changes later."""
    words = ["orca-jax", "bench", subcommand]
    for name, value in vars(args).items():
        if name in ("func", "command", "bench_command", "log_level", *skip) or value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
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
