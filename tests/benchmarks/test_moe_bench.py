"""benchmarks/moe_bench.py: its routing, block and parameter accounting are what its docstring
says, its checks catch a wrong grouped matmul, and a run at tiny sizes writes every row of
both parts."""

from __future__ import annotations

import json

import numpy as np
import pytest

TINY_MODEL = ("hidden_size=64,num_layers=1,num_experts=8,num_experts_per_tok=2,moe_intermediate_size=32,"
              "vocab_size=256,num_heads=4,num_kv_heads=2,head_dim=16")


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("moe_bench")


def test_routing_picks_distinct_experts_per_token(bench):
    experts = bench.random_routing(tokens=1, experts=16, top_k=8, seed=3)
    assert len(set(experts.tolist())) == 8 and list(experts) == sorted(experts)
    many = bench.random_routing(tokens=50, experts=16, top_k=4, seed=3)
    sizes = np.bincount(many, minlength=16)
    assert sizes.sum() == 200 and sizes.max() <= 50  # no expert twice for one token


def test_block_layout_and_expected_experts(bench):
    layout = bench.block_layout(np.array([0, 3, 9, 8, 16]), 8)
    assert layout == {"block_rows": 8, "blocks": 0 + 1 + 2 + 1 + 2, "computed_rows": 48}
    assert bench.expected_experts_used(8, 2, 1) == pytest.approx(2)
    assert bench.expected_experts_used(8, 8, 3) == pytest.approx(8)
    assert bench.expected_experts_used(64, 8, 8) == pytest.approx(64 * (1 - (56 / 64) ** 8))


def test_ragged_dot_is_skipped_where_its_cpu_lowering_is_too_big(bench):
    args = bench.parse_args(["--ragged-max-flops", "1e9", "--ragged-max-bytes", "1e6"])
    assert bench.ragged_dot_cpu_cost(16, 32, 8, 4, 4) == (2.0 * 4 * 16 * 32 * 8, 4 * 16 * 32 * 4)
    assert "GFLOP" in bench.skip_reason("ragged_dot", "cpu", 4096, 1024, 768, 64, 4, args)
    assert "GiB" in bench.skip_reason("ragged_dot", "cpu", 64, 1024, 8, 64, 4, args)  # 16 MiB copy, few FLOPs
    assert bench.skip_reason("ragged_dot", "cpu", 8, 16, 8, 4, 4, args) is None
    assert bench.skip_reason("ragged_dot", "gpu", 4096, 1024, 768, 64, 4, args) is None  # its own lowering there
    assert "GPU-only" in bench.skip_reason("ragged_dot_triton", "cpu", 8, 16, 8, 4, 4, args)
    assert bench.skip_reason("blocked", "cpu", 4096, 1024, 768, 64, 4, args) is None


def test_sampled_rows_check_catches_a_wrong_product(bench):
    rng = np.random.default_rng(0)
    lhs, rhs = rng.standard_normal((6, 5), np.float32), rng.standard_normal((3, 5, 4), np.float32)
    experts = np.array([0, 0, 1, 2, 2, 2])
    sample = np.array([5, 0, 3])
    reference = bench.sampled_reference(lhs, rhs, experts, sample)
    right = np.einsum("rk,rkn->rn", lhs, rhs[experts])
    assert bench.relative_error(right, reference, sample) < 1e-6
    wrong = np.einsum("rk,rkn->rn", lhs, rhs[np.roll(experts, 1)])  # rows through the wrong experts
    assert bench.relative_error(wrong, reference, sample) > 0.1


def test_param_counts_and_dense_twin(bench):
    moe = bench.moe_config(bench._model_overrides(TINY_MODEL))
    dense = bench.dense_twin(moe)
    assert (moe.intermediate_size, dense.intermediate_size, dense.model_type) == (64, 64, "qwen3")
    assert dense.num_experts == 0 and dense.num_heads == moe.num_heads and dense.qk_norm
    counts = {}
    for name, config in (("moe", moe), ("dense", dense)):
        _, params = bench.build_model(config, np.float32, "reference")
        counts[name] = bench.param_counts(params, config)
    experts = 1 * 3 * 8 * 64 * 32
    assert counts["moe"]["routed_experts"] == experts
    assert counts["moe"]["active"] == counts["moe"]["total"] - experts + experts * 2 // 8
    # The dense twin is the MoE's active part without the router (D x E per layer).
    assert counts["dense"]["total"] == counts["moe"]["active"] - 64 * 8
    assert counts["dense"]["routed_experts"] == 0 and counts["moe"]["embedding"] == 256 * 64


