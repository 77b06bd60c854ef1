"""Pipeline-parallel checks on 8 forced host devices, run as a subprocess by tests/worker/test_pipeline.py
(JAX fixes the device count when it starts; the rest of the suite runs on one device). Prints
one JSON object; the tests assert on it.

    python tests/pipeline_worker.py tokens MODEL_DIR 1x1,2x1,2x2:request,2x2:ep   outputs per PPxTP[:policy|ep] layout
    python tests/pipeline_worker.py overlap MODEL_DIR PP [TP]               stage timestamps
    python tests/pipeline_worker.py checkpoint MODEL_DIR CKPT_DIR PP TP     orbax restore per stage
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from orca_jax import SamplingParams  # noqa: E402
from orca_jax.worker.compile_guard import compile_count  # noqa: E402
from orca_jax.engine.engine import LLMEngine  # noqa: E402
from orca_jax.structured.structured_outputs import StructuredOutputsParams  # noqa: E402

# One token bucket (32); prompts up to 41 tokens are prefilled in chunks; a pool of 40
# pages of 4 tokens (156 usable tokens) is smaller than the workload, so sequences get
# preempted and recomputed.
ENGINE = dict(max_num_seqs=6, max_num_batched_tokens=32, min_token_bucket=32, page_size=4, num_pages=40,
              max_model_len=96, dtype="float32", compilation_cache_dir=None)
PROMPT_LENGTHS = (5, 41, 11, 23, 3, 33)
ABORT_AFTER_STEPS = 4


def workload(vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    requests = [(f"g{i}", rng.integers(3, vocab, size=n).tolist(), greedy) for i, n in enumerate(PROMPT_LENGTHS)]
    requests.append(("n2", rng.integers(3, vocab, size=9).tolist(),
                     SamplingParams(temperature=0.8, top_p=0.9, seed=5, n=2, max_tokens=8, ignore_eos=True)))
    requests.append(("pen", rng.integers(3, vocab, size=7).tolist(),
                     SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.3, max_tokens=8, ignore_eos=True)))
    # Constrained: a grammar's mask needs the sequence's last token on the host, which Orca's
    # rule guarantees without running steps one at a time.
    requests.append(("guided", rng.integers(3, vocab, size=6).tolist(),
                     SamplingParams(temperature=1.0, seed=9, max_tokens=12,
                                    structured_outputs=StructuredOutputsParams(regex=r"[A-Z]{2}-[0-9]{3}"))))
    requests.append(("abort", rng.integers(3, vocab, size=20).tolist(),
                     SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    return requests


def run_layout(model: str, pp: int, tp: int, scheduling: str = "iteration", expert_parallel: bool = False) -> dict:
    engine = LLMEngine(model=model, pipeline_parallel_size=pp, tensor_parallel_size=tp, scheduling=scheduling,
                       enable_expert_parallel=expert_parallel, **ENGINE)
    compile_count()  # the listener is registered before the workload
    compiles = compile_count()
    in_flight_seen = []
    complete = engine._complete

    def complete_and_count(step, touched):  # the batch completing plus those still in flight
        in_flight_seen.append(1 + len(engine._in_flight))
        complete(step, touched)

    engine._complete = complete_and_count
    for request_id, prompt, params in workload(engine.model_config.vocab_size):
        engine.add_request(request_id, prompt, params)
    outputs, texts, finish, steps, pages_peak = {}, {}, {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [o.token_ids for o in out.outputs]
                texts[out.request_id] = out.outputs[0].text
                finish[out.request_id] = [o.finish_reason for o in out.outputs]
        steps += 1
        pages_peak = max(pages_peak, engine.allocator.num_used)
        if steps == ABORT_AFTER_STEPS:
            engine.abort("abort")
    runner = engine.runner
    return {
        "outputs": outputs, "texts": texts, "finish": finish, "steps": steps, "max_in_flight": max(in_flight_seen),
        "preemptions": engine.scheduler.num_preemptions, "pages_used_after": engine.allocator.num_used,
        "pages_peak": pages_peak, "compiles_after_warmup": compile_count() - compiles,
        "stage_layers": [len(s.layers) for s in getattr(runner, "stages", [])],
        "stage_devices": [[d.id for d in s.mesh.devices.flat] for s in getattr(runner, "stages", [])],
    }


def overlap(model: str, pp: int, tp: int = 1) -> dict:
    """Decode-heavy run with the stage clock on: per stage, busy seconds and the fraction of the
    run it waited; how often two stages computed at once."""
    engine = LLMEngine(model=model, pipeline_parallel_size=pp, tensor_parallel_size=tp, max_num_seqs=16,
                       max_num_batched_tokens=64, min_token_bucket=16, page_size=16, num_pages=128,
                       max_model_len=256, dtype="float32", compilation_cache_dir=None)
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(16):
        engine.add_request(str(i), rng.integers(3, engine.model_config.vocab_size, size=16).tolist(), params)
    for _ in range(3):  # past the prefills
        engine.step()
    engine.runner.timeline.enabled = True
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    records = engine.runner.timeline.drain()
    return {"records": [list(r) for r in records], "started": started, "wall_s": time.perf_counter() - started,
            "pp": pp, "tp": tp}


def restore_per_stage(model: str, ckpt: str, pp: int, tp: int) -> dict:
    """Convert to an orbax checkpoint, restore it stage by stage onto the pipeline mesh, and
    compare every stage's arrays with the host's slices; then tokens from the checkpoint."""
    import jax

    from orca_jax.loading.checkpoint import open_checkpoint
    from orca_jax.loading.convert import convert
    from orca_jax.worker.pipeline_layout import make_pipeline_mesh, slice_stage_params, stage_layer_ranges, stage_mesh

    convert(model, ckpt)
    checkpoint = open_checkpoint(ckpt)
    mesh = make_pipeline_mesh(pp, tp)
    rows = [stage_mesh(mesh, s) for s in range(pp)]
    ranges = stage_layer_ranges(checkpoint.config.num_layers, pp)
    host = checkpoint.restore_host("float32")
    tied = checkpoint.config.tie_word_embeddings
    expected = [slice_stage_params(host, r, s == 0, s == pp - 1, tied) for s, r in enumerate(ranges)]
    holders: dict[str, list[int]] = {}
    for s, tree in enumerate(expected):
        for key in tree["params"]:
            holders.setdefault(key, []).append(s)
    stages = checkpoint.restore_stages("float32", mesh, rows, holders)
    mismatches, misplaced = [], []
    for s, (got, want) in enumerate(zip(stages, expected)):
        flat_got = dict(jax.tree_util.tree_flatten_with_path(got)[0])
        for path, leaf in jax.tree_util.tree_flatten_with_path(want)[0]:
            array = flat_got.get(path)
            if array is None or not np.array_equal(np.asarray(array), leaf):
                mismatches.append(f"stage {s} {jax.tree_util.keystr(path)}")
            elif set(array.sharding.device_set) != set(rows[s].devices.flat):
                misplaced.append(f"stage {s} {jax.tree_util.keystr(path)}")
        if len(flat_got) != len(jax.tree_util.tree_flatten_with_path(want)[0]):
            mismatches.append(f"stage {s}: {len(flat_got)} leaves")
    engine = LLMEngine(model=ckpt, pipeline_parallel_size=pp, tensor_parallel_size=tp, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in engine_generate(engine, workload(engine.model_config.vocab_size)[:3],
                                                                params)]
    base = LLMEngine(model=model, **ENGINE)
    base_outputs = [o.outputs[0].token_ids for o in engine_generate(base, workload(base.model_config.vocab_size)[:3],
                                                                    params)]
    return {"mismatches": mismatches, "misplaced": misplaced, "outputs": outputs, "base_outputs": base_outputs}


def engine_generate(engine: LLMEngine, requests, params: SamplingParams) -> list:
    for request_id, prompt, _ in requests:
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[request_id] for request_id, _, _ in requests]


def main() -> None:
    mode, model = sys.argv[1], sys.argv[2]
    if mode == "tokens":
        result = {}
        for layout in sys.argv[3].split(","):  # PPxTP, or PPxTP:POLICY, or PPxTP:ep (expert parallelism)
            shape, _, policy = layout.partition(":")
            pp, tp = (int(x) for x in shape.split("x"))
            expert_parallel = policy == "ep"
            result[layout] = run_layout(model, pp, tp, "iteration" if expert_parallel else policy or "iteration",
                                        expert_parallel)
    elif mode == "checkpoint":
        result = restore_per_stage(model, sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif mode == "overlap":
        result = overlap(model, int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 1)
    else:
        raise SystemExit(f"unknown mode {mode}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
