"""The cost model: the shipped GPT-3 175B file loads, its sizes are GPT-3's, and step times
behave like a roofline (decode bound by weight reads, long prefills by FLOPs)."""

from __future__ import annotations

import dataclasses
import importlib.resources

import pytest

from orca_jax.bench.cost_model import StepWork, load_cost_model


@pytest.fixture(scope="module")
def gpt3():
    return load_cost_model("gpt3-175b-16xa100")


def test_shipped_model_is_gpt3_175b_on_16_gpus(gpt3):
    assert gpt3.num_gpus == 16
    assert gpt3.num_params == pytest.approx(175e9, rel=0.01)
    assert gpt3.weight_bytes_per_gpu() == pytest.approx(2 * gpt3.num_params / 16)
    # Whatever the weights leave of 40 GB (minus the reserve) holds the KV cache.
    pool_bytes = gpt3.kv_pool_pages() * gpt3.engine["page_size"] * gpt3.kv_bytes_per_token_per_gpu()
    free = gpt3.gpu["memory_bytes"] - gpt3.gpu["reserved_bytes"] - gpt3.weight_bytes_per_gpu()
    assert free - gpt3.engine["page_size"] * gpt3.kv_bytes_per_token_per_gpu() < pool_bytes <= free


def _decode(batch: int, context: int = 300) -> StepWork:
    return StepWork(new_tokens=batch, kv_tokens_read=batch * context, attention_pairs=batch * (context + 1),
                    logit_rows=batch)


def test_decode_is_weight_bound_and_prefill_is_compute_bound(gpt3):
    one, sixteen = gpt3.step_time(_decode(1)), gpt3.step_time(_decode(16))
    weights_s = gpt3.weight_bytes_per_gpu() * gpt3.parallelism["pipeline_parallel"] / (
        gpt3.gpu["hbm_bytes_per_s"] * gpt3.efficiency["memory"])
    assert weights_s < one < 1.3 * weights_s  # reading the weights dominates a decode step
    assert one < sixteen < 1.2 * one  # so batching decodes is nearly free
    prefill = gpt3.step_time(StepWork(new_tokens=4096, kv_tokens_read=0, attention_pairs=8 * 512 * 513 // 2,
                                      logit_rows=8))
    flops_s = 2 * gpt3.num_params * 4096 / gpt3.num_gpus / (gpt3.gpu["peak_flops"] * gpt3.efficiency["matmul"])
    assert prefill > flops_s * gpt3.parallelism["pipeline_parallel"] * 0.9 and prefill > 5 * sixteen


def test_step_time_grows_with_every_kind_of_work(gpt3):
    base = StepWork(64, 10_000, 20_000, 8)
    t = gpt3.step_time(base)
    for more in (StepWork(4096, 10_000, 20_000, 8), StepWork(64, 10_000_000, 20_000, 8),
                 StepWork(64, 10_000, 2_000_000_000, 8), StepWork(64, 10_000, 20_000, 4096)):
        assert gpt3.step_time(more) > t


def test_bad_cost_model_files_name_the_key(tmp_path):
    text = (importlib.resources.files("orca_jax.bench") / "cost_models" / "gpt3-175b-16xa100.toml").read_text()
    typo = tmp_path / "typo.toml"
    typo.write_text(text.replace("peak_flops", "peak_flop"))
    with pytest.raises(ValueError, match="gpu.peak_flops"):
        load_cost_model(typo)
    extra = tmp_path / "extra.toml"
    extra.write_text(text + "\n[extra]\nx = 1\n")
    with pytest.raises(ValueError, match="extra"):
        load_cost_model(extra)
    with pytest.raises(FileNotFoundError, match="gpt3-175b-16xa100"):
        load_cost_model("no-such-model")


# ---- pipeline stages ----------------------------------------------------------------------------
def _with(cost, **sections):
    return dataclasses.replace(cost, **{k: {**getattr(cost, k), **v} for k, v in sections.items()})


@pytest.mark.parametrize("work", [StepWork(1, 300, 301, 1), StepWork(32, 9000, 9032, 32),
                                  StepWork(8000, 0, 4_000_000, 20)])
def test_stage_times_and_hops_add_up_to_step_time(gpt3, work):
    for layers, stages, split in ((96, 2, [48, 48]), (95, 2, [48, 47]), (97, 3, [33, 32, 32]), (96, 1, [96])):
        cost = _with(gpt3, model={"num_layers": layers}, parallelism={"pipeline_parallel": stages})
        assert cost.stage_layers == split and cost.layers_per_stage == split[0]
        times = cost.stage_times(work)
        assert len(times) == stages
        assert cost.step_overhead_s + sum(times) + (stages - 1) * cost.hop_time(work) == pytest.approx(
            cost.step_time(work), rel=1e-12)
        if stages == 2 and layers == 96:  # even split: the last stage is longer by the LM head only
            assert times[1] > times[0]
