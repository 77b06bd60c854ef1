"""Offline throughput: orca_jax against transformers' static batching and continuous batching.

One workload drawn from Orca's length distributions (input U[32, 512], output U[1, 128], EOS
ignored; `--scale` shortens both for CPU runs), random prompt token ids from a seeded numpy RNG,
run in one process by every system on the same weights:

* orca_jax       `LLM(...).generate(token id lists, [SamplingParams(max_tokens=o, ignore_eos=True,
                 temperature=0)])`: iteration-level scheduling, selective batching, paged cache.
* hf_static      `model.generate` on batches of `max_num_seqs` requests in arrival order, left
                 padded, each batch run to its longest output. Only each request's own tokens are
                 useful; the padding and the extra decode steps are counted as wasted.
* hf_continuous  transformers' continuous batching manager (`init_continuous_batching`), each
                 request added with its own `max_new_tokens` and EOS disabled.

Model construction and warm-up are outside the timed part and reported on their own. The CPU
roofline comes from a measured float32 matmul rate and the FLOPs of this workload's useful
tokens; see `workload_flops`.

    python benchmarks/throughput.py                       # the default model, 48 requests, scale 0.5
    python benchmarks/throughput.py --num-requests 6 --scale 0.1 --json /tmp/tp.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# Orca's trace (OSDI 2022, section 6): input length U[32, 512], output length U[1, 128].
ORCA_INPUT_RANGE = (32, 512)
ORCA_OUTPUT_RANGE = (1, 128)
PEERS = ("static", "continuous")
SYSTEM_NAMES = {"orca": "orca_jax", "static": "hf_static", "continuous": "hf_continuous"}

logger = logging.getLogger("benchmarks.throughput")


class BenchmarkError(RuntimeError):
    """Something in a system's run is not as asked (a request failed, a length is off, ...)."""


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="HF directory or .gguf file; default: the embedded SmolLM2-135M-Instruct GGUF")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--scale", type=float, default=0.5,
                   help="multiply both length ranges (0.5: input U[16, 256], output U[1, 64]); 1.0 is Orca's trace")
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="orca_jax max_num_seqs; also the static batch size and the continuous peer's requests per batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="orca_jax token budget per step; also the continuous peer's max_batch_tokens")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="orca_jax dtype (the transformers peers always run float32)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="orca_jax max_model_len (default: the engine's own, which also sizes the KV cache)")
    p.add_argument("--page-size", type=int, default=16, help="KV page size in tokens, orca_jax and continuous peer")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated transformers peers to run, from {','.join(PEERS)}")
    p.add_argument("--skip-peers", action="store_true", help="run orca_jax only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1,
                   help="torch.set_num_threads for the transformers peers (default: os.cpu_count())")
    p.add_argument("--matmul-size", type=int, default=2048, help="square matmul size for the roofline rate")
    p.add_argument("--matmul-repeats", type=int, default=5)
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write every number here as JSON")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = [str(Path(__file__)), *argv]  # for the record: the command that produced the numbers
    peers = [] if args.skip_peers else [s.strip() for s in args.peers.split(",") if s.strip()]
    unknown = [s for s in peers if s not in PEERS]
    if unknown:
        parser.error(f"unknown peer(s) {unknown}; choose from {list(PEERS)}")
    args.peer_list = peers
    for name in ("num_requests", "torch_threads", "max_num_seqs", "max_num_batched_tokens", "matmul_size", "matmul_repeats", "page_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.scale <= 0:
        parser.error("--scale must be > 0")
    return args


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]  # token ids, arrival order
    output_lens: list[int]
    input_range: tuple[int, int]
    output_range: tuple[int, int]

    @property
    def input_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def useful_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def useful_processed_tokens(self) -> int:
        return sum(self.input_lens) + self.useful_output_tokens


def scaled_range(bounds: tuple[int, int], scale: float) -> tuple[int, int]:
    lo, hi = (max(1, round(b * scale)) for b in bounds)
    return lo, max(lo, hi)


