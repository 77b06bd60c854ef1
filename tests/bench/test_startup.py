"""`orca-jax bench startup` on the tiny model: a cold and a warm `generate` process, each phase
measured, the warm one compiling nothing."""

from __future__ import annotations

import json

import pytest

from orca_jax import cli
from orca_jax.bench.startup import PHASES, StartupSettings, format_report

SMALL_ENGINE = "--ignore-eos --max-num-seqs 2 --max-num-batched-tokens 16 --max-model-len 128 --num-pages 20"


def test_startup_benchmark_measures_cold_and_warm_phases(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "startup.json"
    code = cli.main(["bench", "startup", "--model", str(tiny_llama_dir), "--repeats", "1", "--max-tokens", "4",
                     "--generate-args", SMALL_ENGINE, "--json", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "process start -> first token" in printed and "model load" in printed

    assert record["benchmark"] == "startup" and record["command"].startswith("orca-jax bench startup")
    assert record["machine"]["cpu_count"] >= 1 and "load_average" in record["machine"]
    assert record["targets_first_token_s"] is None, "the targets are the default model's"
    cold, warm = record["runs"]["cold"][0], record["runs"]["warm"][0]
    for run in (cold, warm):
        assert run["output_tokens"] == 4
        for key, _ in PHASES:
            assert run[key] >= 0.0, key
        assert run["load_model_s"] > 0 and run["python_and_imports_s"] > 0 and run["first_step_s"] > 0
        # The phases cover process start -> first token: what falls between them is small.
        assert abs(run["unaccounted_s"]) < 1.0, run
        assert run["first_step_build_s"] <= run["first_step_s"]
        assert run["weights_to_device_s"] + run["kv_cache_alloc_s"] <= run["engine_init_s"] + 1e-6
        assert run["first_token_s"] <= run["process_total_s"]
        assert run["warmup_s"] == 0.0, "generate builds the programs it needs as it meets them"
    # Prefill and decode land in two buckets here (a chat prompt of more than 8 tokens, then 1).
    assert cold["programs"] >= 2 and cold["cache_hits"] == 0 and cold["compiled"] == cold["programs"]
    assert warm["compiled"] == 0 and warm["cache_hits"] == warm["programs"] == cold["programs"]
    assert record["median"]["warm"]["first_token_s"] == warm["first_token_s"]


def test_report_shows_each_phase_and_the_targets():
    run = {key: 1.0 for key, _ in PHASES}
    run.update(loader_gguf_parse_s=0.5, weights_to_device_s=0.2, kv_cache_alloc_s=0.3, first_step_build_s=0.4,
               unaccounted_s=0.0, first_token_s=6.0, rest_of_generation_s=0.5, process_total_s=7.0,
               programs=2, cache_hits=0, compiled=2, output_tokens=8, load_average_1m=0.5)
    warm = dict(run, cache_hits=2, compiled=0, first_token_s=3.0, load_average_1m=0.7)
    record = {"median": {"cold": run, "warm": warm}, "runs": {"cold": [run], "warm": [warm]},
              "settings": {"repeats": 1}, "machine": {"cpu_count": 2},
              "targets_first_token_s": {"cold": 15.0, "warm": 5.0}}
    report = format_report(record)
    for _, label in PHASES:
        assert label in report
    assert "gguf_parse_s" in report and "<= 15" in report and "<= 5" in report
    assert "2 / 0" in report and "0 / 2" in report and "0.50-0.70" in report


def test_settings_refuse_nonsense():
    with pytest.raises(ValueError, match="repeats"):
        StartupSettings(repeats=0)
