"""`bench offline` on the tiny random Llama: every system, a handful of short requests. Checks
the shape and consistency of the numbers, not their size (timings are not tested)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orca_jax import cli
from orca_jax.bench.offline import OfflineSettings, format_report, run_offline


def test_unknown_peer_is_an_error():
    with pytest.raises(ValueError, match="sglang"):
        OfflineSettings(peers=("static", "sglang"))


def test_offline_on_tiny_model(tiny_llama_dir, torch_single_thread):
    settings = OfflineSettings(model=str(tiny_llama_dir), num_requests=5, scale=0.1, max_num_seqs=2,
                               max_num_batched_tokens=32, page_size=8, matmul_size=128, matmul_repeats=2,
                               torch_threads=1, torch_device="cpu", seed=1)
    result = run_offline(settings, "orca-jax bench offline ...")

    t = result["trace"]
    assert t["num_requests"] == 5 and t["input_range"] == [3, 51] and t["output_range"] == [1, 13]
    assert t["useful_output_tokens"] == sum(t["output_lens"])
    assert t["useful_processed_tokens"] == sum(t["input_lens"]) + sum(t["output_lens"])

    systems = {s["system"]: s for s in result["systems"]}
    assert list(systems) == ["orca_jax", "hf_static", "hf_continuous"]
    for s in systems.values():
        assert s["requests"] == 5 and s["useful_output_tokens"] == t["useful_output_tokens"]
        assert s["wall_s"] > 0 and s["useful_output_tokens_per_s"] > 0
        assert s["processed_tokens"] == t["useful_processed_tokens"] + s["wasted_tokens"]
        assert set(s["ratio_vs"]) == {"hf_static", "hf_continuous"} and 0 < s["roofline_share"]
    # Static batching: 3 batches (2, 2, 1) padded to their longest prompt and output.
    static = systems["hf_static"]
    assert static["num_batches"] == 3
    padded = sum(len(ins) * (max(ins) + max(outs))
                 for ins, outs in ((t["input_lens"][i:i + 2], t["output_lens"][i:i + 2]) for i in range(0, 5, 2)))
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
    assert result["startup"]["torch_device"] == "cpu" and result["torch_num_threads"] == 1
    assert result["flops"]["total"] > result["flops"]["linear"] > 0
    assert result["machine"]["cpu_count"] and result["date"]
    assert json.loads(json.dumps(result))["systems"][0]["system"] == "orca_jax"  # JSON as is
    report = format_report(result)
    assert "hf_continuous" in report and "% roofline" in report


def test_cli_skip_peers_needs_no_torch(tiny_llama_dir, tmp_path, monkeypatch):
    import orca_jax.bench.peers as peers

    def no_torch():
        raise AssertionError("--skip-peers must not need torch")

    monkeypatch.setattr(peers, "import_torch", no_torch)
    out = tmp_path / "offline.json"
    code = cli.main(["bench", "offline", "--model", str(tiny_llama_dir), "--num-requests", "3", "--scale", "0.05",
                     "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--page-size", "8", "--skip-peers",
                     "--matmul-size", "64", "--matmul-repeats", "1", "--json", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert [s["system"] for s in record["systems"]] == ["orca_jax"]
    assert "--skip-peers" in record["command"]


def test_missing_torch_is_a_clear_error(monkeypatch):
    import builtins

    from orca_jax.bench.peers import import_torch

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "torch" else real_import(name, *a, **k))
    with pytest.raises(RuntimeError, match="pip install torch"):
        import_torch()


def _kv_bytes_per_page(directory: Path, page_size: int) -> int:
    cfg = json.loads((directory / "config.json").read_text())
    return cfg["num_hidden_layers"] * page_size * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4


@pytest.mark.parametrize("flag", ["-dp", "--data-parallel-size"])
def test_data_parallel_size_reaches_the_offline_settings(flag):
    from orca_jax.bench.arguments import settings_from_args

    args = cli.build_parser().parse_args(["bench", "offline", "--skip-peers", flag, "2"])
    assert settings_from_args(OfflineSettings(), args).data_parallel_size == 2
    default = cli.build_parser().parse_args(["bench", "offline"])
    assert settings_from_args(OfflineSettings(), default).data_parallel_size == 1


def test_serve_and_generate_take_the_data_parallel_flag():
    from orca_jax.cli.commands import _engine_config, cmd_generate

    args = cli.build_parser().parse_args(["serve", "-dp", "4", "-tp", "2"])
    config = _engine_config(args)
    assert (config.data_parallel_size, config.tensor_parallel_size) == (4, 2)
    generate = cli.build_parser().parse_args(["generate", "hello", "-dp", "2"])
    with pytest.raises(ValueError, match="generate runs one prompt on one engine"):
        cmd_generate(generate)  # refused before any model loads
