"""Do the batches in flight of a pipeline really overlap? Forced host devices, a random Llama
model, the stage clock on (orca_jax/worker/pipeline.py: StageTimeline), analysed by
orca_jax/bench/stage_overlap.py.

    python benchmarks/pipeline_overlap.py [--json docs/pipeline_cpu.json] [--layouts 2x1,4x1,2x2]

Per layout (PP x TP): per stage the seconds it computed and the fraction of the run it waited,
the fraction of the run with two or more stages computing at once, and decode throughput next
to one device in the same process. On a CPU the forced devices share the cores, so the
throughput column shows the cost of the structure here, not a speed-up; on accelerators each
stage has its own. A script, not part of the package: the device count must be forced before
JAX starts.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from orca_jax import SamplingParams  # noqa: E402
from orca_jax.bench.arguments import names  # noqa: E402
from orca_jax.bench.environment import record_header  # noqa: E402
from orca_jax.bench.harness import write_json  # noqa: E402
from orca_jax.bench.random_model import write_random_checkpoint  # noqa: E402
from orca_jax.bench.stage_overlap import analyze  # noqa: E402
from orca_jax.engine.engine import LLMEngine  # noqa: E402

# Large enough that a stage's compute outweighs dispatching it (about 10 ms per stage here).
MODEL = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=2048, hidden_size=512,
             intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, hidden_act="silu")
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=64, min_token_bucket=16, page_size=16, num_pages=256,
              max_model_len=256, dtype="float32", compilation_cache_dir=None)
NUM_REQUESTS, PROMPT_LEN, MAX_TOKENS = 16, 16, 32


def run(model: str, pp: int, tp: int) -> dict:
    engine = LLMEngine(model=model, pipeline_parallel_size=pp, tensor_parallel_size=tp, **ENGINE)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(NUM_REQUESTS):
        engine.add_request(str(i), rng.integers(3, MODEL["vocab_size"], size=PROMPT_LEN).tolist(), params)
    for _ in range(3):  # past the prefills
        engine.step()
    timeline = getattr(engine.runner, "timeline", None)
    if pp > 1:
        timeline.enabled = True
    tokens_before = sum(len(s.output_token_ids) for r in engine.requests.values() for s in r.seqs)
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - started
    record = {"layout": f"{pp}x{tp}", "decode_tokens_per_s": (NUM_REQUESTS * MAX_TOKENS - tokens_before) / wall,
              "steps": engine.num_steps}
    if pp > 1:
        record["stage_layers"] = [len(s.layers) for s in engine.runner.stages]
        record.update(analyze(timeline.drain()))
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", type=names, default=("2x1", "4x1", "2x2"), help="PPxTP, comma-separated")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_random_checkpoint(Path(tmp) / "model", MODEL, "float32"))
        records = [run(model, 1, 1)]
        for layout in args.layouts:
            pp, tp = (int(x) for x in layout.split("x"))
            records.append(run(model, pp, tp))
    base = records[0]["decode_tokens_per_s"]
    for r in records:
        r["throughput_vs_one_device"] = r["decode_tokens_per_s"] / base
        line = f"{r['layout']:>4}: {r['decode_tokens_per_s']:7.1f} tok/s ({r['throughput_vs_one_device']:.2f}x)"
        if "stages" in r:
            line += (f", two or more stages busy {100 * r['two_or_more_stages_busy_fraction']:.0f}% of the run; "
                     + ", ".join(f"stage {s['stage']} busy {100 * s['busy_fraction']:.0f}% "
                                 f"(median {s['median_batch_ms']:.1f} ms/batch)" for s in r["stages"]))
        print(line)
    result = {**record_header("pipeline_overlap", shlex.join(["python", *sys.argv])), "model": MODEL, "engine": ENGINE,
              "runs": records}
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
