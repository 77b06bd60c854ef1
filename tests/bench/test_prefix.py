"""`bench prefix` end to end on the tiny random Llama: caching on computes the shared prefix
once per run (the prompt tokens computed say so exactly), n > 1 costs about one prefill, the
no-sharing runs alternate, nothing compiles after warm-up, every page comes back."""

from __future__ import annotations

import json

import pytest

from orca_jax import cli
from orca_jax.bench.prefix import PrefixSettings, shared_prefix_trace


def test_the_trace_shares_one_system_prompt():
    s = PrefixSettings(num_requests=5, prefix_len=40, question_range=(3, 9), output_len=4)
    trace = shared_prefix_trace(s, vocab_size=100, exclude_ids=(0, 1), rate=2.0)
    system = trace.prompts[0][:40]
    assert all(p[:40] == system for p in trace.prompts)
    assert all(3 <= len(p) - 40 <= 9 for p in trace.prompts)
    assert all(t not in (0, 1) for p in trace.prompts for t in p)
    assert trace.output_lens == [4] * 5 and trace.arrival_times[0] == 0 and trace.arrival_times[-1] > 0
    assert trace.prompts == shared_prefix_trace(s, 100, (0, 1)).prompts, "the seed names the workload"
    # max_model_len covers both workloads (Orca's trace at scale 0.25: up to 128 + 32 tokens).
    assert s.max_model_len == 160 and PrefixSettings(overhead_requests=0).max_model_len == 1024 + 128 + 32
    with pytest.raises(ValueError, match="question_range"):
        PrefixSettings(question_range=(5, 2))


def test_bench_prefix_on_the_tiny_model(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "prefix.json"
    code = cli.main(["bench", "prefix", "--model", str(tiny_llama_dir), "--num-requests", "6", "--prefix-len", "48",
                     "--question-range", "4,12", "--output-len", "3", "--rate", "50", "--max-num-seqs", "4",
                     "--max-num-batched-tokens", "32", "--page-size", "8", "--n", "3", "--overhead-requests", "4",
                     "--overhead-rounds", "2", "--json", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    prompt_tokens = record["workload"]["useful_processed_tokens"] - 6 * 3
    for key in ("at_t0", "poisson"):
        on, off = record[key]["on"], record[key]["off"]
        assert on["prompt_tokens"] == off["prompt_tokens"] == prompt_tokens
        assert off["prompt_tokens_computed"] == prompt_tokens and off["prefix_cache_hit_tokens"] == 0
        # The cache is emptied before each run, so the first request computes the 48-token
        # system prompt; each of the 5 others finds its 6 full pages.
        assert on["prefix_cache_hit_tokens"] == 5 * 48
        assert on["prompt_tokens_computed"] == prompt_tokens - 5 * 48
        for mode in (on, off):
            assert mode["summary"]["num_requests"] == 6 and mode["xla_compiles_during_run"] == 0
        assert record[key]["throughput_ratio"] > 0
    n = record["n_samples"]
    assert n["off"]["prefills"] == 3.0 and n["on"]["prefills"] < 2.0
    overhead = record["no_sharing"]
    assert [len(v) for v in overhead["output_tokens_per_s"].values()] == [2, 2]
    assert record["xla_compiles_during_runs"] == 0
    assert "caching costs" in capsys.readouterr().out
