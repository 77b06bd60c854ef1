"""`orca-jax bench host`: a tiny run through the CLI in both scheduling modes (every part
recorded, host->device bytes independent of max_model_len, nothing compiled after warm-up),
and the pieces around it: settings, mixes, modes, the report, the parser."""

from __future__ import annotations

import json
import sys

import pytest

from orca_jax import cli
from orca_jax.bench.driver import BenchmarkError
from orca_jax.bench.host import (HostSettings, available_modes, cell_step_limit, format_report, mix_params,
                                 pool_pages, require_timeline)
from orca_jax.engine.step_timing import HOST_PARTS

TINY_RUN = ["--models", "tiny", "--num-seqs", "4", "--max-model-len", "64,128", "--mixes", "realistic",
            "--steps", "3", "--warm-steps", "2", "--prompt-len", "8", "--long-steps", "0",
            "--max-num-batched-tokens", "16"]
CELL_KEYS = {"model", "mode", "max_model_len", "mix", "num_seqs", "long", "steps", "timed_steps", "recorded_steps",
             "prefill_steps", "parts_us", "parts_us_p90", "wait_us", "host_total_us", "host_critical_us",
             "device_step_us", "device_idle_us", "period_us", "host_total_us_p90", "host_critical_us_p90",
             "device_step_us_p90", "device_idle_frac", "h2d_bytes", "h2d_arrays", "d2h_bytes", "scheduled_seqs",
             "output_len_before", "step_wall_us", "warm_steps_taken", "replaced_requests", "preemptions",
             "compiles_after_warmup", "watch_errors", "load_average"}


def test_tiny_host_run_records_both_modes(tmp_path, capsys):
    out = tmp_path / "host.json"
    interval = sys.getswitchinterval()
    assert cli.main(["bench", "host", *TINY_RUN, "--json", str(out)]) == 0, capsys.readouterr().err
    record = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert sys.getswitchinterval() == interval, "the bench restores the switch interval"

    assert record["benchmark"] == "host" and record["command"].startswith("orca-jax bench host")
    assert record["switch_interval_s"] == pytest.approx(1e-4)
    assert record["modes"] == ["sync", "async"] and record["modes_unavailable"] == {}
    assert record["models"]["tiny"]["vocab_size"] == 49152
    assert "load_average" in record["machine"]
    cells = record["cells"]
    assert sorted((c["max_model_len"], c["mode"]) for c in cells) == [
        (64, "async"), (64, "sync"), (128, "async"), (128, "sync")]
    for c in cells:
        assert set(c) == CELL_KEYS, set(c) ^ CELL_KEYS
        assert set(c["parts_us"]) == {*HOST_PARTS, "gc"}
        assert c["steps"] >= 1 and c["timed_steps"] >= 1 and c["watch_errors"] == 0
        assert c["device_step_us"] > 0 and c["host_total_us"] > 0 and c["h2d_bytes"] > 0
        assert 0.0 <= c["device_idle_frac"] <= 1.0
        assert c["compiles_after_warmup"] == 0, c
        assert c["preemptions"] == 0 and c["scheduled_seqs"] == 4
        # One token per running request per warm-up step, at most.
        assert 1 <= c["output_len_before"] <= c["warm_steps_taken"] + 1, c
    # The persistent batch sends the same small inputs whatever max_model_len is, but for the
    # room prefix caching keeps for cached pages: 8 bytes per page of context (page size 16),
    # up to MAX_CACHED_PAGES_PER_STEP.
    for mode in ("sync", "async"):
        by_length = {c["max_model_len"]: c["h2d_bytes"] for c in cells if c["mode"] == mode}
        assert by_length[128] - by_length[64] == 8 * (128 - 64) // HostSettings().page_size, (mode, by_length)
    assert "sync / async" in printed and "host critical (device idle)" in printed


def test_settings_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="unknown models"):
        HostSettings(models=("huge",))
    with pytest.raises(ValueError, match="unknown mixes"):
        HostSettings(mixes=("spicy",))
    with pytest.raises(ValueError, match="unknown modes"):
        HostSettings(modes=("eager",))
    with pytest.raises(ValueError, match="must exceed the largest num_seqs"):
        HostSettings(num_seqs=(256,), max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="do not fit max_model_len 512"):  # 1,000 decode steps in 512 tokens
        HostSettings(long_max_model_len=512)
    with pytest.raises(ValueError, match="nothing to run"):
        HostSettings(models=(), long_steps=0)
    assert HostSettings(models=(), long_steps=0, offline=True).cells() == []


def test_cells_group_by_engine_with_the_long_cell_last():
    s = HostSettings(models=("tiny", "balanced"), num_seqs=(32, 256), max_model_lens=(2048, 4096),
                     mixes=("greedy",), long_steps=100)
    cells = s.cells()
    groups = [(c.model, c.max_model_len) for c in cells]
    assert groups == [("tiny", 2048)] * 2 + [("tiny", 4096)] * 2 + [("balanced", 2048)] * 2 + [("balanced", 4096)] * 3
    long = cells[-1]
    assert long.long and long.mix == "realistic" and long.num_seqs == 256 and long.warm_steps == 100
    # The pool holds every sequence of the largest cell at its longest.
    limit = cell_step_limit(s, long)
    assert limit >= 100 + s.steps
    assert pool_pages(s, cells[-3:], 4096) >= 256 * (s.prompt_len + limit) // s.page_size


