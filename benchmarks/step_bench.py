"""One engine decode step on a GPU, against its memory roofline.

    python benchmarks/step_bench.py                          # batches 64 and 256, context 1024
    python benchmarks/step_bench.py --batch-sizes 64,256 --context 2048 --json step_bench.json
    python benchmarks/step_bench.py --modes sync --no-reference  # one engine only
    python benchmarks/step_bench.py --quantization int8 --kv-cache-dtype int8 --modes async --no-reference

A Llama-3.2-1B-shaped model (16 layers, 32 query / 8 KV heads, head_dim 64, vocabulary 128256,
tied embeddings) with random bfloat16 weights, written as a safetensors checkpoint so the real
loader runs (the GPU machine has no network). For each batch size: fill the batch with prompts
of `--context` tokens, prefill them (every request asks for enough tokens to still be decoding
afterwards), then time 32 decode steps of `LLMEngine.step()` with exactly that many sequences
(schedule, build the batch, run the jitted step, sample, post-process), report the median, and
abort the requests. The timed steps run with the engine's step timeline on
(`orca_jax.engine.step_timing`): the device step time and the device's idle share between
consecutive steps come from its timestamps, beside the median `step()` wall time.

Modes (issue 13): `--modes sync,async` runs one engine per scheduling mode
(`async_scheduling=False/True`; the second loads the programs it shares with the first from
the compilation cache), then the attention reference once, synchronously (`--no-reference` skips it). Each row
is written to the JSON as soon as it is measured, so a stage cut by its time limit keeps them.

Roofline: a decode step must read every weight once (the tied embedding once, as the LM head)
and every sequence's K/V for every layer, so its floor is (weight bytes + KV bytes) / copy
bandwidth, the copy measured on the same GPU. Target (issue 3): 60% of the roofline's
tokens/s. The same steps also run with attention_impl="reference" for the ratio the kernel buys.

Quantized (issue 18): `--quantization int8|fp8` and `--kv-cache-dtype int8|fp8_e4m3` run the
same steps on 8-bit weights / cache; the roofline then counts the bytes the engine really holds
(its weights' nbytes, the cache's bytes per token with their scales), so "share of roofline"
says whether the dequantization hides behind the weight reads.

Without a GPU it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import gc
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine_check import LLAMA_3_2_1B  # noqa: E402
from kernel_bench import copy_bandwidth_gbs, require_gpu  # noqa: E402

# The step timeline's watcher needs the GIL to stamp a step's end; by default it waits up to
# 5 ms for it while the host loop runs Python.
SWITCH_INTERVAL_S = 1e-4


def weight_bytes(config: dict, itemsize: int = 2) -> int:
    D, F, V, L = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["num_hidden_layers"]
    N, K, H = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    per_layer = D * (N * H + 2 * K * H) + N * H * D + 3 * D * F + 2 * D
    head = V * D * (1 if config["tie_word_embeddings"] else 2)
    return itemsize * (L * per_layer + head + D)


def kv_bytes_per_token(config: dict, itemsize: int = 2) -> int:
    return itemsize * config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"]


def tokens_per_request(batch: int, context: int, budget: int, steps: int) -> int:
    """max_tokens that keeps every sequence decoding through the timed steps: prefilling the
    batch takes about batch * context / budget steps, during which the first sequences already
    decode one token per step."""
    return steps + 8 + -(-batch * context // budget)


def time_decode_steps(engine, batch: int, context: int, steps: int = 32) -> dict:
    """Median seconds of one decode `step()` with exactly `batch` sequences, their mean cached
    tokens during the timed steps (for the KV bytes of the roofline), and what the step
    timeline says of those steps (device step, device idle share, host work)."""
    from orca_jax.core.sampling_params import SamplingParams
    from orca_jax.engine.step_timing import derive, summarize

    rng = np.random.default_rng(batch)
    max_tokens = tokens_per_request(batch, context, engine.config.max_num_batched_tokens, steps)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, rng.integers(3, min(1000, engine.model_config.vocab_size), context).tolist(),
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()  # prefill everything first
    timeline = engine.timeline
    timeline.clear()
    timeline.enable()
    times, cached = [], []
    try:
        for _ in range(steps):
            running = engine.scheduler.running
            if len(running) != batch or not all(s.is_decoding for s in running):
                raise RuntimeError(f"expected {batch} decoding sequences, found {len(running)}")
            cached.append(sum(s.num_tokens for s in running))
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        timeline.wait_idle()
        summary = summarize(derive(list(timeline.records)))
    finally:
        timeline.disable()
        timeline.clear()
    for request_id in ids:  # the rest of their tokens are not needed
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    median = summary["median"]
    return {"median_step_s": float(np.median(times)), "mean_context": float(np.mean(cached)) / batch,
            "device_step_ms": _ms(median["device_step_s"]), "host_total_ms": _ms(median["host_total_s"]),
            "device_idle_ms": _ms(median["device_idle_s"]), "device_idle_frac": summary["device_idle_frac"],
            "h2d_bytes": median["h2d_bytes"], "timed_steps": summary["timed_steps"]}


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def engine_runs(modes: list[str], with_reference: bool) -> list[tuple[str, str]]:
    """(attention_impl, mode) of each engine, in the order they run: the kernel in every mode
    first, the reference last (the least needed when time runs out)."""
    return [("auto", mode) for mode in modes] + ([("reference", "sync")] if with_reference else [])


def held_weight_bytes(engine) -> int:
    """Bytes of the weights as the engine holds them (8-bit values and their scales when quantized)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(engine.runner.params))