@pytest.mark.parametrize("argv,message", [(["--shapes", "1:2:3"], "D:F:E:k"),
                                          (["--shapes", "64:32:4:8"], "k <= E"),
                                          (["--impls", "dense,nope"], "choose from"),
                                          (["--moe-model", "intermediate_size=5"], "--moe-model sets"),
                                          (["--moe-model", "num_experts=4,num_experts_per_tok=8"], "--moe-model"),
                                          (["--decode-tokens", "0"], "positive integers")])
def test_bad_arguments_are_refused(bench, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_tiny_run_writes_every_row(bench, tmp_path):
    out = tmp_path / "moe.json"
    # ragged_dot's CPU lowering (E x the FLOPs) fits the limit at 4 tokens, not at 16.
    argv = ["--shapes", "64:32:8:2", "--projections", "up", "--decode-tokens", "4", "--prefill-tokens", "16",
            "--ragged-max-flops", "1e6", "--moe-model", TINY_MODEL, "--step-decode-tokens", "2",
            "--step-prefill-tokens", "8", "--decode-context", "20", "--repeats", "2", "--bandwidth-mib", "4",
            "--json", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "cpu" and isinstance(report["machine"]["cpu_flags"], list)
    assert report["read_bandwidth"]["gb_per_s"] > 0 and report["machine"]["orca_jax"]["path"]
    assert set(report["jax_ragged_dot_flags"]) == set(bench.RAGGED_DOT_FLAGS)

    matmul = [r for r in report["rows"] if r["part"] == "matmul"]
    assert [(r["phase"], r["tokens"], r["rows"]) for r in matmul] == [("decode", 4, 8), ("prefill", 16, 32)]
    for r in matmul:
        impls = r["impls"]
        assert r["flops"] == 2 * r["rows"] * 64 * 32 and (r["K"], r["N"]) == (64, 32)
        assert "GPU-only" in impls["ragged_dot_triton"]["skipped"]
        assert impls["blocked"]["max_rel_error"] < 1e-5 and impls["blocked"]["ms"] > 0
        assert impls["blocked"]["rate_over_dense"] == pytest.approx(impls["dense"]["ms"] / impls["blocked"]["ms"])
        assert impls["dense"]["gflop_per_s"] == pytest.approx(r["flops"] / impls["dense"]["ms"] / 1e6)
        assert r["expert_weight_bytes_read"] == r["experts_used"] * 64 * 32 * 4
        assert r["blocked_layout"]["computed_rows"] >= r["rows"]
    decode, prefill = matmul
    assert decode["impls"]["ragged_dot"]["max_rel_error"] < 1e-5 and decode["impls"]["ragged_dot"]["ms"] > 0
    assert "--ragged-max-flops" in prefill["impls"]["ragged_dot"]["skipped"]

    step = [r for r in report["rows"] if r["part"] == "step"]
    assert [(r["phase"], r["tokens"], r["context"]) for r in step] == [("decode", 2, 20), ("prefill", 8, 8)]
    for r in step:
        assert r["moe_ms"] > 0 and r["dense_ms"] > 0 and r["moe_impl"] == "blocked"
        assert r["moe_over_dense"] == pytest.approx(r["moe_ms"] / r["dense_ms"])
    models = report["models"]
    assert models["moe"]["config"]["model_type"] == "qwen3_moe" and models["dense"]["config"]["model_type"] == "qwen3"
    assert models["dense"]["params"]["total"] == models["moe"]["params"]["active"] - 64 * 8


def test_triton_flag_is_set_for_the_lowering_only(bench):
    import jax
    import jax.numpy as jnp

    before = getattr(jax.config, bench.TRITON_FLAG)
    lhs, rhs = jnp.ones((8, 16)), jnp.ones((4, 16, 8))
    sizes = jnp.array([2, 0, 5, 1], jnp.int32)
    # On CPU the flag changes nothing (the Triton lowering is GPU-only), but it is set and reset.
    compiled, lowering = bench.compile_impl("ragged_dot_triton", lhs, rhs, sizes)
    assert getattr(jax.config, bench.TRITON_FLAG) == before
    assert np.allclose(compiled(lhs, rhs, sizes), 16) and set(lowering) >= {"hlo_ragged_dot", "custom_calls"}


def test_an_impl_too_slow_to_repeat_keeps_its_checked_call(bench, tmp_path):
    out = tmp_path / "slow.json"
    argv = ["--parts", "matmul", "--shapes", "32:16:4:2", "--projections", "up", "--decode-tokens", "2",
            "--prefill-tokens", "8", "--max-seconds", "1e-9", "--bandwidth-mib", "0", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and "read_bandwidth" not in json.loads(out.read_text())
    for row in rows:
        for impl in ("dense", "blocked", "ragged_dot"):
            assert row["impls"][impl]["first_call_only"] and row["impls"][impl]["runs"] == 1


def test_blocked_pow2_runs_the_previous_block_rule_by_turns_with_the_current_one(bench, tmp_path, monkeypatch):
    """`--impls ...,blocked_pow2`: the blocked loop traced under the previous rule (the power of
    two at or above the mean group size), timed beside the current one on the same rows, and
    grouped_mlp's own rule back in place afterwards."""
    from orca_jax.kernels import grouped_mlp

    # The rows of docs/benchmarks.md's rule table: (rows, experts) -> previous rule's block rows.
    assert [bench.block_rows_pow2(m, e) for m, e in ((64, 64), (512, 64), (2048, 64), (4096, 64), (16, 8),
                                                     (128, 8), (512, 8), (1024, 8), (1 << 20, 2))] == [
        8, 8, 32, 64, 8, 16, 64, 128, 256]
    rule, traced = bench.block_rows_pow2, []
    monkeypatch.setattr(bench, "block_rows_pow2", lambda m, e: traced.append((m, e)) or rule(m, e))
    out = tmp_path / "rule.json"
    argv = ["--parts", "matmul", "--shapes", "64:32:8:2", "--projections", "up", "--decode-tokens", "4",
            "--prefill-tokens", "128", "--impls", "dense,blocked,blocked_pow2", "--repeats", "2",
            "--bandwidth-mib", "0", "--json", str(out)]
    assert bench.main(argv) == 0
    assert grouped_mlp.block_rows_for.__module__ == grouped_mlp.__name__
    assert (256, 8) in traced, "the previous rule decided the traced program's blocks"
    prefill = [r for r in json.loads(out.read_text())["rows"] if r["phase"] == "prefill"][0]
    assert prefill["blocked_layout"]["block_rows"] == grouped_mlp.block_rows_for(256, 8) == 48
    assert prefill["blocked_pow2_layout"]["block_rows"] == 32
    for impl in ("blocked", "blocked_pow2"):
        e = prefill["impls"][impl]
        assert e["max_rel_error"] < 1e-5 and e["ms"] > 0 and e["computed_gflop_per_s"] > 0
    assert "blocked_pow2" not in bench.parse_args([]).impls


def test_mxfp4_impls_are_checked_against_their_own_unpacked_weights(bench, tmp_path):
    """The *_mxfp4 impls run the same matmul on the experts packed 4-bit: checked against the
    unpacked values (float32 exact), their weight bytes half a byte per weight plus scales."""
    out = tmp_path / "moe.json"
    argv = ["--parts", "matmul", "--shapes", "64:32:8:2", "--projections", "up", "--decode-tokens", "4",
            "--prefill-tokens", "16", "--ragged-max-flops", "1e6", "--impls", "dense,blocked,blocked_mxfp4,ragged_dot_mxfp4",
            "--repeats", "2", "--bandwidth-mib", "0", "--json", str(out)]
    assert bench.main(argv) == 0
    decode, prefill = [r for r in json.loads(out.read_text())["rows"] if r["part"] == "matmul"]
    for row in (decode, prefill):
        packed = row["impls"]["blocked_mxfp4"]
        assert packed["max_rel_error"] < 1e-5 and packed["ms"] > 0
        assert packed["expert_weight_gb_per_s"] == pytest.approx(
            row["experts_used"] * 64 * 32 * (0.5 + 1 / 32) / packed["ms"] / 1e6)
    assert decode["impls"]["ragged_dot_mxfp4"]["max_rel_error"] < 1e-5
    assert "--ragged-max-flops" in prefill["impls"]["ragged_dot_mxfp4"]["skipped"]
