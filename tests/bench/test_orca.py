"""`bench orca` end to end on the tiny random Llama: both policies, two rates, valid JSON, a
figure, no compile after warm-up, every page back."""

from __future__ import annotations

import json

from orca_jax import cli
from orca_jax.bench.orca import SweepSettings, analyze, engine_settings


def test_both_policies_share_batch_size_and_pool():
    common = engine_settings(SweepSettings(scale=0.25, max_num_seqs=4, page_size=16))
    assert common["max_model_len"] == 160  # 128 + 32, page-aligned
    assert common["num_pages"] == 4 * 10 + 1  # four full-length sequences and the padding page
    assert "scheduling" not in common  # the one setting the policies differ in is added per engine


def test_bench_orca_on_the_tiny_model(tiny_llama_dir, tmp_path, capsys):
    out, fig = tmp_path / "orca.json", tmp_path / "orca.png"
    code = cli.main(["bench", "orca", "--model", str(tiny_llama_dir), "--scale", "0.05", "--num-requests", "6",
                     "--rates", "20,200", "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--page-size", "8",
                     "--json", str(out), "--plot", str(fig)])
    assert code == 0
    record = json.loads(out.read_text())
    runs = record["runs"]
    assert [(r["policy"], r["rate"]) for r in runs] == [
        ("iteration", 20.0), ("request", 20.0), ("iteration", 200.0), ("request", 200.0)]
    for r in runs:
        s = r["summary"]
        assert s["num_requests"] == 6 and s["output_tokens"] == record["trace"]["useful_output_tokens"]
        assert r["xla_compiles_during_run"] == 0  # both engines were warmed up before timing
        assert 0 < s["normalized_latency_ms"]["p50"] <= s["normalized_latency_ms"]["p90"]
        assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p99"] and s["requests_per_s"] > 0
    step_ms = record["decode_step_ms_by_batch_size"]
    assert set(step_ms) == {"1", "4"} and all(v > 0 for v in step_ms.values())
    assert record["engine"]["max_num_seqs"] == 4 and record["trace"]["input_range"] == [2, 26]
    assert set(record["curves"]) == {"iteration", "request"}
    assert record["slo_ms_per_token"] == 2.0 * record["unloaded_latency_ms_per_token"]
    assert record["headline"]["latency_ms_per_token"] == record["slo_ms_per_token"]
    assert record["command"].startswith("orca-jax bench orca --model")
    assert fig.read_bytes()[:4] == b"\x89PNG"
    assert "HEADLINE" in capsys.readouterr().out


def test_analyze_without_both_policies_has_no_headline():
    runs = [{"policy": "iteration", "rate": 1.0,
             "summary": {"requests_per_s": 1.0, "normalized_latency_ms": {"p50": 10.0}}}]
    result = analyze(runs, ("iteration",), None)
    assert "headline" not in result and result["curves"]["iteration"][0]["latency"] == 10.0
