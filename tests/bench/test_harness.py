"""The run around every benchmark (orca_jax/bench/harness.py)."""

import argparse
import json

from orca_jax.bench import harness
from orca_jax.bench.driver import BenchmarkError


def test_report_file_keeps_every_row_written_so_far(tmp_path, capsys):
    path = tmp_path / "sub" / "report.json"
    out = harness.ReportFile(str(path), {"benchmark": "x"})
    out.add_row({"a": 1})
    assert json.loads(path.read_text())["rows"] == [{"a": 1}]
    out.add_row({"a": 2})
    assert json.loads(path.read_text())["rows"] == [{"a": 1}, {"a": 2}]
    assert capsys.readouterr().out.splitlines() == ['{"a": 1}', '{"a": 2}']
    out.record["total"] = 2
    out.add_row(None)  # no row: saves what else changed, prints nothing
    assert json.loads(path.read_text())["total"] == 2 and capsys.readouterr().out == ""
    harness.ReportFile(None, {}).save()  # no path: writes nothing, raises nothing


def test_write_json_writes_nothing_for_an_empty_path(tmp_path):
    harness.write_json({"x": 1}, "")
    harness.write_json({"x": tmp_path}, str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text()) == {"x": str(tmp_path)}


def _args(tmp_path, **kw):
    return argparse.Namespace(bench_command="demo", json=str(tmp_path / "out.json"), rounds=2, **kw)


def test_run_benchmark_passes_the_command_prints_the_report_and_writes_the_record(tmp_path, capsys):
    seen = {}

    def run(settings, command, progress):
        seen.update(settings=settings, command=command)
        progress("half way")
        return {"benchmark": "demo", "value": 3}

    record = harness.run_benchmark(_args(tmp_path), run, "SETTINGS", lambda r: f"value {r['value']}")
    assert record == {"benchmark": "demo", "value": 3}
    assert seen == {"settings": "SETTINGS", "command": "orca-jax bench demo --json " + str(tmp_path / "out.json")
                    + " --rounds 2"}
    assert json.loads((tmp_path / "out.json").read_text())["value"] == 3
    assert "half way" in capsys.readouterr().out


def test_a_run_that_did_not_do_what_was_asked_gives_none_and_says_why(tmp_path, capsys):
    def run(settings, command, progress):
        raise BenchmarkError("a request made 3 tokens, not 4")

    assert harness.run_benchmark(_args(tmp_path), run, None, str) is None
    assert "orca-jax bench demo: a request made 3 tokens, not 4" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