def test_realistic_mix_cycles_through_the_four_kinds_of_request():
    greedy, nucleus, penalised, logprobs = (mix_params("realistic", i, 100) for i in range(4))
    assert greedy.temperature == 0 and greedy.logprobs is None and not greedy.stop
    assert (nucleus.temperature, nucleus.top_p, nucleus.seed) == (0.8, 0.95, 1)
    assert (penalised.temperature, penalised.top_k, penalised.repetition_penalty, penalised.presence_penalty,
            penalised.frequency_penalty) == (0.7, 50, 1.1, 0.3, 0.2)
    assert logprobs.temperature == 0 and logprobs.logprobs == 5 and logprobs.stop == ["\n\n\n", "###"]
    assert mix_params("realistic", 5, 100).top_p == 0.95
    assert all(mix_params("greedy", i, 7).temperature == 0 for i in range(4))
    assert all(p.ignore_eos and p.max_tokens == 100 for p in (greedy, nucleus, penalised, logprobs))


def test_modes_the_engine_cannot_run_are_named():
    assert available_modes(("sync", "async"), {"async_scheduling", "model"}) == (["sync", "async"], {})
    modes, why = available_modes(("sync", "async"), {"model"})
    assert modes == ["sync"] and "async_scheduling" in why["async"]
    assert available_modes(("async",), {"model"})[0] == []


def test_an_engine_without_a_timeline_is_refused_by_name():
    class Engine:
        timeline = None

    with pytest.raises(BenchmarkError, match="LLMEngine.timeline"):
        require_timeline(Engine())


def _cell(mode, n, host_total, **extra):
    parts = {p: 10.0 * (i + 1) for i, p in enumerate((*HOST_PARTS, "gc"))}
    return dict(model="tiny", mode=mode, max_model_len=4096, mix="greedy", num_seqs=n, long=False,
                parts_us=parts, host_total_us=host_total, host_total_us_p90=host_total * 2, host_critical_us=5.0,
                device_step_us=2000.0, device_idle_frac=0.25, step_wall_us=3000.0, h2d_bytes=4.5 * 2**20,
                compiles_after_warmup=0, output_len_before=40.0, load_average=[1.5, 1.0, 1.0], **extra)


def test_report_puts_the_modes_side_by_side_per_running_count():
    record = {"modes": ["sync", "async"], "switch_interval_s": 1e-4, "output_kind": "delta",
              "modes_unavailable": {},
              "cells": [_cell("sync", 32, 744.0), _cell("async", 32, 690.0), _cell("sync", 256, 6746.0),
                        _cell("async", 256, 17.0, ), dict(_cell("sync", 256, 12700.0), long=True,
                                                           mix="realistic", output_len_before=1012.0)],
              "offline": [{"max_num_seqs": 16, "mode": "sync", "wall_s": 9.5, "useful_output_tokens_per_s": 160.0},
                          {"max_num_seqs": 16, "mode": "async", "wall_s": 8.0, "useful_output_tokens_per_s": 190.0}]}
    report = format_report(record)
    lines = report.splitlines()
    assert "each entry sync / async" in lines[0]
    header = next(line for line in lines if line.startswith("part"))
    assert "32 seqs" in header and "256 seqs" in header
    total = next(line for line in lines if line.startswith("host total "))
    assert total.split()[2:] == ["744", "/", "690", "6,746", "/", "17"]
    assert "4.50 MB / 4.50 MB" in report and "25.0% / 25.0%" in report
    long = report[report.index("long: tiny"):]
    assert "outputs of ~1012 tokens" in long and "12,700 / -" in long  # the async long cell is missing
    assert "max_num_seqs  16: sync 9.50 s / 160.0, async 8.00 s / 190.0" in report
    assert "load average (1 min) 1.50-1.50" in report


def test_cli_parses_the_host_flags():
    args = cli.build_parser().parse_args(["bench", "host", *TINY_RUN, "--modes", "async", "--offline",
                                          "--switch-interval", "0.001"])
    assert args.func.__name__ == "cmd_host"
    assert args.num_seqs == (4,) and args.max_model_lens == (64, 128) and args.mixes == ("realistic",)
    assert args.modes == ("async",) and args.offline and args.switch_interval_s == 0.001 and args.long_steps == 0
    defaults = cli.build_parser().parse_args(["bench", "host"])
    assert defaults.num_seqs == (32, 64, 128, 256) and defaults.max_model_lens == (2048, 4096, 8192)
    assert defaults.json == "bench-results/host_cpu.json" and defaults.offline_max_num_seqs == (16, 64)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "host", "--num-seqs", "4,x"])


def test_cli_reports_bad_settings_as_an_error(capsys):
    assert cli.main(["bench", "host", "--models", "huge", "--json", ""]) == 2
    assert "unknown models" in capsys.readouterr().err
