"""Core-engine check on a GPU: correctness against the CPU path, compiles, step speed.

Run on a machine with a GPU (jax[cuda]); it refuses to run without one:

    python benchmarks/gpu_engine_check.py --out gpu_engine_check.json

1. Parity: a tiny random Llama, the same batches through the engine on CPU and on GPU (float32,
   matmul precision "highest"): max abs logit difference and identical greedy tokens.
2. Serving: a Llama-3.2-1B-shaped model with random bfloat16 weights (written as a safetensors
   checkpoint, so the real loader runs), warm-up time and program count, zero XLA compiles
   while serving, and decode-step throughput at several batch sizes.

Random weights stand in for downloads (the GPU machine has no network); the numbers measure the
engine, not the model's quality.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from orca_jax.bench.arguments import nonempty_sizes
from orca_jax.bench.environment import record_header
from orca_jax.bench.harness import ReportFile
from orca_jax.bench.random_model import write_random_checkpoint

LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                    rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                    model_type="llama", bos_token_id=1, eos_token_id=2)
TINY = dict(LLAMA_3_2_1B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


def check_parity(workdir: Path) -> dict:
    """Same engine batches on CPU and GPU; logits and greedy tokens must agree."""
    from orca_jax.engine.engine import LLMEngine
    from orca_jax.worker.runner import ModelRunner
    from orca_jax.core.sampling_params import SamplingParams

    path = write_random_checkpoint(workdir / "tiny", TINY, "float32")
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 40, 9)]
    logits_by_backend, tokens_by_backend = {}, {}
    for backend in ("cpu", "gpu"):
        with jax.default_device(jax.devices(backend)[0]), jax.default_matmul_precision("highest"):
            engine = LLMEngine(model=str(path), max_num_seqs=4, max_num_batched_tokens=32, page_size=8,
                               num_pages=64, max_model_len=128, warmup=False, async_scheduling=False,
                               make_runner=functools.partial(ModelRunner, keep_logits=True))
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            rows, tokens = [], {}
            while engine.has_unfinished_requests():  # synchronous: each step() completes its own step
                for out in engine.step():
                    if out.finished:
                        tokens[out.request_id] = list(out.outputs[0].token_ids)
                step = engine.last_step
                rows.append(step.output.logits[: len(step.scheduled)])
            logits_by_backend[backend], tokens_by_backend[backend] = np.concatenate(rows), tokens
    diff = float(np.abs(logits_by_backend["cpu"] - logits_by_backend["gpu"]).max())
    same = tokens_by_backend["cpu"] == tokens_by_backend["gpu"]
    return {"max_abs_logit_diff": diff, "greedy_tokens_identical": same, "ok": same and diff < 1e-3}


def check_serving(workdir: Path, batch_sizes: list[int], context: int) -> dict:
    """Warm-up, zero compiles while serving, and decode steps/s at each batch size."""
    from orca_jax.worker.compile_guard import compile_count, no_compiles
    from orca_jax.engine.engine import LLMEngine
    from orca_jax.core.sampling_params import SamplingParams

    path = write_random_checkpoint(workdir / "llama-1b", LLAMA_3_2_1B, "bfloat16")
    start = time.perf_counter()
    compiles_before = compile_count()
    engine = LLMEngine(model=str(path), dtype="bfloat16", max_num_seqs=max(batch_sizes),
                       max_num_batched_tokens=max(512, max(batch_sizes)), max_model_len=context + 256)
    result = {"startup_s": time.perf_counter() - start, "warmup_compiles": compile_count() - compiles_before,
              "token_buckets": list(engine.config.token_buckets), "num_pages": engine.runner.num_pages,
              "decode": []}
    rng = np.random.default_rng(0)
    with no_compiles("GPU serving"):
        for batch in batch_sizes:
            for i in range(batch):
                engine.add_request(f"b{batch}-{i}", rng.integers(3, engine.model_config.vocab_size, context).tolist(),
                                   SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
            while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
                engine.step()  # prefill everything first
            times = []
            for _ in range(32):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            median = float(np.median(times))
            result["decode"].append({"batch": batch, "context": context, "median_step_ms": median * 1e3,
                                     "tokens_per_s": batch / median})
            while engine.has_unfinished_requests():
                engine.step()
    result["compiles_while_serving"] = 0  # no_compiles() would have raised otherwise
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_engine_check.json")
    parser.add_argument("--batch-sizes", type=nonempty_sizes, default=(1, 16, 64, 256))
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args(argv)
    if not any(d.platform == "gpu" for d in jax.devices()):
        print(f"gpu_engine_check: no GPU visible to JAX (devices: {jax.devices()}); this check needs one",
              file=sys.stderr)
        return 2
    command = shlex.join(["python", "benchmarks/gpu_engine_check.py", *(sys.argv[1:] if argv is None else argv)])
    out = ReportFile(args.out, {**record_header("gpu_engine_check", command),
                                "device": str(jax.devices("gpu")[0].device_kind)})
    report = out.record
    with tempfile.TemporaryDirectory() as tmp:
        report["parity"] = check_parity(Path(tmp))
        print("parity:", report["parity"], flush=True)
        out.save()
        report["serving"] = check_serving(Path(tmp), list(args.batch_sizes), args.context)
        print("serving:", json.dumps(report["serving"], indent=1), flush=True)
    out.save()
    return 0 if report["parity"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