def make_workload(num_requests: int, scale: float, vocab_size: int, seed: int,
                  exclude_ids: list[int] | tuple[int, ...] = ()) -> Workload:
    """Lengths from Orca's uniform distributions (scaled), prompt ids uniform over the vocabulary
    minus `exclude_ids` (special tokens), all from one seeded numpy RNG."""
    rng = np.random.default_rng(seed)
    in_range, out_range = scaled_range(ORCA_INPUT_RANGE, scale), scaled_range(ORCA_OUTPUT_RANGE, scale)
    input_lens = rng.integers(in_range[0], in_range[1] + 1, size=num_requests)
    output_lens = rng.integers(out_range[0], out_range[1] + 1, size=num_requests)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(exclude_ids), dtype=np.int64))
    prompts = [rng.choice(allowed, size=int(n)).tolist() for n in input_lens]
    return Workload(prompts, [int(o) for o in output_lens], in_range, out_range)


# ---------------------------------------------------------------------------------------------
# Roofline
# ---------------------------------------------------------------------------------------------
def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (and compile, for jax)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_matmul_rate(size: int = 2048, repeats: int = 5, extra_jax_dtypes: tuple[str, ...] = ()) -> dict[str, Any]:
    """FLOP/s of a square matmul with jax.numpy, numpy and torch (median of `repeats`). The
    roofline uses the fastest float32 rate (and any extra jax dtype asked for)."""
    import jax
    import jax.numpy as jnp

    flops = 2.0 * size**3
    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((size, size), dtype=np.float32)
    b_np = rng.standard_normal((size, size), dtype=np.float32)
    rates: dict[str, float] = {}

    matmul = jax.jit(jnp.matmul)
    for dtype in ("float32", *extra_jax_dtypes):
        a, b = jnp.asarray(a_np, dtype), jnp.asarray(b_np, dtype)
        rates[f"jax_{dtype}"] = flops / _median_seconds(lambda: matmul(a, b).block_until_ready(), repeats)
    rates["numpy_float32"] = flops / _median_seconds(lambda: a_np @ b_np, repeats)
    try:
        import torch
    except ImportError:
        pass
    else:
        a_t, b_t = torch.from_numpy(a_np), torch.from_numpy(b_np)
        with torch.inference_mode():
            rates["torch_float32"] = flops / _median_seconds(lambda: a_t @ b_t, repeats)
    best = max(rates, key=rates.get)
    return {"size": size, "repeats": repeats, "flop_per_s": rates, "best": best, "roofline_flop_per_s": rates[best]}


def count_params(params) -> dict[str, int]:
    """Parameter counts from the orca_jax parameter tree: all, the matmul weights (layer kernels,
    and the LM head, which is the embedding when tied), and the norms/biases."""
    import jax

    tree = params["params"]
    layer_kernels = sum(
        int(np.prod(leaf.shape))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree["layers"])[0]
        if getattr(path[-1], "key", None) == "kernel"
    )
    total = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))
    embed = int(np.prod(tree["embed"].shape))
    lm_head = int(np.prod(tree["lm_head"].shape)) if "lm_head" in tree else embed
    return {"total": total, "embedding": embed, "layer_matmul": layer_kernels, "lm_head": lm_head,
            "matmul_without_embedding_lookup": layer_kernels + lm_head}


