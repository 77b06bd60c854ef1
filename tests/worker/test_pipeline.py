"""Pipeline parallelism (orca_jax/worker/pipeline.py) and Orca's rule for batches in flight
(orca_jax/core/scheduler/).

The pipelined engines need several devices, and JAX fixes the device count when it starts,
while this suite runs on one: tests/pipeline_worker.py runs them in a subprocess on 8 forced
host devices and reports JSON. The layer split, the scheduler's rule and the overlap analysis
are tested here, in-process.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_jax.bench.stage_overlap import analyze, stage_intervals
from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.core.kv_cache import PageAllocator
from orca_jax.worker.pipeline_layout import slice_stage_params, stage_layer_ranges
from orca_jax.core.sampling_params import SamplingParams
from orca_jax.core.scheduler import Scheduler
from orca_jax.core.sequence import Sequence

MODEL = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=4096)


# ---- the layer split ----------------------------------------------------------------------------
def test_layers_split_contiguously_the_first_stages_taking_the_remainder():
    assert stage_layer_ranges(8, 2) == [range(0, 4), range(4, 8)]
    assert stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layer_ranges(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert stage_layer_ranges(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="at least one layer"):
        stage_layer_ranges(2, 4)


def test_each_stage_keeps_its_own_layers_attention_types():
    """A stage of a model mixing sliding and full layers runs its slice of the layer types
    (its scan index counts from 0), a stage of one kind a static window."""
    import dataclasses

    mixed = dataclasses.replace(MODEL, num_layers=5, sliding_window=8, layer_types=(
        "sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"))
    stages = [mixed.for_layers(r) for r in stage_layer_ranges(5, 2)]
    assert [s.layer_windows() for s in stages] == [(8, 8, None), (8, None)]
    assert [mixed.for_layers(range(0, 2)).mixes_attention_types, stages[0].mixes_attention_types] == [False, True]
    assert MODEL.for_layers(range(1, 2)).layer_types is None


def _tree(num_layers: int, tied: bool) -> dict:
    params = {"embed": np.zeros((10, 4)), "pos_embed": np.zeros((8, 4)),
              "layers": {"attn": {"q_proj": {"kernel": np.arange(num_layers * 2).reshape(num_layers, 2)}}},
              "final_norm": {"scale": np.ones(4)}}
    if not tied:
        params["lm_head"] = np.zeros((4, 10))
        params["lm_head_qscale"] = np.zeros((1, 10))
    return {"params": params}


def test_each_stage_holds_only_its_part_of_the_weights():
    tree = _tree(5, tied=False)
    first = slice_stage_params(tree, range(0, 3), first=True, last=False, tied=False)["params"]
    last = slice_stage_params(tree, range(3, 5), first=False, last=True, tied=False)["params"]
    assert set(first) == {"embed", "pos_embed", "layers"}
    assert set(last) == {"layers", "final_norm", "lm_head", "lm_head_qscale"}
    np.testing.assert_array_equal(first["layers"]["attn"]["q_proj"]["kernel"], np.arange(6).reshape(3, 2))
    np.testing.assert_array_equal(last["layers"]["attn"]["q_proj"]["kernel"], np.arange(6, 10).reshape(2, 2))
    middle = slice_stage_params(_tree(6, tied=False), range(2, 4), first=False, last=False, tied=False)["params"]
    assert set(middle) == {"layers"}
    # A tied head reads the embedding table: the last stage holds it too (not the positions).
    tied_last = slice_stage_params(_tree(4, tied=True), range(2, 4), first=False, last=True, tied=True)["params"]
    assert set(tied_last) == {"embed", "layers", "final_norm"}


def test_speculative_decoding_is_refused_with_a_pipeline():
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineConfig(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        EngineConfig(pipeline_parallel_size=0)


# ---- Orca's rule: batches in flight ---------------------------------------------------------------
def make_scheduler(pipeline: int, num_pages: int, scheduling: str = "iteration", **kw) -> Scheduler:
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=num_pages,
                          max_model_len=64, pipeline_parallel_size=pipeline, scheduling=scheduling,
                          enable_prefix_caching=False, **kw).resolve(MODEL)
    return Scheduler(config, PageAllocator(config.num_pages, config.page_size))


def test_a_sequence_in_flight_is_not_scheduled_again():
    sched = make_scheduler(pipeline=2, num_pages=40)
    a = Sequence(0, "a", 0, list(range(3, 9)), SamplingParams(max_tokens=4), seed=0)
    b = Sequence(1, "b", 0, list(range(3, 30)), SamplingParams(max_tokens=4), seed=1)
    sched.add(a)
    first = sched.schedule()
    assert [s.seq_id for s in first.seqs] == [0]
    sched.add(b)
    second = sched.schedule()  # a's token is in flight: only b
    assert [s.seq_id for s in second.seqs] == [1] and a.num_in_flight == 1
    assert not sched.schedule()  # both in flight: nothing to schedule
    sched.postprocess(first, [7])
    third = sched.schedule()  # a is back; b's prefill chunk is still in flight
    assert [s.seq_id for s in third.seqs] == [0]


def test_one_stage_keeps_overlapped_steps():
    """P = 1 is today's engine: a decoding sequence's next step is scheduled while its token is
    still in flight (resolved on the device)."""
    sched = make_scheduler(pipeline=1, num_pages=40)
    a = Sequence(0, "a", 0, list(range(3, 9)), SamplingParams(max_tokens=4), seed=0)
    sched.add(a)
    first, second = sched.schedule(), sched.schedule()
    assert [s.seq_id for s in second.seqs] == [0] and a.num_in_flight == 2
    sched.postprocess(first, [7])
    sched.postprocess(second, [8])
    assert a.num_in_flight == 0


def test_pages_of_an_aborted_sequence_wait_for_its_batch():
    sched = make_scheduler(pipeline=2, num_pages=40)
    a = Sequence(0, "a", 0, list(range(3, 12)), SamplingParams(max_tokens=4), seed=0)
    sched.add(a)
    batch = sched.schedule()
    pages = list(a.page_ids)
    sched.finish(a, "abort")
    assert all(sched.allocator.ref_count(p) == 1 for p in pages)  # still the batch's to write
    assert sched.allocator.num_used == len(pages)
    sched.postprocess(batch, [7])  # its token is discarded, its pages return
    assert sched.allocator.num_used == 0 and sched.num_discarded_tokens == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipeline=st.integers(2, 4), num_pages=st.integers(8, 30), scheduling=st.sampled_from(["iteration", "request"]),
       requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=10),
       actions=st.lists(st.integers(0, 9), min_size=1, max_size=200))
def test_batches_in_flight_never_share_a_sequence_nor_lose_a_page(pipeline, num_pages, scheduling, requests,
                                                                  actions):
    """Random arrivals, lengths, aborts and tiny pools, up to `pipeline` batches in flight,
    completed oldest first: no sequence is ever in two batches in flight, and no page a batch in
    flight holds is freed (so none is reassigned) before the batch returns."""
    sched = make_scheduler(pipeline, num_pages, scheduling)
    seqs = [Sequence(i, str(i), 0, list(range(3, 3 + n)), SamplingParams(max_tokens=m, ignore_eos=True), seed=i)
            for i, (n, m) in enumerate(requests) if n + m <= 64 and -(-(n + m) // 4) < num_pages]
    pending, in_flight = list(seqs), []  # in_flight: (batch, {page: held})

    def check() -> None:
        members = [s.seq_id for batch, _ in in_flight for s in batch.seqs]
        assert len(members) == len(set(members)), "a sequence in two batches in flight"
        for batch, pages in in_flight:
            for page in pages:
                assert sched.allocator.ref_count(page) > 0, f"page {page} freed while its batch is in flight"

    def complete_oldest() -> None:
        batch, _ = in_flight.pop(0)
        sched.postprocess(batch, [5] * len(batch))

    for action in actions:
        if action < 3 and pending:
            sched.add(pending.pop(0))
        elif action < 7 and len(in_flight) < pipeline:
            batch = sched.schedule()
            if batch:
                in_flight.append((batch, {p for s in batch.seqs for p in s.page_ids}))
        elif action < 9 and in_flight:
            complete_oldest()
        else:
            live = [s for s in seqs if not s.is_finished and s.status.name != "FINISHED" and s in
                    sched.running + list(sched.waiting)]
            if live:
                sched.finish(live[action % len(live)], "abort")
        check()
    for seq in pending:
        sched.add(seq)
    for _ in range(2000):  # drain
        if not (in_flight or sched.has_unfinished()):
            break
        if len(in_flight) < pipeline and (batch := sched.schedule()):
            in_flight.append((batch, {p for s in batch.seqs for p in s.page_ids}))
        elif in_flight:
            complete_oldest()
        check()
    assert not in_flight and not sched.has_unfinished()
    assert sched.allocator.num_used == 0
    assert all(s.num_in_flight == 0 and not s.pages_in_flight for s in seqs)


# ---- the overlap analysis -------------------------------------------------------------------------
def test_stage_intervals_follow_the_stage_and_batch_order():
    # (batch, stage, enqueued, done): batch 1's stage 0 runs while batch 0's stage 1 does.
    records = [(0, 0, 0.0, 1.0), (0, 1, 0.0, 2.0), (1, 0, 0.1, 2.0), (1, 1, 0.1, 3.0)]
    intervals = stage_intervals(records)
    assert intervals[0] == [(0, 0.0, 1.0), (1, 1.0, 2.0)]
    assert intervals[1] == [(0, 1.0, 2.0), (1, 2.0, 3.0)]
    report = analyze(records)
    assert report["makespan_s"] == 3.0
    assert report["two_or_more_stages_busy_fraction"] == pytest.approx(1 / 3)
    assert [s["busy_s"] for s in report["stages"]] == [2.0, 2.0]


# ---- the engine on 8 forced devices ---------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_layouts(tiny_llama_factory, run_parallel_worker) -> dict:
    # 4 layers, GQA 8 query heads over 2 KV heads (TP 4 replicates the KV heads).
    model = tiny_llama_factory(seed=3, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
    return run_parallel_worker("tokens", str(model), "1x1,2x1,4x1,2x2,2x4,2x1:request,2x1:request_padded",
                               worker="pipeline_worker.py")


@pytest.fixture(scope="module")
def gpt2_layouts(tiny_hf_model_factory, run_parallel_worker) -> dict:
    # 3 layers over 2 stages: an uneven split (2 + 1); the tied head on the last stage.
    model = tiny_hf_model_factory("GPT2Config", seed=1, random_biases=True, n_embd=64, n_layer=3, n_head=4,
                                  n_inner=128, n_positions=256, initializer_range=0.1)
    return run_parallel_worker("tokens", str(model), "1x1,2x1", worker="pipeline_worker.py")


@pytest.fixture(scope="module")
def moe_layouts(tiny_hf_model_factory, run_parallel_worker) -> dict:
    # A mixture of experts (Qwen3-MoE, 8 experts, top-2) as stages, the second layout with its
    # experts expert-parallel inside each stage's row; 3 layers: an uneven split.
    model = tiny_hf_model_factory("Qwen3MoeConfig", seed=4, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256, intermediate_size=128,
                                  moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16,
                                  norm_topk_prob=True, initializer_range=0.1)
    return run_parallel_worker("tokens", str(model), "1x1,2x1,2x2:ep", worker="pipeline_worker.py")


@pytest.fixture(scope="module")
def gemma2_layouts(tiny_hf_model_factory, run_parallel_worker) -> dict:
    # Gemma 2's sliding (window 6, below most prompts) and full layers alternating: 4 layers over
    # 2 stages, each stage one of each, its layers' windows its own slice of the model's.
    model = tiny_hf_model_factory("Gemma2Config", seed=5, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                                  query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                  max_position_embeddings=256, initializer_range=0.1)
    return run_parallel_worker("tokens", str(model), "1x1,2x1", worker="pipeline_worker.py")


@pytest.fixture(params=["llama", "gpt2", "moe", "gemma2"])
def layouts(request) -> dict:
    return request.getfixturevalue(f"{request.param}_layouts")


def test_pipelined_tokens_equal_one_device(layouts):
    base = layouts["1x1"]
    assert base["preemptions"] >= 1  # the pool is small enough to preempt
    assert base["finish"]["abort"] == ["abort"]
    for layout, run in layouts.items():  # PPxTP[:policy]: the request-level policies run on a pipeline too
        pp, tp = (int(x) for x in layout.partition(":")[0].split("x"))
        for request_id, tokens in base["outputs"].items():
            if request_id != "abort":  # aborted mid-run: its length depends on the batching
                assert run["outputs"][request_id] == tokens, (layout, request_id)
        assert run["finish"]["abort"] == ["abort"], layout
        assert run["outputs"]["n2"][0] != run["outputs"]["n2"][1]  # n = 2: two seeded samples
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", run["texts"]["guided"]), (layout, run["texts"]["guided"])
        assert run["pages_used_after"] == 0, layout
        assert run["compiles_after_warmup"] == 0, layout
        if pp > 1:
            # Several batches in flight, never more than the stages. (How many depends on how
            # the running sequences split into disjoint batches: with 4 stages this workload
            # reaches 3.)
            assert run["max_in_flight"] <= pp, layout
            if layout.partition(":")[2] in ("", "ep"):  # iteration-level: batches in flight at once (a static batch may fill one)
                assert run["max_in_flight"] >= 2, layout
            assert len(run["stage_devices"]) == pp and all(len(d) == tp for d in run["stage_devices"])
            devices = [d for stage in run["stage_devices"] for d in stage]
            assert len(set(devices)) == pp * tp  # every stage on its own devices


def test_uneven_split_runs_the_first_stage_heavier(gpt2_layouts, llama_layouts):
    assert gpt2_layouts["2x1"]["stage_layers"] == [2, 1]
    assert llama_layouts["4x1"]["stage_layers"] == [1, 1, 1, 1]
    assert llama_layouts["2x4"]["stage_layers"] == [2, 2]


def test_batches_overlap_across_stages(tiny_llama_factory, run_parallel_worker):
    """From the stage clock: while stage 1 computes one batch, stage 0 computes the next. The
    forced CPU devices share the cores, so this shows the structure, not a speed-up."""
    model = tiny_llama_factory(seed=3, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
    result = run_parallel_worker("overlap", str(model), "2", worker="pipeline_worker.py")
    records = result["records"]
    batches = {r[0] for r in records}
    assert len(records) == 2 * len(batches) and len(batches) >= 10  # every batch crossed both stages
    done = {(b, s): end for b, s, _, end in records}
    # (Each stage's watcher thread stamps its outputs as it wakes, so under load a stage's
    # stamp can trail a later stage's: the analysis clamps intervals to their order, and only
    # the overlap is asserted.)
    # Stage 0 finished a later batch before stage 1 finished an earlier one: two in flight.
    assert any(done[(b + 1, 0)] < done[(b, 1)] for b in batches if (b + 1, 0) in done)
    report = analyze(records)
    assert report["two_or_more_stages_busy_fraction"] > 0.0
    assert all(0.0 <= s["busy_fraction"] <= 1.0 for s in report["stages"])


def test_checkpoint_restores_each_stage_on_its_own_devices(tiny_llama_factory, run_parallel_worker, tmp_path):
    """orbax reads the layers sharded over the stage axis: every stage's arrays equal the host's
    slices and lie on that stage's devices only; the engine from the checkpoint gives the
    tokens of one device."""
    model = tiny_llama_factory(seed=3, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
    result = run_parallel_worker("checkpoint", str(model), str(tmp_path / "ckpt"), "2", "2",
                                 worker="pipeline_worker.py")
    assert result["mismatches"] == [] and result["misplaced"] == []
    assert result["outputs"] == result["base_outputs"]