def held_kv_bytes_per_token(engine) -> float:
    runner = engine.runner
    return runner.kv_cache.nbytes / (runner.num_pages * engine.config.page_size)


def run(workdir: Path, batch_sizes: list[int], context: int, copy_gbs: float, modes: list[str],
        with_reference: bool = True, on_row=lambda row: None, quantization: str | None = None,
        kv_cache_dtype: str = "auto") -> list[dict]:
    from orca_jax.worker.compile_guard import no_compiles
    from orca_jax.engine.engine import LLMEngine

    path = write_random_checkpoint(workdir / "llama-1b", LLAMA_3_2_1B, "bfloat16")
    budget = max(512, max(batch_sizes))
    longest = context + max(tokens_per_request(b, context, budget, 32) for b in batch_sizes) + 16
    pages_per_seq = -(-longest // 16)
    rows = []
    for impl, mode in engine_runs(modes, with_reference):
        engine = LLMEngine(model=str(path), dtype="bfloat16", attention_impl=impl, max_num_seqs=max(batch_sizes),
                           max_num_batched_tokens=budget, max_model_len=pages_per_seq * 16,
                           page_size=16, num_pages=max(batch_sizes) * pages_per_seq + 1,
                           async_scheduling=mode == "async", quantization=quantization,
                           kv_cache_dtype=kv_cache_dtype)
        weights, kv_per_token = held_weight_bytes(engine), held_kv_bytes_per_token(engine)
        with no_compiles(f"decode steps ({impl}, {mode})"):
            for batch in batch_sizes:
                timed = time_decode_steps(engine, batch, context)
                step_s = timed.pop("median_step_s")
                mean_context = timed.pop("mean_context")
                moved = weights + batch * mean_context * kv_per_token
                roofline_tps = batch / (moved / (copy_gbs * 1e9))
                row = {"attention_impl": engine.attention_impl, "mode": mode, "batch": batch,
                       "quantization": engine.model_config.quantization, "kv_dtype": engine.runner.kv_dtype.name,
                       "weight_bytes": weights, "kv_bytes_per_token": kv_per_token,
                       "prompt_tokens": context, "mean_context_tokens": mean_context, "median_step_ms": step_s * 1e3,
                       "tokens_per_s": batch / step_s, "roofline_tokens_per_s": roofline_tps,
                       "share_of_roofline": batch / step_s / roofline_tps, **timed}
                rows.append(row)
                on_row(row)
                print(json.dumps(row), flush=True)
        del engine
        gc.collect()  # free this engine's KV cache before the next one allocates its own
    return rows


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in ("sync", "async") for m in modes):
        raise argparse.ArgumentTypeError(f"modes are sync and/or async, comma-separated; got {text!r}")
    return modes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=nonempty_sizes, default=(64, 256))
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--modes", type=_modes, default=["sync", "async"], help="sync and/or async (default both)")
    parser.add_argument("--no-reference", action="store_true", help="skip the attention reference engine")
    parser.add_argument("--quantization", default=None, choices=("int8", "fp8"), help="8-bit weights")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (bfloat16 here), int8, fp8_e4m3")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    require_gpu()
    command = shlex.join(["python", "benchmarks/step_bench.py", *(sys.argv[1:] if argv is None else argv)])
    out = ReportFile(args.json, {**record_header("step_bench", command), "device": jax.devices()[0].device_kind,
              "model": "Llama-3.2-1B shapes, random bfloat16 weights", "modes": args.modes,
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "weight_bytes": weight_bytes(LLAMA_3_2_1B), "copy_gbs": copy_bandwidth_gbs(),
              "switch_interval_s": SWITCH_INTERVAL_S, "rows": []})
    report = out.record

    def write(row=None):
        if row is not None:
            report["rows"].append(row)
        out.save()

    write()
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run(Path(tmp), list(args.batch_sizes), args.context, report["copy_gbs"],
                args.modes, with_reference=not args.no_reference, on_row=write, quantization=args.quantization,
                kv_cache_dtype=args.kv_cache_dtype)
    finally:
        sys.setswitchinterval(previous)
    for row in report["rows"]:
        idle = "-" if row["device_idle_frac"] is None else f"{row['device_idle_frac']:.1%}"
        print(f"{row['attention_impl']:>10} {row['mode']:>5} {row['quantization'] or 'bf16'}/{row['kv_dtype']} "
              f"batch {row['batch']:>4}: {row['tokens_per_s']:9.0f} tok/s, "
              f"{row['median_step_ms']:.2f} ms/step, {row['share_of_roofline']:.0%} of roofline "
              f"({row['roofline_tokens_per_s']:.0f} tok/s), device idle {idle}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