def workload_flops(workload: Workload, model_config, params: dict[str, int]) -> dict[str, float]:
    """FLOPs of the useful work, each request's prompt + output tokens processed once:

    * linear layers: 2 * layer matmul params per processed token;
    * LM head: 2 * vocab * hidden per output token (logits are needed only there);
    * attention scores and values: 4 * num_heads * head_dim per (query, key) pair, causal, so a
      token at position t (1-based) reads t keys.

    Norms, RoPE, activations and sampling are not counted (a few percent at most)."""
    c = model_config
    processed = workload.useful_processed_tokens
    pairs = sum(n * (n + 1) // 2 for n in (i + o for i, o in zip(workload.input_lens, workload.output_lens)))
    linear = 2.0 * params["layer_matmul"] * processed
    head = 2.0 * params["lm_head"] * workload.useful_output_tokens
    attention = 4.0 * c.num_layers * c.num_heads * c.head_dim * pairs
    return {"linear": linear, "lm_head": head, "attention": attention, "total": linear + head + attention}


def roofline(workload: Workload, flops: dict[str, float], rate: float, param_counts: dict[str, int]) -> dict[str, float]:
    ideal_s = flops["total"] / rate
    return {
        "flop_per_s": rate,
        # The brief's simple form: every processed token costs 2 * (params without the embedding lookup).
        "simple_processed_tokens_per_s": rate / (2.0 * param_counts["matmul_without_embedding_lookup"]),
        "simple_useful_output_tokens_per_s": rate / (2.0 * param_counts["matmul_without_embedding_lookup"])
        * workload.useful_output_tokens / workload.useful_processed_tokens,
        "ideal_seconds": ideal_s,
        "useful_output_tokens_per_s": workload.useful_output_tokens / ideal_s,
        "processed_tokens_per_s": workload.useful_processed_tokens / ideal_s,
    }


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    """Peak resident set of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# ---------------------------------------------------------------------------------------------
# Systems
# ---------------------------------------------------------------------------------------------
def _result(name: str, workload: Workload, wall_s: float, processed: int, wasted: int, **extra) -> dict[str, Any]:
    useful = workload.useful_output_tokens
    return {
        "system": name,
        "requests": len(workload.prompts),
        "useful_output_tokens": useful,
        "processed_tokens": processed,  # prompt + output tokens the model ran, padding included
        "wasted_tokens": wasted,  # of which padding / tokens past a request's own length
        "wall_s": wall_s,
        "useful_output_tokens_per_s": useful / wall_s,
        **extra,
    }


def start_orca(args) -> dict[str, Any]:
    """Build the engine (weights load + XLA warm-up over every token bucket). Returns the LLM and
    what it costs, so that the timed run excludes it."""
    from orca_jax import LLM

    engine_args = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       dtype=args.dtype, page_size=args.page_size)
    if args.max_model_len is not None:
        engine_args["max_model_len"] = args.max_model_len
    rss_before = current_rss_bytes()  # interpreter + jax/transformers imports, nothing loaded yet
    start = time.perf_counter()
    llm = LLM(model=args.model, **engine_args)
    startup_s = time.perf_counter() - start
    return {"llm": llm, "engine_args": engine_args, "startup_s": startup_s, "rss_before_engine_bytes": rss_before}


def run_orca(llm, workload: Workload) -> dict[str, Any]:
    from orca_jax import SamplingParams
    from orca_jax.compile_guard import compile_count
    from orca_jax.kv_cache import kv_bytes_per_page

    engine = llm.engine
    # Untimed warm-up through the whole host path (scheduler, batch building, detokenizer).
    start = time.perf_counter()
    llm.generate([workload.prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0), use_tqdm=False)
    warmup_generate_s = time.perf_counter() - start

    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0) for o in workload.output_lens]
    compiles, steps = compile_count(), engine.num_steps
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    compiles, steps = compile_count() - compiles, engine.num_steps - steps

    for i, (out, want) in enumerate(zip(outputs, workload.output_lens)):
        if out.error is not None:
            raise BenchmarkError(f"orca_jax request {i} failed: {out.error}")
        if len(out.token_ids) != want or out.finish_reason != "length":
            raise BenchmarkError(
                f"orca_jax request {i} produced {len(out.token_ids)} tokens ({out.finish_reason!r}), expected {want}"
            )
    if engine.num_free_pages != engine.allocator.num_usable:
        raise BenchmarkError(f"orca_jax left {engine.allocator.num_used} KV pages in use after the run")

    import jax

    weight_bytes = sum(int(leaf.nbytes) for leaf in jax.tree.leaves(engine.runner.params))
    kv_bytes = engine.runner.num_pages * kv_bytes_per_page(engine.model_config, engine.config.page_size, engine.runner.kv_dtype)
    if compiles:
        logger.warning("orca_jax compiled %d XLA program(s) during the timed run", compiles)
    return _result(
        SYSTEM_NAMES["orca"], workload, wall_s, workload.useful_processed_tokens, 0,
        warmup_generate_s=warmup_generate_s, engine_steps=steps, xla_compiles_during_run=compiles,
        weight_bytes=weight_bytes, kv_cache_bytes=kv_bytes, num_kv_pages=engine.runner.num_pages,
        page_size=engine.config.page_size, max_model_len=engine.config.max_model_len,
        token_buckets=list(engine.config.token_buckets), dtype=engine.config.dtype,
        attention_impl=engine.attention_impl,
    )


def hf_load_kwargs(model: str | None) -> tuple[str, dict[str, Any]]:
    """The `from_pretrained` arguments that load the same weights orca_jax loads."""
    from orca_jax.models.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return str(path), {"gguf_file": ggufs[0].name}
    return str(path), {}


def load_hf_model(model: str | None):
    import torch
    from transformers import AutoModelForCausalLM

    directory, kwargs = hf_load_kwargs(model)
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()
    load_s = time.perf_counter() - start
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    return hf, load_s, weight_bytes


def _greedy_no_eos_config(hf, **overrides):
    """Greedy decoding that never stops at EOS. The model's own generation config is replaced,
    since `generate` fills unset fields (eos_token_id among them) from it."""
    from transformers import GenerationConfig

    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    hf.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=pad,
                                            bos_token_id=hf.config.bos_token_id)
    return GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=pad, **overrides), pad


def _static_generate(hf, prompts: list[list[int]], max_new: int, gen_config, pad: int):
    import copy

    import torch

    gen_config = copy.deepcopy(gen_config)
    gen_config.max_new_tokens, gen_config.min_new_tokens = max_new, None

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
    if tuple(out.shape) != (len(prompts), width + max_new):
        raise BenchmarkError(
            f"hf_static: generate returned shape {tuple(out.shape)}, expected {(len(prompts), width + max_new)} "
            "(did it stop early?)"
        )
    return width


def run_hf_static(hf, workload: Workload, batch_size: int) -> dict[str, Any]:
    """Static batching: batches of `batch_size` in arrival order, left padded, each run until its
    longest request is done."""
    gen_config, pad = _greedy_no_eos_config(hf)
    start = time.perf_counter()
    _static_generate(hf, [workload.prompts[0][:8]] * 2, 2, gen_config, pad)
    warmup_s = time.perf_counter() - start

    processed = 0
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first:first + batch_size]
        max_new = max(workload.output_lens[first:first + batch_size])
        width = _static_generate(hf, prompts, max_new, gen_config, pad)
        processed += len(prompts) * (width + max_new)
    wall_s = time.perf_counter() - start
    wasted = processed - workload.useful_processed_tokens
    return _result(SYSTEM_NAMES["static"], workload, wall_s, processed, wasted,
                   warmup_generate_s=warmup_s, batch_size=batch_size,
                   num_batches=-(-len(workload.prompts) // batch_size))


def _collect_cb(manager, request_ids: list[str]) -> dict[str, Any]:
    pending, results = set(request_ids), {}
    while pending:
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                error = manager.background_thread_status.fatal_error
                raise BenchmarkError(f"hf_continuous: the generation thread stopped with requests pending ({error!r})")
            continue
        if result.is_finished() and result.request_id in pending:
            pending.discard(result.request_id)
            results[result.request_id] = result
    return results


def run_hf_continuous(hf, workload: Workload, args) -> dict[str, Any]:
    """transformers continuous batching (`init_continuous_batching` -> ContinuousBatchingManager),
    every request added with its own `max_new_tokens` and `eos_token_id=-1` (no EOS)."""
    import torch
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen_config, _ = _greedy_no_eos_config(hf, max_new_tokens=max(workload.output_lens))
    gen_config.eos_token_id = -1  # the manager's own spelling of "no EOS" (None makes it warn, then use -1)
    longest = max(i + o for i, o in zip(workload.input_lens, workload.output_lens))
    pages_per_seq = -(-longest // args.page_size)
    cb_config = ContinuousBatchingConfig(
        page_size=args.page_size,
        # Room for max_num_seqs requests at the workload's longest length, so it never evicts.
        num_blocks=args.max_num_seqs * pages_per_seq,
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
        allow_block_sharing=False,  # no prefix caching: orca_jax has none
        use_cuda_graph=False,
        use_async_batching=False,
        seed=args.seed,
    )
    hints = WorkloadHints(max_prompt_length=max(workload.input_lens), max_generated_length=max(workload.output_lens),
                          num_requests=len(workload.prompts))
    start = time.perf_counter()
    manager = hf.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config,
                                          workload_hints=hints)
    try:
        manager.warmup()
        with torch.inference_mode():  # the loop thread inherits the caller's inference mode
            manager.start()
        warm_id = manager.add_request(workload.prompts[0][:8], request_id="warmup", max_new_tokens=2, eos_token_id=-1)
        if warm_id is None:
            raise BenchmarkError("hf_continuous: the manager refused the warm-up request")
        warm = _collect_cb(manager, [warm_id])[warm_id]
        if warm.error is not None:
            raise BenchmarkError(f"hf_continuous: the warm-up request failed: {warm.error}")
        warmup_s = time.perf_counter() - start

        start = time.perf_counter()
        ids = []
        for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
            request_id = manager.add_request(prompt, request_id=f"req-{i}", max_new_tokens=out_len, eos_token_id=-1)
            if request_id is None:
                raise BenchmarkError(f"hf_continuous: the manager refused request {i}")
            ids.append(request_id)
        results = _collect_cb(manager, ids)
        wall_s = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()

    resolved = manager.continuous_batching_config
    for i, (request_id, want) in enumerate(zip(ids, workload.output_lens)):
        r = results[request_id]
        if r.error is not None:
            raise BenchmarkError(f"hf_continuous request {i} failed: {r.error}")
        if len(r.generated_tokens) != want:
            raise BenchmarkError(f"hf_continuous request {i} produced {len(r.generated_tokens)} tokens, expected {want}")
    return _result(
        SYSTEM_NAMES["continuous"], workload, wall_s, workload.useful_processed_tokens, 0,
        warmup_generate_s=warmup_s, api="PreTrainedModel.init_continuous_batching + ContinuousBatchingManager.add_request",
        per_request_max_new_tokens=True,
        attn_implementation=hf.config._attn_implementation,
        cb_config={k: getattr(resolved, k) for k in ("page_size", "num_blocks", "max_batch_tokens",
                                                     "max_requests_per_batch", "allow_block_sharing", "scheduler_type")},
    )


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    import jax

    info: dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(), "python_executable": sys.executable,
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__, "jax_backend": jax.default_backend(), "jax_devices": [str(d) for d in jax.devices()],
        "numpy": np.__version__,
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
        info["load_average"] = list(os.getloadavg())
    except (OSError, StopIteration, ValueError):
        pass
    for name in ("torch", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


def add_ratios(systems: list[dict[str, Any]], roof: dict[str, float]) -> None:
    peers = {s["system"]: s["useful_output_tokens_per_s"] for s in systems if s["system"] != SYSTEM_NAMES["orca"]}
    for s in systems:
        s["ratio_vs"] = {peer: s["useful_output_tokens_per_s"] / tps for peer, tps in peers.items()}
        s["roofline_share"] = s["useful_output_tokens_per_s"] / roof["useful_output_tokens_per_s"]


def format_table(result: dict[str, Any]) -> str:
    systems = result["systems"]
    peers = [s["system"] for s in systems if s["system"] != SYSTEM_NAMES["orca"]]
    header = ["system", "requests", "useful out tok", "processed tok", "wasted tok", "wall s", "useful out tok/s",
              *[f"x {p}" for p in peers], "% roofline"]
    rows = [header]
    for s in systems:
        rows.append([
            s["system"], str(s["requests"]), str(s["useful_output_tokens"]), str(s["processed_tokens"]),
            str(s["wasted_tokens"]), f"{s['wall_s']:.2f}", f"{s['useful_output_tokens_per_s']:.1f}",
            *[f"{s['ratio_vs'][p]:.2f}" for p in peers], f"{100 * s['roofline_share']:.1f}",
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.3f} GiB"


def format_report(result: dict[str, Any]) -> str:
    w, roof, mem, mm = result["workload"], result["roofline"], result["memory"], result["matmul"]
    orca = result["systems"][0]
    lines = [
        f"model: {result['model']}",
        f"workload: {w['num_requests']} requests, input U{list(w['input_range'])} (mean {w['mean_input_len']:.1f}), "
        f"output U{list(w['output_range'])} (mean {w['mean_output_len']:.1f}), EOS ignored, greedy, seed {result['args']['seed']}",
        (f"torch threads: torch.set_num_threads({result['torch_num_threads']}) "
         f"(os.cpu_count() = {result['machine']['cpu_count']}); " if result["torch_num_threads"] else "")
        + f"orca_jax dtype {orca['dtype']}, transformers peers float32",
        "",
        format_table(result),
        "",
        f"startup (outside the timed runs): orca_jax engine build (load + XLA warm-up of buckets {orca['token_buckets']}) "
        f"{result['startup']['orca_engine_s']:.1f} s, first generate {orca['warmup_generate_s']:.2f} s"
        + "".join(f"; {s['system']} warm-up {s['warmup_generate_s']:.2f} s" for s in result["systems"][1:])
        + (f"; transformers load {result['startup']['hf_load_s']:.1f} s" if "hf_load_s" in result["startup"] else ""),
        f"orca_jax: {orca['engine_steps']} engine steps, {orca['xla_compiles_during_run']} XLA compiles during the timed run",
        f"roofline: matmul {mm['size']}x{mm['size']} "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in mm["flop_per_s"].items())
        + f" GFLOP/s (using {mm['best']}); workload {result['flops']['total'] / 1e9:.1f} GFLOP "
        f"(linear {result['flops']['linear'] / 1e9:.1f}, LM head {result['flops']['lm_head'] / 1e9:.1f}, "
        f"attention {result['flops']['attention'] / 1e9:.1f}) -> ideal {roof['ideal_seconds']:.2f} s, "
        f"{roof['useful_output_tokens_per_s']:.1f} useful output tok/s "
        f"(simple rate / (2 * {result['params']['matmul_without_embedding_lookup'] / 1e6:.1f}M params): "
        f"{roof['simple_processed_tokens_per_s']:.1f} processed = "
        f"{roof['simple_useful_output_tokens_per_s']:.1f} useful output tok/s)",
        f"memory: orca_jax weights {_gib(mem['orca_weight_bytes'])} + KV cache {_gib(mem['orca_kv_cache_bytes'])} "
        f"({orca['num_kv_pages']} pages x {orca['page_size']} tokens, max_model_len {orca['max_model_len']}); "
        f"peak RSS after orca_jax {_gib(mem['peak_rss_after_orca_bytes'])} "
        f"(beyond weights + cache: {_gib(mem['peak_rss_after_orca_minus_weights_and_cache_bytes'])}), "
        f"RSS before the engine (imports only) {_gib(mem['rss_before_orca_engine_bytes'])}, after its run "
        f"{_gib(mem['rss_after_orca_bytes'])}; process peak {_gib(mem['peak_rss_bytes'])}",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------
def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run every system on one workload and return all numbers (the JSON document)."""
    started = datetime.datetime.now(datetime.timezone.utc)
    torch_threads = None
    if args.peer_list:
        import torch

        torch.set_num_threads(args.torch_threads)
        torch_threads = torch.get_num_threads()

    # orca_jax first, so the peak RSS read after it is its own.
    orca_start = start_orca(args)
    llm = orca_start["llm"]
    tokenizer = llm.get_tokenizer()
    model_config = llm.engine.model_config
    workload = make_workload(args.num_requests, args.scale, model_config.vocab_size, args.seed,
                             exclude_ids=tuple(getattr(tokenizer, "all_special_ids", ()) or ()))
    param_counts = count_params(llm.engine.runner.params)
    orca = run_orca(llm, workload)
    memory = {
        "orca_weight_bytes": orca["weight_bytes"],
        "orca_kv_cache_bytes": orca["kv_cache_bytes"],
        "rss_before_orca_engine_bytes": orca_start["rss_before_engine_bytes"],
        "peak_rss_after_orca_bytes": peak_rss_bytes(),
        "rss_after_orca_bytes": current_rss_bytes(),
    }
    memory["peak_rss_after_orca_minus_weights_and_cache_bytes"] = (
        memory["peak_rss_after_orca_bytes"] - orca["weight_bytes"] - orca["kv_cache_bytes"]
    )
    model_source = llm.engine.config.model
    startup = {"orca_engine_s": orca_start["startup_s"]}
    del llm, orca_start
    gc.collect()

    systems = [orca]
    if args.peer_list:
        hf, hf_load_s, hf_weight_bytes = load_hf_model(args.model)
        startup["hf_load_s"] = hf_load_s
        memory["hf_weight_bytes"] = hf_weight_bytes
        if "static" in args.peer_list:
            systems.append(run_hf_static(hf, workload, args.max_num_seqs))
        if "continuous" in args.peer_list:
            systems.append(run_hf_continuous(hf, workload, args))
        del hf
        gc.collect()
    memory["peak_rss_bytes"] = peak_rss_bytes()

    matmul = measure_matmul_rate(args.matmul_size, args.matmul_repeats,
                                 extra_jax_dtypes=("bfloat16",) if args.dtype == "bfloat16" else ())
    flops = workload_flops(workload, model_config, param_counts)
    roof = roofline(workload, flops, matmul["roofline_flop_per_s"], param_counts)
    add_ratios(systems, roof)
    return {
        "benchmark": "throughput",
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join(["python", *args.argv]),
        "args": {k: v for k, v in vars(args).items() if k not in ("argv",)},
        "model": model_source or _default_model_name(),
        "machine": machine_info(),
        "torch_num_threads": torch_threads,
        "workload": {
            "num_requests": len(workload.prompts), "input_range": list(workload.input_range),
            "output_range": list(workload.output_range), "input_lens": workload.input_lens,
            "output_lens": workload.output_lens, "mean_input_len": float(np.mean(workload.input_lens)),
            "mean_output_len": float(np.mean(workload.output_lens)),
            "useful_output_tokens": workload.useful_output_tokens,
            "useful_processed_tokens": workload.useful_processed_tokens,
        },
        "model_config": dataclasses.asdict(model_config),
        "params": param_counts,
        "matmul": matmul,
        "flops": flops,
        "roofline": roof,
        "memory": memory,
        "startup": startup,
        "systems": systems,
    }


def _default_model_name() -> str:
    from orca_jax.models.loader import default_model_path

    return str(default_model_path())


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    # transformers' GGUF conversion bar (plain tqdm) would bury the table; tqdm reads this at import.
    os.environ.setdefault("TQDM_DISABLE", "1")
    if args.peer_list:
        print(f"transformers peers: torch.set_num_threads({args.torch_threads}) (os.cpu_count() = {os.cpu_count()})",
              flush=True)
    try:
        result = run_benchmark(args)
    except Exception as exc:  # one clear line, then the traceback; never a partial table
        print(f"throughput benchmark FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise
    print(format_report(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
