"""`bench spec` end to end on the tiny random Llama (`--quick`): every configuration runs every
(workload, batch) by turns with ratios to the off run of its round, greedy outputs with
speculation are the off run's token for token, the counters agree with the tokens the requests
got, and nothing compiles after warm-up. Plus the workloads themselves."""

from __future__ import annotations

import json

import pytest

from orca_jax import cli
from orca_jax.bench.spec import PASSAGE_SENTENCES, SpecSettings, passage, turn_order


def test_passages_differ_per_request_and_settings_are_checked():
    n = len(PASSAGE_SENTENCES)
    texts = [passage(i, n) for i in range(2 * n)]
    assert len(set(texts)) == 2 * n, "16 requests (and up to 20) see different passages"
    assert texts[0].startswith("Four score and seven years ago") and texts[1].startswith(PASSAGE_SENTENCES[1])
    assert texts[n].startswith(PASSAGE_SENTENCES[-1]), "past one rotation the order is reversed"
    assert all(sorted(t.split()) == sorted(texts[0].split()) for t in texts), "the same words, rearranged"
    assert turn_order(["off", "a", "b"], 0) == ["off", "a", "b"] and turn_order(["off", "a", "b"], 1) == ["b", "a", "off"]
    assert list(SpecSettings().configs) == ["off", "ngram k=3", "ngram k=5", "draft k=3"]
    assert SpecSettings().configs["ngram k=5"] == {"method": "ngram", "num_speculative_tokens": 5,
                                                   "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SpecSettings(batch_sizes=(64,), max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="workloads"):
        SpecSettings(workloads=("copy", "code"))


def test_bench_spec_quick_on_the_tiny_model(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "spec.json"
    code = cli.main(["bench", "spec", "--quick", "--model", str(tiny_llama_dir), "--json", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    labels = ["off", "ngram k=3", "draft k=3"]
    assert list(record["configs"]) == labels
    assert record["engine"]["async_scheduling"] == {"off": True, "ngram k=3": True, "draft k=3": True}
    runs = record["runs"]
    assert len(runs) == 2 * 2 * 2 * 3  # rounds x workloads x batch sizes x configs
    # By turns, the order flipped each round.
    first = [r["config"] for r in runs if (r["round"], r["workload"], r["batch"]) == (0, "copy", 1)]
    second = [r["config"] for r in runs if (r["round"], r["workload"], r["batch"]) == (1, "copy", 1)]
    assert first == second == labels, "runs are listed in label order"
    for r in runs:
        k = record["configs"][r["config"]]["num_speculative_tokens"] if r["config"] != "off" else 0
        assert r["identical_to_off"], (r["workload"], r["batch"], r["config"], r["differing_requests"])
        assert r["xla_compiles_during_run"] == 0
        assert r["output_tokens_per_s"] > 0 and r["engine_steps"] > 0 and r["device_busy_s"] > 0
        expected = 16 * r["batch"] if r["workload"] == "copy" else None
        if expected is not None:
            assert r["emitted_tokens"] == expected
        # Each sampling row emits one token plus the drafts it accepted.
        assert r["accepted_tokens"] <= r["draft_tokens"] <= k * r["spec_rows"]
        assert r["spec_rows"] <= r["sampling_rows"]
        assert r["emitted_tokens"] == r["appended_tokens"] == r["accepted_tokens"] + r["sampling_rows"]
        if k:
            assert 0 < r["propose_calls"] <= r["engine_steps"]
        else:
            assert r["spec_rows"] == r["draft_tokens"] == r["propose_calls"] == 0
            assert r["mean_acceptance_length"] is None and r["throughput_ratio"] == 1.0
        if r["spec_rows"]:
            assert r["mean_acceptance_length"] == pytest.approx(1 + r["accepted_tokens"] / r["spec_rows"])
    # The target as its own draft accepts (nearly) everything it proposes.
    draft = record["cells"]["copy"]["1"]["draft k=3"]
    assert draft["draft_tokens"] > 0 and draft["acceptance_rate"] > 0.9
    assert set(record["cells"]) == {"copy", "random"} and set(record["cells"]["random"]) == {"1", "2"}
    cell = record["cells"]["copy"]["2"]["ngram k=3"]
    assert cell["rounds"] == 2 and len(cell["throughput_ratio_by_round"]) == 2 and cell["identical_to_off"]
    assert record["workloads"]["random"]["requests_by_batch"] == {"1": 2, "2": 4}
    assert record["workloads"]["copy"]["requests_by_batch"] == {"1": 1, "2": 2}
    targets = record["targets"]
    assert set(targets["copy_speedup"]["by_config"]) == {"ngram k=3"}
    assert set(targets["random_no_loss"]["by_config"]["ngram k=3"]) == {"1", "2"}
    assert record["greedy_outputs_identical"] and record["xla_compiles_during_runs"] == 0
    assert record["command"].startswith("orca-jax bench spec --model")
    printed = capsys.readouterr().out
    assert "greedy outputs identical to off: yes" in printed and "XLA compiles during the runs: 0" in printed
