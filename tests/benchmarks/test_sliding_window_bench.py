"""benchmarks/sliding_window_bench.py: a tiny run writes its three timings, their ratios and the
sliding output's error against the reference, which is small (the windowed CPU kernel reads the
right pages)."""

from __future__ import annotations

import json


def test_tiny_run_writes_timings_ratios_and_its_error(load_benchmark, tmp_path):
    out = tmp_path / "sliding.json"
    bench = load_benchmark("sliding_window_bench")
    assert bench.main(["--impl", "cpu", "--batch", "2", "--window", "24", "--context", "96", "--num-q-heads", "4",
                       "--num-kv-heads", "2", "--head-dim", "16", "--page-size", "8", "--repeats", "3",
                       "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["ms"]) == {"window_context", "sliding_long", "full_long"}
    assert all(ms > 0 for ms in record["ms"].values())
    assert record["sliding_long_over_window_context"] == record["ms"]["sliding_long"] / record["ms"]["window_context"]
    assert record["settings"]["impl"] == "cpu" and "cpu_flags" in record["machine"]
    assert 0 <= record["sliding_long_max_abs_error_vs_reference"] < 1e-5
