"""benchmarks/throughput.py is now a thin front for `orca-jax bench offline` (tested in
tests/bench/test_offline.py): it must still parse the old options into the same settings."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from orca_jax.bench.cli import cmd_offline

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput.py"


@pytest.fixture(scope="module")
def throughput():
    spec = importlib.util.spec_from_file_location("benchmarks_throughput_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_old_command_line_still_parses_to_bench_offline(throughput, monkeypatch):
    seen = {}
    monkeypatch.setattr(throughput, "cmd_offline", lambda args: seen.setdefault("args", args) and 0)
    assert throughput.main(["--max-model-len", "512", "--peers", "static", "--scale", "0.25",
                            "--json", "out.json"]) == 0
    args = seen["args"]
    assert (args.max_model_len, args.peers, args.scale, args.json) == (512, ("static",), 0.25, "out.json")
    assert (args.num_requests, args.max_num_seqs, args.max_num_batched_tokens) == (48, 16, 256)
    assert throughput.cmd_offline is not cmd_offline  # the patched one ran, not a copy of the benchmark


def test_bad_option_is_an_error(throughput):
    with pytest.raises(SystemExit) as exc:
        throughput.main(["--scale", "0"])
    assert exc.value.code != 0
