"""`orca-jax bench quant`: quantized weights and KV cache against float32 and bfloat16, side by
side in one process, and the idle memory of `orca-jax serve` with them.

Configurations (engines built alike but for these settings; `--configs` picks among them):

  float32        the CPU default (dtype "auto" resolves to float32 on CPU; KV float32)
  bfloat16       dtype bfloat16; the KV cache as "auto" makes it on CPU (float32), which is what
                 `LLM(dtype="bfloat16")` runs there
  bf16+kv_bf16   bfloat16 weights and a bfloat16 KV cache: the reference of the memory ratios.
                 Memory only: XLA:CPU has no bfloat16 gather, so a bfloat16 cache is slow there
                 (kernels/ragged_paged_attention_cpu.py); it is built, its memory read, one short
                 batch-1 decode timed (`probe_tokens`, reported apart), and it is shut down before
                 the timed rounds
  int8           W8A16 int8 weights, one scale per output channel (`quantization="int8"`)
  gguf           the GGUF file's own Q8_0/Q4 blocks kept as int8 with scales (`quantization=
                 "gguf"`; skipped, and said so, when the model is not a GGUF file)
  kv_int8        float32 weights, 8-bit KV cache with a bfloat16 scale per token and head
  int8+kv_int8   both
  kv_fp8         (not by default) float32 weights, float8_e4m3 KV cache

Every engine gets the same explicit KV byte budget (`kv_cache_memory_bytes`), max_num_seqs,
token budget, page size and max_model_len (large enough that the budget, not the page tables,
bounds the pool), prefix caching off (a repeat must not find the previous one's prompts).

Per configuration:
  1. weight bytes: the nbytes of every leaf of `engine.runner.params` (values, scales, offsets,
     norms), and the ratio to bfloat16's;
  2. KV bytes per token (`kv_bytes_per_page / page_size`, which counts an 8-bit row's scale
     bytes; checked against the allocated cache's nbytes) and the pool that the byte budget buys,
     `runner.num_pages * page_size` tokens (page 0, the padding sink, included), ratio to bfloat16;
  3. decode tokens/s at batch 1 and batch 16: that many requests of `prompt_len`-token prompts
     (windows of a public-domain English passage, so greedy text is meaningful), `decode_tokens`
     tokens each, greedy, EOS ignored, all at once; timed from the step that gives the last of
     them its first token to the step that finishes them (prefill and compilation excluded: the
     engine compiled every bucket when it was built and a warm-up ran first); tokens made in
     that span over its length. `rounds` rounds, the configurations by turns, the order flipped
     every round; medians, and "x float32" = median over rounds of the ratio to float32's run in
     the same round;
  4. offline throughput on Orca's trace (bench/trace.py: random prompt ids, Orca's input and
     output lengths at `offline_scale`, all requests at t=0, EOS ignored, greedy) through
     bench/offline.py's own orca_jax run: useful output tokens / wall seconds;
  5. greedy agreement with float32: of the largest batch's requests, how many have the same
     first `agreement_tokens` token ids as float32's (same prompts, same batch, same round), and
     the mean length of the common prefix.

Then the idle resident memory of `orca-jax serve` (a child process per configuration, default
engine settings but for the flags of `serve_configs`): started with `--port 0`, ready when
`/health` answers 200, then after `settle_s` VmRSS (and the peak, VmHWM) from /proc/PID/status,
then SIGTERM. `serve_only` (`--serve-only`) measures only that, the servers one after another
unless `serve_parallel`: no engine is built in the bench's own process.

Targets (the issue's): int8 weight bytes <= 0.55x bfloat16's; an int8 KV pool >= 1.9x the tokens
of bfloat16's for the same bytes; on CPU, int8 weights at least as fast as float32 at batch 1.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from orca_jax.bench import environment
from orca_jax.bench.driver import BenchmarkError, check_pages_returned

TARGET_WEIGHT_RATIO = 0.55  # int8 weight bytes over bfloat16's, at most
TARGET_KV_TOKENS_RATIO = 1.9  # int8 KV pool tokens over bfloat16's for the same bytes, at least
TARGET_INT8_SPEED_RATIO = 1.0  # int8 weights' decode tok/s over float32's at batch 1, at least

# label -> engine settings that differ between the configurations
CONFIGS: dict[str, dict[str, Any]] = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "bf16+kv_bf16": dict(dtype="bfloat16", kv_cache_dtype="bfloat16"),
    "int8": dict(dtype="float32", quantization="int8"),
    "gguf": dict(dtype="float32", quantization="gguf"),
    "kv_int8": dict(dtype="float32", kv_cache_dtype="int8"),
    "int8+kv_int8": dict(dtype="float32", quantization="int8", kv_cache_dtype="int8"),
    "kv_fp8": dict(dtype="float32", kv_cache_dtype="fp8_e4m3"),
}
DEFAULT_CONFIGS = ("float32", "bfloat16", "bf16+kv_bf16", "int8", "gguf", "kv_int8", "int8+kv_int8")
BASELINE = "float32"  # speed and agreement ratios
MEMORY_BASELINE = "bf16+kv_bf16"  # weight and KV ratios
MEMORY_ONLY = ("bf16+kv_bf16",)  # not in the timed rounds (see above)

# `orca-jax serve` flags per idle-memory configuration (the engine's defaults otherwise).
# "int8+kv_int8@float32_pages": the same number of KV pages (tokens) as float32's server
# gets from its byte budget, so the cache's bytes shrink instead of its capacity growing.
SERVE_CONFIGS: dict[str, tuple[str, ...]] = {
    "float32": (),
    "int8": ("--quantization", "int8"),
    "int8+kv_int8": ("--quantization", "int8", "--kv-cache-dtype", "int8"),
    "int8+kv_int8@float32_pages": ("--quantization", "int8", "--kv-cache-dtype", "int8"),
    "kv_int8": ("--kv-cache-dtype", "int8"),
}
SAME_PAGES = "int8+kv_int8@float32_pages"
DEFAULT_SERVE_CONFIGS = ("float32", "int8", "int8+kv_int8")

@dataclasses.dataclass(frozen=True)
class QuantSettings:
    model: str | None = None
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    batch_sizes: tuple[int, ...] = (1, 16)
    prompt_len: int = 16
    decode_tokens: int = 64
    rounds: int = 3
    agreement_tokens: int = 32
    offline_requests: int = 32
    offline_scale: float = 0.25  # input U[8, 128], output U[1, 32]
    offline_rounds: int = 1
    max_num_batched_tokens: int = 256
    page_size: int = 16
    max_model_len: int = 2048  # page tables hold more than any pool here: the byte budget bounds the pool
    kv_cache_memory_bytes: int = 256 << 20
    probe_tokens: int = 4  # the memory-only configurations' one batch-1 decode
    seed: int = 0
    serve_configs: tuple[str, ...] = DEFAULT_SERVE_CONFIGS
    serve_args: tuple[str, ...] = ()  # more `orca-jax serve` flags for every server (the tests: small buckets)
    serve_parallel: bool = False  # start the servers at once (idle memory does not depend on it)
    serve_timeout_s: float = 900.0
    settle_s: float = 3.0  # idle seconds between /health answering and reading the memory
    serve_only: bool = False  # only the idle servers (run_serve_only), no engine in this process

    def __post_init__(self):
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown or not self.configs:
            raise ValueError(f"configs must be among {list(CONFIGS)}, got {list(self.configs)}")
        unknown = [c for c in self.serve_configs if c not in SERVE_CONFIGS]
        if unknown:
            raise ValueError(f"serve configs must be among {list(SERVE_CONFIGS)}, got {list(self.serve_configs)}")
        if SAME_PAGES in self.serve_configs and "float32" not in self.serve_configs:
            raise ValueError(f"{SAME_PAGES!r} takes its page count from the float32 server: add float32")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be positive, got {self.batch_sizes}")
        if self.decode_tokens < 2:
            raise ValueError(f"decode_tokens must be >= 2 (a decode span needs two tokens), got {self.decode_tokens}")
        if self.prompt_len + self.decode_tokens > self.max_model_len:
            raise ValueError(f"prompt_len + decode_tokens ({self.prompt_len + self.decode_tokens}) exceed "
                             f"max_model_len ({self.max_model_len})")
        if self.max_num_batched_tokens < max(self.batch_sizes):
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must hold a decode token of "
                             f"every sequence of the largest batch ({max(self.batch_sizes)})")
        if self.probe_tokens < 2:
            raise ValueError(f"probe_tokens must be >= 2, got {self.probe_tokens}")
        if min(self.rounds, self.offline_rounds, self.offline_requests, self.agreement_tokens, self.prompt_len) < 1:
            raise ValueError("rounds, offline_rounds, offline_requests, agreement_tokens and prompt_len must be >= 1")

    @classmethod
    def quick(cls, **overrides) -> QuantSettings:
        """Seconds on a tiny model (the tests): four engines (float32, the bfloat16 memory
        baseline, int8 weights with an int8 KV cache, GGUF blocks), batch 1 and 2, 8-token
        outputs, 2 rounds, one token bucket per engine, a few offline requests, two small
        servers started at once."""
        return cls(**{**dict(configs=("float32", "bf16+kv_bf16", "int8+kv_int8", "gguf"), batch_sizes=(1, 2),
                             prompt_len=4, decode_tokens=8, rounds=2, agreement_tokens=8,
                             offline_requests=4, offline_scale=0.02, max_num_batched_tokens=8, page_size=8,
                             max_model_len=256, kv_cache_memory_bytes=64 << 10,
                             serve_configs=("float32", "int8+kv_int8"),
                             serve_args=("--max-num-seqs", "2", "--max-num-batched-tokens", "8", "--page-size", "8",
                                         "--max-model-len", "256"),
                             serve_parallel=True, settle_s=0.5, serve_timeout_s=300.0), **overrides})

    def engine_args(self, label: str) -> dict[str, Any]:
        return dict(max_num_seqs=max(self.batch_sizes), max_num_batched_tokens=self.max_num_batched_tokens,
                    page_size=self.page_size, max_model_len=self.max_model_len,
                    kv_cache_memory_bytes=self.kv_cache_memory_bytes, enable_prefix_caching=False, seed=self.seed,
                    **CONFIGS[label])


# ---- the workload -------------------------------------------------------------------------------
def decode_prompts(tokenizer, num: int, prompt_len: int) -> list[list[int]]:
    """`num` windows of `prompt_len` tokens of the Gettysburg Address (bench/spec.py's passage),
    back to back, wrapping around: natural English, so greedy continuations can be compared."""
    from orca_jax.bench.spec import PASSAGE_SENTENCES

    ids = list(tokenizer.encode(" ".join(PASSAGE_SENTENCES), add_special_tokens=False))
    if not ids:
        raise BenchmarkError("the tokenizer made no tokens of the passage")
    ids = ids * (-(-num * prompt_len // len(ids)))
    return [ids[i * prompt_len:(i + 1) * prompt_len] for i in range(num)]


def offline_trace(engine, s: QuantSettings):
    from orca_jax.bench.trace import make_trace

    special = tuple(getattr(engine.tokenizer, "all_special_ids", ()) or ())
    return make_trace(s.offline_requests, s.offline_scale, s.seed, vocab_size=engine.model_config.vocab_size,
                      exclude_ids=special)


# ---- one engine -----------------------------------------------------------------------------------
def build(s: QuantSettings, label: str):
    """(LLM, seconds to build it): weights loaded, KV cache allocated, every bucket compiled."""
    from orca_jax.entrypoints.llm import LLM

    started = time.perf_counter()
    llm = LLM(model=s.model, **s.engine_args(label))
    return llm, time.perf_counter() - started


def memory_numbers(llm, s: QuantSettings) -> dict[str, Any]:
    import jax

    from orca_jax.core.kv_cache import kv_bytes_per_page

    engine, runner = llm.engine, llm.engine.runner
    page_size = engine.config.page_size
    weight_bytes = sum(int(leaf.nbytes) for leaf in jax.tree.leaves(runner.params))
    per_page = kv_bytes_per_page(engine.model_config, page_size, runner.kv_dtype)
    allocated = sum(int(leaf.nbytes) for leaf in jax.tree.leaves(runner.kv_cache))
    per_token_allocated = allocated / (runner.num_pages * page_size)
    if abs(per_token_allocated - per_page / page_size) > 1e-9:
        raise BenchmarkError(f"kv_bytes_per_page says {per_page / page_size} bytes per token, the allocated cache "
                             f"{per_token_allocated}")
    model = engine.model_config
    return {
        "weight_bytes": weight_bytes,
        "weight_dtypes": sorted({str(leaf.dtype) for leaf in jax.tree.leaves(runner.params)}),
        "quantization": model.quantization, "dtype": engine.config.dtype, "kv_dtype": str(runner.kv_dtype),
        "kv_bytes_per_token": per_page / page_size, "kv_bytes_per_token_allocated": per_token_allocated,
        "kv_cache_bytes": allocated, "kv_cache_memory_bytes": s.kv_cache_memory_bytes,
        "num_pages": runner.num_pages, "page_size": page_size, "pool_tokens": runner.num_pages * page_size,
        "sequence_tokens": (runner.num_pages - 1) * page_size,  # page 0 is the padding sink
        "max_model_len": engine.config.max_model_len, "token_buckets": list(engine.config.token_buckets),
        # The pool is also capped at every sequence at full length (+ the sink page): then the
        # byte budget did not decide it, and its ratios say nothing.
        "pool_capped_by_page_tables":
            runner.num_pages >= engine.config.max_num_seqs * engine.config.max_pages_per_seq + 1,
        "attention_impl": engine.attention_impl,
    }


def warm_up(engine, prompts: list[list[int]]) -> None:
    """The largest batch for a few tokens through the whole host path (prefill, decode,
    detokenizer); the engine compiled its step programs when it was built."""
    from orca_jax.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"warmup-{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    check_pages_returned(engine)


def decode_run(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    """All `prompts` at once, `max_tokens` greedy tokens each (EOS ignored). The decode span runs
    from the step that gives the last request its first token to the step that finishes the
    last one; tok/s = tokens made in that span / its length. Each request's token ids under
    "tokens" (popped by the caller)."""
    from orca_jax.core.sampling_params import SamplingParams
    from orca_jax.worker.compile_guard import compile_count

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    n = len(prompts)
    compiles, steps = compile_count(), engine.num_steps
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    counts, first, finish, tokens = {}, {}, {}, {}
    span_start = tokens_before_span = None
    now = started
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.error is not None:
                raise BenchmarkError(f"request {out.request_id} failed: {out.error}")
            i = int(out.request_id.rsplit("-", 1)[1])
            counts[i] = len(out.outputs[0].token_ids)
            if counts[i] and i not in first:
                first[i] = now
            if out.finished:
                finish[i], tokens[i] = now, list(out.outputs[0].token_ids)
        if span_start is None and len(first) == n:
            span_start, tokens_before_span = now, sum(counts.values())
    check_pages_returned(engine)
    for i in range(n):
        if len(tokens.get(i, ())) != max_tokens:
            raise BenchmarkError(f"request {tag}-{i} made {len(tokens.get(i, ()))} tokens, expected {max_tokens}")
    span_s = now - span_start
    span_tokens = n * max_tokens - tokens_before_span
    if span_tokens < 1 or span_s <= 0:
        raise BenchmarkError(f"{tag}: no decode span (every token came with the first ones)")
    return {
        "batch": n, "decode_tok_per_s": span_tokens / span_s, "decode_s": span_s, "decode_tokens": span_tokens,
        "ms_per_step": 1e3 * span_s * n / span_tokens,
        "tpot_ms": 1e3 * statistics.median((finish[i] - first[i]) / (max_tokens - 1) for i in range(n)),
        "ttft_s": max(first.values()) - started, "wall_s": now - started,
        "engine_steps": engine.num_steps - steps, "xla_compiles_during_run": compile_count() - compiles,
        "tokens": [tokens[i] for i in range(n)],
    }


def agreement(mine: list[list[int]], base: list[list[int]], length: int) -> dict[str, Any]:
    """Requests whose first `length` tokens equal the baseline's, and the mean common prefix."""
    prefixes = []
    for a, b in zip(mine, base):
        a, b = a[:length], b[:length]
        prefixes.append(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {"tokens": length, "requests": len(prefixes), "identical": sum(p == length for p in prefixes),
            "mean_common_prefix": statistics.mean(prefixes) if prefixes else None}


def turn_order(labels: list[str], round_: int) -> list[str]:
    return labels if round_ % 2 == 0 else labels[::-1]


# ---- the benchmark --------------------------------------------------------------------------------
def run_quant(s: QuantSettings, command: str = "", progress=print) -> dict[str, Any]:
    started, started_at = time.perf_counter(), environment.now_utc()
    load_start = environment.load_average()
    engines, results, skipped = {}, {}, {}
    try:
        for label in s.configs:
            try:
                llm, build_s = build(s, label)
            except Exception as exc:  # noqa: BLE001 - recorded (e.g. gguf on a model that is not a GGUF file)
                skipped[label] = f"{type(exc).__name__}: {exc}"
                progress(f"{label}: SKIPPED ({skipped[label]})")
                continue
            results[label] = {"engine_args": s.engine_args(label), "build_s": build_s,
                              "timed": label not in MEMORY_ONLY,
                              "warmup_cache_hits": llm.engine.startup_timings.get("warmup_cache_hits"),
                              "warmup_programs": llm.engine.startup_timings.get("warmup_programs"),
                              **memory_numbers(llm, s)}
            r = results[label]
            progress(f"{label}: built in {build_s:.1f} s; weights {r['weight_bytes'] / 2**20:.1f} MiB, KV "
                     f"{r['kv_bytes_per_token']:.0f} B/token ({r['kv_dtype']}), pool {r['pool_tokens']} tokens")
            if label in MEMORY_ONLY:
                try:
                    prompts = decode_prompts(llm.get_tokenizer(), 1, s.prompt_len)
                    warm_up(llm.engine, prompts)
                    probe = decode_run(llm.engine, prompts, s.probe_tokens, f"probe-{label}")
                    del probe["tokens"]
                    r["decode_probe"] = probe
                    progress(f"{label}: memory only; batch-1 probe {probe['ms_per_step']:.0f} ms/step "
                             f"({s.probe_tokens} tokens)")
                finally:
                    llm.engine.shutdown()
                    del llm
                    gc.collect()
                continue
            engines[label] = llm
        if BASELINE not in engines:
            raise BenchmarkError(f"the {BASELINE} engine is needed for the ratios: {skipped.get(BASELINE)}")
        setup_s = time.perf_counter() - started
        some = next(iter(engines.values())).engine
        prompts = decode_prompts(some.tokenizer, max(s.batch_sizes), s.prompt_len)
        for llm in engines.values():
            warm_up(llm.engine, prompts)
        runs = measure_decode(engines, prompts, s, progress)
        trace = offline_trace(some, s)
        offline = measure_offline(engines, trace, s, progress)
        load_after_engines = environment.load_average()
        model_source = some.config.model
        model_config = dataclasses.asdict(some.model_config)
    finally:
        for llm in engines.values():
            llm.engine.shutdown()
        engines.clear()
        gc.collect()
    summarize(results, runs, offline, s)
    serve = measure_serve(s, progress)
    record = {
        **environment.record_header("quant", command, started_at),
        "load_average": {"start": load_start, "after_in_process": load_after_engines, "end": environment.load_average()},
        "settings": dataclasses.asdict(s), "model": model_source or _default_model_name(),
        "model_config": {k: v for k, v in model_config.items() if k not in ("rope_freq_factors",)},
        "sampling": "greedy (temperature 0), EOS ignored",
        "configs": {label: CONFIGS[label] for label in s.configs}, "skipped": skipped,
        "results": results, "decode_runs": runs, "offline_runs": offline, "serve_idle": serve,
        "setup_s": setup_s, "wall_s": time.perf_counter() - started,
        "xla_compiles_during_runs": sum(r["xla_compiles_during_run"] for r in runs + offline),
    }
    record["targets"] = target_verdict(record)
    return record


def run_serve_only(s: QuantSettings, command: str = "", progress=print) -> dict[str, Any]:
    """The idle `orca-jax serve` part alone (`serve_only`): no engine is built here, so the
    servers' memory is read on a machine without the in-process engines' load."""
    if not s.serve_configs:
        raise ValueError("serve_only needs serve_configs")
    started, started_at = time.perf_counter(), environment.now_utc()
    load_start = environment.load_average()
    serve = measure_serve(s, progress)
    return {**environment.record_header("quant_serve", command, started_at),
            "load_average": {"start": load_start, "end": environment.load_average()},
            "settings": dataclasses.asdict(s), "model": s.model or _default_model_name(),
            "serve_idle": serve, "wall_s": time.perf_counter() - started}


def measure_decode(engines, prompts, s: QuantSettings, progress) -> list[dict[str, Any]]:
    labels = list(engines)
    runs = []
    for round_ in range(s.rounds):
        for batch in s.batch_sizes:
            group = {}
            for label in turn_order(labels, round_):
                run = decode_run(engines[label].engine, prompts[:batch], s.decode_tokens, f"r{round_}-b{batch}-{label}")
                run.update(round=round_, config=label)
                group[label] = run
                progress(f"round {round_ + 1} batch {batch} {label}: {run['decode_tok_per_s']:.1f} decode tok/s, "
                         f"{run['ms_per_step']:.0f} ms/step")
            base = group[BASELINE]
            for label in labels:
                run = group[label]
                run["ratio_to_float32"] = run["decode_tok_per_s"] / base["decode_tok_per_s"]
                run["agreement_with_float32"] = agreement(run["tokens"], base["tokens"], s.agreement_tokens)
                if round_ == 0 and batch == max(s.batch_sizes):
                    run["sample_output"] = engines[label].get_tokenizer().decode(run["tokens"][0])
                runs.append(run)
    for run in runs:
        del run["tokens"]
    return runs


def measure_offline(engines, trace, s: QuantSettings, progress) -> list[dict[str, Any]]:
    from orca_jax.bench.offline import run_orca

    labels = list(engines)
    runs = []
    for round_ in range(s.offline_rounds):
        group = {}
        for label in turn_order(labels, round_):
            result = run_orca(engines[label], trace)
            group[label] = {"round": round_, "config": label, **{k: result[k] for k in (
                "useful_output_tokens_per_s", "wall_s", "useful_output_tokens", "processed_tokens", "engine_steps",
                "xla_compiles_during_run", "warmup_generate_s")}}
            progress(f"offline round {round_ + 1} {label}: {result['useful_output_tokens_per_s']:.1f} tok/s "
                     f"({result['wall_s']:.1f} s)")
        for label in labels:
            group[label]["ratio_to_float32"] = (group[label]["useful_output_tokens_per_s"]
                                                / group[BASELINE]["useful_output_tokens_per_s"])
            runs.append(group[label])
    return runs


def summarize(results, runs, offline, s: QuantSettings) -> None:
    """Medians over rounds into each configuration's result; memory ratios to bfloat16's."""
    mem = results.get(MEMORY_BASELINE)
    for label, r in results.items():
        r["weight_ratio_to_bfloat16"] = r["weight_bytes"] / mem["weight_bytes"] if mem else None
        r["kv_tokens_ratio_to_bfloat16"] = r["pool_tokens"] / mem["pool_tokens"] if mem else None
        r["kv_bytes_per_token_ratio_to_bfloat16"] = (r["kv_bytes_per_token"] / mem["kv_bytes_per_token"]
                                                     if mem else None)
        if not r["timed"]:
            continue
        decode = {}
        for batch in s.batch_sizes:
            mine = [run for run in runs if run["config"] == label and run["batch"] == batch]
            decode[str(batch)] = {
                "decode_tok_per_s": _median(run["decode_tok_per_s"] for run in mine),
                "ms_per_step": _median(run["ms_per_step"] for run in mine),
                "tpot_ms": _median(run["tpot_ms"] for run in mine),
                "ratio_to_float32": _median(run["ratio_to_float32"] for run in mine),
                "ratio_to_float32_by_round": [run["ratio_to_float32"] for run in mine],
                "decode_tok_per_s_by_round": [run["decode_tok_per_s"] for run in mine],
                "agreement_with_float32": mine[0]["agreement_with_float32"],
                "agreement_identical_every_round": len({(run["agreement_with_float32"]["identical"],
                                                         run["agreement_with_float32"]["mean_common_prefix"])
                                                        for run in mine}) == 1,
            }
        r["decode"] = decode
        mine = [run for run in offline if run["config"] == label]
        r["offline"] = {"useful_output_tokens_per_s": _median(run["useful_output_tokens_per_s"] for run in mine),
                        "ratio_to_float32": _median(run["ratio_to_float32"] for run in mine),
                        "wall_s": _median(run["wall_s"] for run in mine)}


# ---- `orca-jax serve` idle ------------------------------------------------------------------------
class ServeProcess:
    """`python -m orca_jax.cli serve --port 0 ...`: the port from uvicorn's log line, the KV pool
    from the engine's, the log's tail for errors."""

    _PORT = re.compile(r"Uvicorn running on http://[\d.]+:(\d+)")
    _KV = re.compile(r"KV cache: (\d+) pages of (\d+) tokens \((\d+) tokens for sequences\), ([\d.]+) MiB")

    def __init__(self, model: str | None, args: tuple[str, ...]):
        self.command = [sys.executable, "-m", "orca_jax.cli", "--log-level", "INFO", "serve",
                        *(("--model", model) if model else ()), "--port", "0", *args]
        # The child imports the orca_jax this process runs (a checkout may shadow an installed one).
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        self.port: int | None = None
        self.kv: dict[str, float] | None = None
        # The engine's "engine ready in ... s: phases" line (its warm-up time: compiled or cached).
        self.ready_line: str | None = None
        self._port_seen = threading.Event()
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            if (m := self._KV.search(line)) and self.kv is None:
                self.kv = {"num_pages": int(m[1]), "page_size": int(m[2]), "sequence_tokens": int(m[3]),
                           "kv_cache_mib": float(m[4])}
            if "engine ready in" in line and self.ready_line is None:
                self.ready_line = line.strip()
            if (m := self._PORT.search(line)) and self.port is None:
                self.port = int(m[1])
                self._port_seen.set()
        self._port_seen.set()  # the process ended: stop waiting

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from launch until /health answers 200."""
        deadline = self.started + timeout_s
        self._port_seen.wait(max(0.0, deadline - time.perf_counter()))
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise BenchmarkError(f"`{' '.join(self.command)}` exited with {self.proc.returncode}:\n"
                                     + "".join(self.log[-20:]))
            if self.port is not None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                        if response.status == 200:
                            return time.perf_counter() - self.started
                except (urllib.error.URLError, OSError):
                    pass
            time.sleep(0.2)
        raise BenchmarkError(f"server not healthy after {timeout_s:.0f} s:\n" + "".join(self.log[-20:]))

    def memory(self) -> dict[str, int]:
        """VmRSS and VmHWM (peak) of the server process, bytes."""
        fields = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM"):
                    fields[name] = int(value.split()[0]) * 1024
        return {"rss_bytes": fields["VmRSS"], "peak_rss_bytes": fields["VmHWM"]}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)


def measure_serve(s: QuantSettings, progress) -> dict[str, Any]:
    """Idle RSS of `orca-jax serve` per serve configuration (all at once with serve_parallel;
    the equal-pages one always after float32, whose page count it takes)."""
    if not s.serve_configs:
        return {}
    results: dict[str, Any] = {}
    first = [label for label in s.serve_configs if label != SAME_PAGES]
    batches = [first] if s.serve_parallel else [[label] for label in first]
    if SAME_PAGES in s.serve_configs:
        batches.append([SAME_PAGES])
    for batch in batches:
        procs = {}
        try:
            for label in batch:
                args = (*s.serve_args, *SERVE_CONFIGS[label])
                if label == SAME_PAGES:
                    pages = (results.get("float32") or {}).get("kv", {}).get("num_pages")
                    if pages is None:
                        results[label] = {"error": "the float32 server's page count is unknown"}
                        continue
                    args = (*args, "--num-pages", str(pages))
                procs[label] = ServeProcess(s.model, args)
            for label, proc in procs.items():
                try:
                    ready_s = proc.wait_ready(s.serve_timeout_s)
                except BenchmarkError as exc:
                    results[label] = {"args": list(proc.command[proc.command.index("serve") + 1:]), "error": str(exc)}
                    progress(f"serve {label}: FAILED ({str(exc).splitlines()[0]})")
                    continue
                results[label] = {"args": list(proc.command[proc.command.index("serve") + 1:]), "ready_s": ready_s}
            time.sleep(s.settle_s)
            for label, proc in procs.items():
                if "error" in results.get(label, {}):
                    continue
                results[label].update(proc.memory(), kv=proc.kv, engine_ready_log=proc.ready_line)
                r = results[label]
                progress(f"serve {label}: idle RSS {r['rss_bytes'] / 2**30:.2f} GiB "
                         f"(peak {r['peak_rss_bytes'] / 2**30:.2f}), "
                         f"ready in {r['ready_s']:.0f} s, KV {proc.kv}")
        finally:
            for proc in procs.values():
                proc.stop()
    base = (results.get("float32") or {}).get("rss_bytes")
    for r in results.values():
        if "rss_bytes" in r and base:
            r["rss_ratio_to_float32"] = r["rss_bytes"] / base
    return results


# ---- verdicts and the report ------------------------------------------------------------------------
def target_verdict(record: dict[str, Any]) -> dict[str, Any]:
    results = record["results"]

    def verdict(labels, value, limit, at_least: bool) -> dict[str, Any]:
        by = {label: value(results[label]) for label in labels if label in results}
        by = {label: v for label, v in by.items() if v is not None}
        if not by:
            return {"measured": False, "met": None, "limit": limit}
        met = {label: (v >= limit) if at_least else (v <= limit) for label, v in by.items()}
        return {"measured": True, "limit": limit, "by_config": by, "met_by_config": met, "met": all(met.values())}

    b1 = str(min(record["settings"]["batch_sizes"]))
    return {
        "weight_ratio_int8": verdict(("int8", "int8+kv_int8"), lambda r: r["weight_ratio_to_bfloat16"],
                                     TARGET_WEIGHT_RATIO, at_least=False),
        "kv_tokens_ratio_int8": verdict(("kv_int8", "int8+kv_int8"), lambda r: r["kv_tokens_ratio_to_bfloat16"],
                                        TARGET_KV_TOKENS_RATIO, at_least=True),
        "int8_speed_batch1": verdict(("int8",), lambda r: r["decode"][b1]["ratio_to_float32"],
                                     TARGET_INT8_SPEED_RATIO, at_least=True),
    }


def format_report(record: dict[str, Any]) -> str:
    s, results = record["settings"], record["results"]
    batches = [str(b) for b in s["batch_sizes"]]
    m = record["machine"]
    lines = [
        f"quantized weights and KV cache, {record['model']}: {record['sampling']}; {s['rounds']} rounds by turns, "
        f"medians; x f32 = median of per-round ratios to float32; memory ratios to {MEMORY_BASELINE}",
        f"machine: {m.get('cpu_model')}, {m.get('cpu_count')} cores, flags {' '.join(m.get('cpu_flags', [])) or '-'}; "
        f"jax {m.get('jax')} ({m.get('jax_backend')}); load average start {record['load_average']['start']}, "
        f"end {record['load_average']['end']}",
        f"engines: KV budget {s['kv_cache_memory_bytes'] / 2**20:g} MiB each, max_num_seqs {max(s['batch_sizes'])}, "
        f"max_num_batched_tokens {s['max_num_batched_tokens']}, page {s['page_size']}, max_model_len "
        f"{s['max_model_len']}, prefix caching off; decode: {s['prompt_len']}-token prompts, {s['decode_tokens']} "
        f"tokens; offline: {s['offline_requests']} requests of Orca's trace at scale {s['offline_scale']:g}",
        "",
    ]
    header = ["config", "weights MiB", "x bf16", "KV B/token", "pool tokens", "x bf16"]
    for b in batches:
        header += [f"decode tok/s b{b}", "x f32"]
    header += ["offline tok/s", "x f32", f"same {s['agreement_tokens']} tok as f32 (b{batches[-1]})"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for label, r in results.items():
        row = [label, f"{r['weight_bytes'] / 2**20:.1f}", _fmt(r["weight_ratio_to_bfloat16"], 3),
               f"{r['kv_bytes_per_token']:.0f}", str(r["pool_tokens"]), _fmt(r["kv_tokens_ratio_to_bfloat16"], 2)]
        if not r["timed"]:
            probe = r.get("decode_probe")
            note = f"memory only (batch-1 probe: {probe['ms_per_step']:.0f} ms/step)" if probe else "memory only"
            lines.append("| " + " | ".join(row + [note] + [""] * (len(header) - len(row) - 1)) + " |")
            continue
        for b in batches:
            d = r["decode"][b]
            row += [_fmt(d["decode_tok_per_s"], 1), _fmt(d["ratio_to_float32"], 2)]
        a = r["decode"][batches[-1]]["agreement_with_float32"]
        row += [_fmt(r["offline"]["useful_output_tokens_per_s"], 1), _fmt(r["offline"]["ratio_to_float32"], 2),
                f"{a['identical']}/{a['requests']} (prefix {a['mean_common_prefix']:.1f})"]
        lines.append("| " + " | ".join(row) + " |")
    for label, reason in record["skipped"].items():
        lines.append(f"skipped {label}: {reason.splitlines()[0]}")
    if record["serve_idle"]:
        lines += ["", *serve_table(record["serve_idle"])]
    lines.append("")
    t = record["targets"]
    names = {"weight_ratio_int8": f"int8 weight bytes <= {TARGET_WEIGHT_RATIO}x bfloat16",
             "kv_tokens_ratio_int8": f"int8 KV pool >= {TARGET_KV_TOKENS_RATIO}x bfloat16's tokens",
             "int8_speed_batch1": "int8 weights at least as fast as float32 at batch 1"}
    for key, name in names.items():
        v = t[key]
        if not v["measured"]:
            lines.append(f"target: {name}: not measured")
            continue
        lines.append(f"target: {name}: {'MET' if v['met'] else 'NOT MET'} ("
                     + ", ".join(f"{label} {value:.3f}" for label, value in v["by_config"].items()) + ")")
    lines.append(f"XLA compiles during the timed runs: {record['xla_compiles_during_runs']}; "
                 f"set-up {record['setup_s']:.0f} s, whole run {record['wall_s']:.0f} s")
    return "\n".join(lines)


def serve_table(serve_idle: dict[str, Any]) -> list[str]:
    lines = ["| `orca-jax serve`, idle | flags | RSS GiB | x float32 | peak RSS GiB | KV pages (tokens) | "
             "KV MiB | ready s |", "|---|---|---|---|---|---|---|---|"]
    for label, r in serve_idle.items():
        if "error" in r:
            lines.append(f"| {label} | | FAILED: {r['error'].splitlines()[0]} | | | | | |")
            continue
        kv = r.get("kv") or {}
        flags = " ".join(SERVE_CONFIGS[label]) + (" --num-pages N" if label == SAME_PAGES else "")
        lines.append(f"| {label} | {flags or '(defaults)'} | {r['rss_bytes'] / 2**30:.2f} | "
                     f"{_fmt(r.get('rss_ratio_to_float32'), 2)} | {r['peak_rss_bytes'] / 2**30:.2f} | "
                     f"{kv.get('num_pages', '-')} ({kv.get('sequence_tokens', '-')}) | {kv.get('kv_cache_mib', '-')} | "
                     f"{r['ready_s']:.0f} |")
    return lines


def format_serve_report(record: dict[str, Any]) -> str:
    m = record["machine"]
    return "\n".join([
        f"idle `orca-jax serve`, {record['model']}: machine {m.get('cpu_model')}, {m.get('cpu_count')} cores, flags "
        f"{' '.join(m.get('cpu_flags', [])) or '-'}; load average start {record['load_average']['start']}, end "
        f"{record['load_average']['end']}", "", *serve_table(record["serve_idle"]), "",
        f"whole run {record['wall_s']:.0f} s"])


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _default_model_name() -> str:
    from orca_jax.loading.loader import default_model_path

    return str(default_model_path())
