"""The GPU benchmark scripts refuse, loudly, to run without a GPU (their numbers would mean
nothing on a CPU), and their byte accounting is what their docstrings say."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

@pytest.mark.parametrize("name,argv", [("kernel_bench", ["--quick"]), ("step_bench", []),
                                       ("gpu_engine_check", ["--out", "/dev/null"]),
                                       ("feature_check", ["--json", "/dev/null"])])
def test_refuses_without_a_gpu(name, argv, capsys, load_benchmark):
    module = load_benchmark(name)
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(module.main(argv))
    assert exit_info.value.code == 2
    assert "GPU" in capsys.readouterr().err


def test_step_roofline_counts_every_weight_once(load_benchmark):
    step_bench = load_benchmark("step_bench")
    config = step_bench.LLAMA_3_2_1B
    # Llama-3.2-1B has 1.236e9 parameters (tied embeddings): 2.47 GB in bfloat16.
    assert step_bench.weight_bytes(config) == pytest.approx(2 * 1.2358e9, rel=1e-3)
    # 16 layers x (K and V) x 8 heads x 64 dims x 2 bytes = 32 KiB per token.
    assert step_bench.kv_bytes_per_token(config) == 32 * 1024


def test_kernel_bench_counts_kv_queries_and_outputs(load_benchmark):
    kernel_bench = load_benchmark("kernel_bench")
    kernel_bench.NUM_Q_HEADS, kernel_bench.NUM_KV_HEADS, kernel_bench.HEAD_DIM = 4, 2, 16
    (q, kv_pages, metadata), moved = kernel_bench.make_step([(1, 40), (5, 21)])
    kv_lens, page_table, cu_q_lens, num_seqs = (
        metadata.kv_lens, metadata.page_table, metadata.cu_q_lens, metadata.num_seqs)
    assert q.shape == (6, 4, 16) and kv_pages.shape[1:] == (16, 4, 16)
    assert list(kv_lens) == [40, 21] and list(cu_q_lens) == [0, 1, 6] and int(num_seqs[0]) == 2
    # Every sequence's pages are its own: no page is shared or the padding page.
    owned = [p for row, n in zip(page_table.tolist(), (3, 2)) for p in row[:n]]
    assert len(set(owned)) == len(owned) and 0 not in owned
    itemsize = 2  # bfloat16
    assert moved == (40 + 21) * 2 * 2 * 16 * itemsize + 2 * 6 * 4 * 16 * itemsize


def test_kernel_bench_cpu_layers_count_kv_bytes_and_own_their_pages(load_benchmark):
    kernel_bench = load_benchmark("kernel_bench")
    kernel_bench.CPU_HEADS, kernel_bench.CPU_POOL_BYTES = (4, 2, 16), 1 << 16
    q, kv_pages, metadatas, kv_bytes = kernel_bench.make_cpu_layers([(1, 40), (5, 21)], np.float32)
    assert q.shape == (6, 4, 16) and kv_pages.shape[1:] == (16, 4, 16)
    assert kv_bytes == (40 + 21) * 2 * 2 * 16 * 4  # K and V of every visited token
    pages = [p for m in metadatas for row, n in zip(np.asarray(m.page_table).tolist(), (3, 2)) for p in row[:n]]
    assert len(metadatas) >= 2 and len(set(pages)) == len(pages) and 0 not in pages  # one pool, no page twice


def test_kernel_bench_cpu_quick_run_writes_its_report(tmp_path, monkeypatch, load_benchmark):
    kernel_bench = load_benchmark("kernel_bench")
    monkeypatch.setattr(kernel_bench, "CPU_POOL_BYTES", 1 << 20)
    monkeypatch.setattr(kernel_bench, "cpu_read_bandwidth_gbs", lambda: 10.0)
    monkeypatch.setattr(kernel_bench, "cpu_cases", lambda quick: iter([("decode b=2 ctx=2048", [(1, 70)] * 2),
                                                                      ("prefill 40", [(40, 40)])]))
    out = tmp_path / "cpu.json"
    assert kernel_bench.main(["--cpu", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["case"] for r in report["cases"]] == ["decode b=2 ctx=2048", "prefill 40"]
    assert all(r["cpu_ms"] > 0 and r["reference_ms"] > 0 for r in report["cases"])
    assert report["targets"]["decode_ctx2048_min_share_of_read"] > 0


def test_kernel_bench_cpu_spec_cases_time_verification_rows(tmp_path, monkeypatch, load_benchmark):
    """`--cases spec`: verification rows of 1 + k query tokens over the same context as the
    decode rows, and the mixed 40-token step; the issue-14 rows (and their target) left out."""
    kernel_bench = load_benchmark("kernel_bench")
    cases = dict(kernel_bench.spec_cases(quick=False))
    ctx = kernel_bench.SPEC_CONTEXT
    assert cases[f"decode b=16 ctx={ctx}"] == [(1, ctx)] * 16
    assert cases[f"verify q=6 b=16 ctx={ctx}"] == [(6, ctx)] * 16
    assert sum(q for q, _ in cases[f"verify q=4 b=8 + decode b=8 ctx={ctx}"]) == 40
    assert {f"decode b=1 ctx={ctx}", f"verify q=4 b=1 ctx={ctx}"} <= set(cases)
    monkeypatch.setattr(kernel_bench, "CPU_POOL_BYTES", 1 << 20)
    monkeypatch.setattr(kernel_bench, "cpu_read_bandwidth_gbs", lambda: 10.0)
    monkeypatch.setattr(kernel_bench, "SPEC_CONTEXT", 40)
    out = tmp_path / "spec.json"
    assert kernel_bench.main(["--cpu", "--quick", "--cases", "spec", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["case"] for r in report["cases"]] == ["decode b=16 ctx=40", "verify q=4 b=16 ctx=40",
                                                    "verify q=4 b=8 + decode b=8 ctx=40"]
    assert all(r["cpu_ms"] > 0 and r["reference_ms"] > 0 for r in report["cases"])
    assert "targets" not in report and report["cases_sets"] == ["spec"]
    assert report["command"].endswith("--cases spec --json " + str(out)) and report["machine"]["cpu_count"]
    with pytest.raises(SystemExit):
        kernel_bench.main(["--cpu", "--cases", "nope"])
