"""Smoke test of benchmarks/throughput.py: the whole benchmark on the tiny random Llama, every
system, a handful of short requests. Checks the shape and consistency of the numbers, not
their size (timings are not tested)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput.py"


@pytest.fixture(scope="module")
def throughput():
    spec = importlib.util.spec_from_file_location("benchmarks_throughput_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_workload_follows_orca_ranges(throughput):
    w = throughput.make_workload(200, 0.5, vocab_size=100, seed=3, exclude_ids=(0, 1, 2))
    assert (w.input_range, w.output_range) == ((16, 256), (1, 64))
    assert all(16 <= n <= 256 for n in w.input_lens) and all(1 <= o <= 64 for o in w.output_lens)
    assert all(3 <= t < 100 for p in w.prompts for t in p)
    again = throughput.make_workload(200, 0.5, vocab_size=100, seed=3, exclude_ids=(0, 1, 2))
    assert again.prompts == w.prompts and again.output_lens == w.output_lens
    assert throughput.scaled_range(throughput.ORCA_INPUT_RANGE, 1.0) == (32, 512)


def test_bad_peer_is_an_error(throughput):
    with pytest.raises(SystemExit) as exc:
        throughput.parse_args(["--peers", "static,vllm"])
    assert exc.value.code != 0


def test_benchmark_on_tiny_model(throughput, tiny_llama_dir, tmp_path):
    args = throughput.parse_args([
        "--model", str(tiny_llama_dir), "--num-requests", "5", "--scale", "0.1",
        "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--page-size", "8",
        "--matmul-size", "128", "--matmul-repeats", "2", "--torch-threads", "1", "--seed", "1",
    ])
    result = throughput.run_benchmark(args)

    w = result["workload"]
    assert w["num_requests"] == 5 and w["input_range"] == [3, 51] and w["output_range"] == [1, 13]
    assert w["useful_output_tokens"] == sum(w["output_lens"])
    assert w["useful_processed_tokens"] == sum(w["input_lens"]) + sum(w["output_lens"])

    systems = {s["system"]: s for s in result["systems"]}
    assert list(systems) == ["orca_jax", "hf_static", "hf_continuous"]
    for s in systems.values():
        assert s["requests"] == 5
        assert s["useful_output_tokens"] == w["useful_output_tokens"]
        assert s["wall_s"] > 0 and s["useful_output_tokens_per_s"] > 0
        assert s["processed_tokens"] == w["useful_processed_tokens"] + s["wasted_tokens"]
        assert set(s["ratio_vs"]) == {"hf_static", "hf_continuous"}
        assert 0 < s["roofline_share"]
    # Static batching: 3 batches (2, 2, 1) padded to their longest prompt and output.
    static = systems["hf_static"]
    assert static["num_batches"] == 3 and static["wasted_tokens"] >= 0
    padded = sum(
        len(ins) * (max(ins) + max(outs))
        for ins, outs in ((w["input_lens"][i:i + 2], w["output_lens"][i:i + 2]) for i in range(0, 5, 2))
    )
    assert static["processed_tokens"] == padded
    assert systems["hf_continuous"]["per_request_max_new_tokens"] is True
    orca = systems["orca_jax"]
    assert orca["wasted_tokens"] == 0 and orca["xla_compiles_during_run"] == 0
    assert orca["ratio_vs"]["hf_static"] == pytest.approx(
        orca["useful_output_tokens_per_s"] / static["useful_output_tokens_per_s"])

    mem = result["memory"]
    assert mem["orca_kv_cache_bytes"] == orca["num_kv_pages"] * _kv_bytes_per_page(tiny_llama_dir, 8)
    assert mem["orca_weight_bytes"] == 4 * result["params"]["total"]
    assert mem["peak_rss_bytes"] >= mem["peak_rss_after_orca_bytes"] > mem["orca_weight_bytes"]

    assert result["matmul"]["roofline_flop_per_s"] > 0
    assert result["roofline"]["useful_output_tokens_per_s"] > 0
    assert result["flops"]["total"] > result["flops"]["linear"] > 0
    assert result["machine"]["cpu_count"] and result["date"] and "throughput.py" in result["command"]

    out = tmp_path / "result.json"
    out.write_text(json.dumps(result))  # everything is JSON-serializable as is
    assert json.loads(out.read_text())["systems"][0]["system"] == "orca_jax"
    table = throughput.format_report(result)
    assert "hf_continuous" in table and "% roofline" in table


def _kv_bytes_per_page(directory: Path, page_size: int) -> int:
    cfg = json.loads((directory / "config.json").read_text())
    return cfg["num_hidden_layers"] * page_size * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
