"""`bench structured` end to end on the tiny random Llama: every request makes exactly its
tokens, the constrained ones read as the start of a JSON document whatever the random weights
want, the fractions take turns with ratios to the 0% run of their round, the mask fills are
counted on the constrained runs only, and nothing compiles after warm-up. Plus the JSON prefix
check itself, which the benchmark's validity rests on."""

from __future__ import annotations

import json

import pytest

from orca_jax import cli
from orca_jax.bench.structured import StructuredSettings, json_prefix_error, turn_order

FULL = json.dumps({"records": [{"id": 7, "name": "a \"quoted\" \\ name \u00e9"}], "x": -1.5e-3, "t": True,
                   "n": None, "e": [], "o": {}})


def test_every_prefix_of_a_json_document_is_a_json_prefix():
    for end in range(len(FULL) + 1):
        assert json_prefix_error(FULL[:end]) is None, FULL[:end]


@pytest.mark.parametrize("text", ["}", '{"a" 1', '{"a": 01', '{"a": tx', "[1,]", '{"a": 1}}', '{"a": 1} x',
                                  "{1: 2}", '"\\q"', "[1 2]", '{"a": 1.e5}', '{"a": "x\ny"}', "{,}", "nul "])
def test_what_no_json_document_starts_with(text):
    assert json_prefix_error(text) is not None


def test_settings_and_the_order_of_turns():
    s = StructuredSettings(fractions=(1.0, 0.0, 0.5))
    assert turn_order(s, 0) == [("async", 0.0), ("async", 0.5), ("async", 1.0), ("sync", 0.0)]
    assert turn_order(s, 1) == [("sync", 0.0), ("async", 1.0), ("async", 0.5), ("async", 0.0)]
    assert turn_order(StructuredSettings(sync_baseline=False), 0) == [("async", 0.0), ("async", 0.5), ("async", 1.0)]
    assert StructuredSettings(prompt_len=16, output_len=64, page_size=16).max_model_len == 80
    with pytest.raises(ValueError, match="include 0"):
        StructuredSettings(fractions=(0.5, 1.0))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        StructuredSettings(num_seqs=(64,), max_num_batched_tokens=32)


def test_bench_structured_on_the_tiny_model(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "structured.json"
    code = cli.main(["bench", "structured", "--model", str(tiny_llama_dir), "--num-seqs", "4", "--rounds", "2",
                     "--output-len", "12", "--prompt-len", "5", "--min-items", "50", "--max-num-batched-tokens", "8",
                     "--page-size", "8", "--compile-repeats", "1", "--json", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    cell = record["by_num_seqs"]["4"]
    runs = cell["runs"]
    assert [(r["round"], r["scheduling"], r["fraction"]) for r in runs] == [
        (0, "async", 0.0), (0, "async", 0.5), (0, "async", 1.0), (0, "sync", 0.0),
        (1, "sync", 0.0), (1, "async", 1.0), (1, "async", 0.5), (1, "async", 0.0)]
    for r in runs:
        assert r["num_constrained"] == round(4 * r["fraction"])
        assert r["output_tokens"] == 4 * 12 and r["xla_compiles_during_run"] == 0
        assert r["constrained_invalid_json_prefixes"] == 0
        assert r["output_tokens_per_s"] > 0 and r["median_decode_step_s"] > 0 and r["decode_steps_timed"] > 0
        # A mask per step while a constrained sequence samples, none otherwise.
        assert (r["mask_fills"] > 0) == (r["num_constrained"] > 0)
        if r["fraction"] == 0.0 and r["scheduling"] == "async":
            assert r["throughput_ratio"] == 1.0 and r["decode_step_ratio"] == 1.0
        if r["num_constrained"]:
            assert r["sample_constrained_output"].startswith('{"records": [')
    assert list(cell["by_variant"]) == ["0", "0.5", "1", "0 sync"]
    assert cell["by_variant"]["1"]["median_mask_fill_s"] > 0
    assert cell["masking_alone"]["apply_token_bitmask_s"] > 0
    # A difference of two timings, so noise can make it negative on a loaded machine: check
    # that it is the timeline's sum, not its sign.
    free, guided = cell["by_variant"]["0"]["decode_step_parts"], cell["by_variant"]["1"]["decode_step_parts"]
    extra_idle = (guided["device_idle_s"] or 0.0) - (free["device_idle_s"] or 0.0)
    assert cell["accounted_cost_all_constrained"] == pytest.approx(
        (extra_idle + cell["masking_alone"]["apply_token_bitmask_s"]) / free["period_s"])
    compile_times = record["grammar_compile"]
    assert compile_times["tokenizer_wrap_s"] > 0 and len(compile_times["schemas"]) == 6
    assert all(c["compile_s"] > 0 and c["validate_s"] > 0 for c in compile_times["schemas"].values())
    assert record["target"] == {"num_seqs": 64, "fraction": 1.0, "max_cost": 0.1, "measured": False, "met": None}
    assert record["xla_compiles_during_runs"] == 0 and record["constrained_invalid_json_prefixes"] == 0
    assert record["command"].startswith("orca-jax bench structured --model")
    printed = capsys.readouterr().out
    assert "XLA compiles during the runs: 0" in printed and "not measured" in printed
