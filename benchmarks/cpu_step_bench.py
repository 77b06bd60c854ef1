"""The engine's device step on a CPU, against the machine's measured limits (issue 14).

    python benchmarks/cpu_step_bench.py --json cpu_step.json          # everything, float32 and bfloat16
    python benchmarks/cpu_step_bench.py --parts decode --dtype float32 --batch-sizes 16 --contexts 2048
    PYTHONPATH=/tmp/orca-44b729d python benchmarks/cpu_step_bench.py --parts sampler --json before.json

Three parts, each a table and rows of the JSON (written after every row):

* decode: one step of the runner's own compiled program (`ModelRunner.run`: expand the
  persistent batch, `model.apply`, sample, keep the tokens) with `batch` sequences that each
  have `context` tokens cached, at every batch size x context. No prompt is prefilled (64 x
  2,048 tokens would take minutes): the KV cache is filled with random values and the batch
  state's page tables are written directly, so the step sees what it would after a prefill.
  Every sequence owns its own pages. Roofline: the step must read every weight once (a tied
  embedding once, as the LM head; an untied table only for its looked-up rows, not counted)
  and the visited K/V of every layer, so its floor is (weight bytes + batch x context x KV
  bytes per token) / read bandwidth. The attention share is the attention op alone
  (`orca_jax.kernels.ragged_paged_attention`, same impl, on the metadata the step's own
  `expand` builds from the same inputs), once per layer over the same cache, over the step.
  Rows are greedy, so sampling is the argmax the engine's greedy rows pay.
* prefill: one sequence of n tokens on an empty cache, as the engine's first chunk of a
  prompt (the slot joins, its pages arrive in the step's page writes), with the engine's
  default max_num_seqs (the rows of logits a bucket computes). Roofline: FLOPs / the measured
  matmul rate (`orca_jax.bench.roofline.measure_matmul_rate`; for bfloat16 the faster of its
  bfloat16 and best float32 rates): 2 x layer matmul parameters per token, 2 x vocab x hidden
  for the one row of logits the prompt needs, 4 x heads x head_dim per causal (query, key)
  pair per layer. Attention share as for decode, and attention's time over its FLOP time.
* sampler: `orca_jax.worker.sampling.sample` jitted alone on random logits [S, vocab], normal x
  each of `--logit-scales`: x 3 is a flat distribution (top_p=0.9 keeps ~2,000 of 49,152
  tokens, past the sampler's 256 candidates, so its exact bisection runs), x 8 a peaked one
  (the nucleus within a few tokens, as at most steps of a chat model), for several mixes of
  sampling settings, with the engine's
  default max_logprobs. It uses only sample(logits, inputs, max_logprobs, counts),
  `SamplingInputs` and `TokenCounts`, so that the same script gives "before" numbers on a
  checkout of 44b729d (`git worktree add /tmp/orca-44b729d 44b729d`, then PYTHONPATH as
  above; the record's "orca_jax" says which code ran).

Each timing is the median of `--repeats` runs after one warm-up run, fewer once the runs
pass `--max-seconds` (a slow shape on a shared machine; rows say how many ran). Parts run
cheapest first: sampler, then per dtype prefill and decode. Weights and KV cache are in each
`--dtype`. The read bandwidth is a jitted jnp.sum over a float32 array far larger than
the caches (median). The record names the CPU flags that decide bfloat16 speed (avx512_bf16,
amx_*). `--model` takes any checkpoint the engine loads (the tests use a tiny random one).
"""

from __future__ import annotations

import argparse
import itertools
import dataclasses
import functools
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.bench.arguments import choice_list, nonempty_sizes, numbers

PARTS = ("decode", "prefill", "sampler")
# Sampler mixes: which rows take the settings ("all" or "one", the rest greedy) and the settings.
SAMPLER_MIXES = {
    "greedy": ("all", {}),
    "temperature_1": ("all", {"temperature": 1.0}),
    "one_top_p_0.9": ("one", {"temperature": 1.0, "top_p": 0.9}),
    "top_p_0.9": ("all", {"temperature": 1.0, "top_p": 0.9}),
    "top_k_50": ("all", {"temperature": 1.0, "top_k": 50}),
    "min_p_0.05": ("all", {"temperature": 1.0, "min_p": 0.05}),
    # logprobs=5: the program computes the engine's max_logprobs candidates whatever the count.
    "one_logprobs_5": ("one", {"want_logprobs": True}),
}
# Pages of random K/V generated once and repeated over the pool: a normal draw of the whole
# pool (1.5e9 values at 64 x 2,048 tokens) takes over a minute on 2 cores, and the values
# only have to be finite and varied, not unique.
RANDOM_KV_BLOCK_PAGES = 61


@dataclass(frozen=True)
class Repeats:
    """How often a timing runs: `count` times after one warm-up run, fewer when the timed runs
    pass `max_seconds` together (at least one), so that a slow shape on a shared machine does
    not hold the run for minutes."""

    count: int
    max_seconds: float


@dataclass(frozen=True)
class Timing:
    seconds: float  # median of the timed runs
    runs: int


def median_seconds(fn, repeats: Repeats) -> Timing:
    fn()  # warm-up (and compile)
    times = []
    while len(times) < repeats.count and (not times or sum(times) < repeats.max_seconds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return Timing(statistics.median(times), len(times))


def read_bandwidth(mib: int, repeats: Repeats) -> dict:
    """Bytes per second of a jitted sum over a float32 array of `mib` MiB (median)."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    timing = median_seconds(lambda: total(x).block_until_ready(), repeats)
    return {"bytes": x.nbytes, "runs": timing.runs, "seconds": timing.seconds,
            "gb_per_s": x.nbytes / timing.seconds / 1e9}


# ---- byte and FLOP accounting -------------------------------------------------------------
def weight_bytes(params) -> int:
    """Bytes a decode step must read: every weight once; an untied embedding table is only
    looked up (a few rows), so it is left out, while a tied one is the LM head."""
    tree = params["params"]
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(tree))
    return total - (tree["embed"].nbytes if "lm_head" in tree else 0)


def kv_bytes_per_token(model_config, dtype) -> int:
    c = model_config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * jnp.dtype(dtype).itemsize


def prefill_flops(model_config, param_counts: dict, tokens: int) -> dict:
    """FLOPs of one prompt of `tokens` tokens: linear layers on every token, the LM head on the
    last one (the one logits row it needs), causal attention (token t reads t keys)."""
    c = model_config
    linear = 2.0 * param_counts["layer_matmul"] * tokens
    head = 2.0 * c.vocab_size * c.hidden_size
    attention = 4.0 * c.num_layers * c.num_heads * c.head_dim * tokens * (tokens + 1) / 2
    return {"linear": linear, "lm_head": head, "attention": attention, "total": linear + head + attention}


# ---- the runner and its hand-built steps --------------------------------------------------
def build_runner(model: str | None, dtype: str, kv_cache_dtype: str, attention_impl: str, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, num_pages: int, page_size: int):
    """The engine's ModelRunner, weights in `dtype`, KV cache in `kv_cache_dtype` ("same": in
    `dtype`; "auto": the engine's rule), built as LLMEngine builds it."""
    from orca_jax.worker.compilation_cache import configure_for_process
    from orca_jax.config import EngineConfig
    from orca_jax.kernels import resolve_impl
    from orca_jax.loading.loader import load_model
    from orca_jax.worker.runner import ModelRunner

    kv_cache_dtype = dtype if kv_cache_dtype == "same" else kv_cache_dtype
    config = EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                          num_pages=num_pages, page_size=page_size, attention_impl=attention_impl)
    configure_for_process(config.compilation_cache_dir)
    loaded = load_model(config.model, dtype=dtype, cache_dir=config.model_cache_dir)
    config = config.resolve(loaded.config)
    return ModelRunner(loaded.config, config, loaded.params, resolve_impl(config.attention_impl))


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def random_kv_cache(key, shape: tuple[int, ...], dtype) -> jax.Array:
    """[L, P, page_size, 2K, H] of normal values: a block of random pages repeated over the pool."""
    num_pages = shape[1]
    block = jax.random.normal(key, (RANDOM_KV_BLOCK_PAGES, *shape[2:]), jnp.float32)
    pages = block[jnp.arange(num_pages) % RANDOM_KV_BLOCK_PAGES]
    return jnp.broadcast_to(pages, shape).astype(dtype)


def fill_kv_cache_randomly(runner, seed: int = 0) -> None:
    shape = runner.kv_cache.shape
    runner.kv_cache.delete()  # free the zeroed pool first: two pools may not fit in memory
    runner.kv_cache = random_kv_cache(jax.random.key(seed), shape, runner.kv_dtype).block_until_ready()


def _row_arrays(config, num_tokens: int, num_rows: int) -> dict:
    """StepInputs fields of a step whose first `num_rows` rows are greedy and the rest padding."""
    from orca_jax.worker.batch import token_bucket
    from orca_jax.worker.batch_state import REPETITION, TOP_P, page_write_capacity
    from orca_jax.structured.guided_decoding import all_allowed_bitmask
    from orca_jax.core.sampling_params import MAX_LOGIT_BIAS
    from orca_jax.core.kv_cache import PADDING_PAGE

    T = token_bucket(config, num_tokens)
    S = config.seq_bucket(T)
    sink = config.max_num_seqs
    sampling = np.zeros((S, 6), np.float32)
    sampling[:, TOP_P] = sampling[:, REPETITION] = 1.0
    page_writes = np.empty((page_write_capacity(config, T), 2), np.int32)
    page_writes[:] = (sink * config.max_pages_per_seq, PADDING_PAGE)  # the padding write
    row_slot = np.full(S, sink, np.int32)
    row_slot[:num_rows] = np.arange(num_rows)
    return dict(input_ids=np.zeros(T, np.int32), row_slot=row_slot, row_start=np.zeros(S, np.int32),
                row_len=np.zeros(S, np.int32), row_prompt_len=np.zeros(S, np.int32),
                row_flags=np.zeros(S, np.int32), sample_index=np.zeros(S, np.int32), top_k=np.zeros(S, np.int32),
                seeds=np.arange(S, dtype=np.uint32), sampling=sampling, page_writes=page_writes,
                num_seqs=np.array([num_rows], np.int32),
                token_bitmask=np.array(all_allowed_bitmask(S, config.vocab_size)),  # no constrained row
                row_drafts=np.zeros(S, np.int32),  # no speculation
                prompt_targets=np.full(T, -1, np.int32),  # no prompt log-probabilities
                bias_ids=np.zeros((S, MAX_LOGIT_BIAS), np.int32),  # no logit_bias row
                bias_values=np.zeros((S, MAX_LOGIT_BIAS), np.float32))


def decode_inputs(config, vocab_size: int, batch: int, context: int, seed: int = 0):
    """A decode step of `batch` sequences in slots 0..batch-1, each feeding its token at
    position context - 1 (its first output token), so attention visits `context` tokens.
    Their pages are already on the device (`decode_page_table`): no page writes, no joins."""
    from orca_jax.worker.batch_state import ROW_SAMPLES, StepInputs

    f = _row_arrays(config, batch, batch)
    f["input_ids"][:batch] = np.random.default_rng(seed).integers(0, vocab_size, batch)
    f["row_start"][:batch] = context - 1
    f["row_len"][:batch] = 1
    f["row_prompt_len"][:batch] = context - 1
    f["row_flags"][:batch] = ROW_SAMPLES
    return StepInputs(**f)


def decode_page_table(config, batch: int, context: int) -> np.ndarray:
    """i32[R, P]: slot s owns pages 1 + s * P + (0, 1, ...), as many as `context` tokens fill."""
    from orca_jax.worker.batch_state import num_slots
    from orca_jax.core.kv_cache import PADDING_PAGE

    P = config.max_pages_per_seq
    table = np.full((num_slots(config), P), PADDING_PAGE, np.int32)
    used = -(-context // config.page_size)
    table[:batch, :used] = 1 + np.arange(batch)[:, None] * P + np.arange(used)
    return table


def install_page_table(runner, table: np.ndarray) -> None:
    """Write the slots' page tables into the persistent batch state, as earlier steps would."""
    runner.state = dataclasses.replace(runner.state, page_table=jnp.asarray(table))


def prefill_inputs(config, vocab_size: int, tokens: int, seed: int = 0):
    """The first chunk of one new sequence: it joins slot 0 with `tokens` prompt tokens, its
    pages (1, 2, ...) sent in the step's page writes, as the engine sends them."""
    from orca_jax.worker.batch_state import ROW_JOINS, ROW_SAMPLES, StepInputs

    f = _row_arrays(config, tokens, 1)
    f["input_ids"][:tokens] = np.random.default_rng(seed).integers(0, vocab_size, tokens)
    f["row_len"][0] = f["row_prompt_len"][0] = tokens
    f["row_flags"][0] = ROW_SAMPLES | ROW_JOINS
    pages = -(-tokens // config.page_size)
    f["page_writes"][:pages] = np.stack([np.arange(pages), 1 + np.arange(pages)], axis=1)
    return StepInputs(**f)


def step_metadata(runner, inputs):
    """The AttentionMetadata the step program builds from `inputs` (its own `expand`)."""
    from orca_jax.worker.batch_state import expand

    _, batch, _, _ = jax.jit(functools.partial(expand, page_size=runner.config.page_size))(runner.state, inputs)
    return batch.metadata


def time_step(runner, inputs, repeats: Repeats) -> Timing:
    """Median seconds of one step: enqueue the compiled program, wait for its sampled tokens."""
    return median_seconds(lambda: runner.run(inputs).result(), repeats)


def all_layers_attention(q, kv_cache, metadata, *, impl, sm_scale, sliding_window, soft_cap):
    """The model's attention op once per layer, each on its own layer's pages (as the layer
    scan calls it), outputs summed so that no layer's work is dropped."""
    from orca_jax import kernels

    num_layers, num_pages, page_size = kv_cache.shape[:3]
    flat = kv_cache.reshape(num_layers * num_pages, *kv_cache.shape[2:])

    def layer(total, index):
        out = kernels.ragged_paged_attention(q, flat, metadata.for_layer(index, num_pages, page_size),
                                             sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                             impl=impl)
        return total + out.astype(jnp.float32), None

    total, _ = jax.lax.scan(layer, jnp.zeros(q.shape, jnp.float32), jnp.arange(num_layers))
    return total


def time_attention(runner, inputs, repeats: Repeats) -> Timing:
    c = runner.model_config
    metadata = step_metadata(runner, inputs)
    q = jax.random.normal(jax.random.key(1), (inputs.num_tokens, c.num_heads, c.head_dim), jnp.float32)
    q = q.astype(runner.dtype)
    attend = jax.jit(functools.partial(all_layers_attention, impl=runner.model.attention_impl,
                                       sm_scale=c.head_dim ** -0.5, sliding_window=c.sliding_window,
                                       soft_cap=c.attn_logit_softcapping))
    return median_seconds(lambda: attend(q, runner.kv_cache, metadata).block_until_ready(), repeats)


# ---- the three parts ----------------------------------------------------------------------
def run_decode(args, dtype: str, bandwidth_bps: float, on_row) -> None:
    from orca_jax.worker.batch import token_bucket
    from orca_jax.config import EngineConfig

    ps = args.page_size
    pages_per_seq = -(-max(args.contexts) // ps)
    # At least the engine's default max_num_seqs, so that a small batch gets the engine's
    # bucket (a batch of 1 runs in the 8-token bucket with 8 rows); the budget is one token
    # per sequence, since these steps only decode.
    seqs = max(*args.batch_sizes, EngineConfig().max_num_seqs)
    runner = build_runner(args.model, dtype, args.kv_cache_dtype, args.attention_impl, max_num_seqs=seqs,
                          max_num_batched_tokens=seqs, max_model_len=pages_per_seq * ps,
                          num_pages=max(args.batch_sizes) * pages_per_seq + 1, page_size=ps)
    config, c = runner.config, runner.model_config
    print(f"decode {dtype}: KV pool {runner.kv_cache.nbytes / 2**30:.2f} GiB of {runner.kv_dtype}, attention "
          f"{runner.model.attention_impl}", flush=True)
    fill_kv_cache_randomly(runner)
    compile_s = _warm_up(runner, [token_bucket(config, b) for b in args.batch_sizes])
    weights = weight_bytes(runner.params)
    for context in args.contexts:
        for batch in args.batch_sizes:
            install_page_table(runner, decode_page_table(config, batch, context))
            inputs = decode_inputs(config, c.vocab_size, batch, context)
            step, attention = time_step(runner, inputs, repeats(args)), time_attention(runner, inputs, repeats(args))
            step_s, attention_s = step.seconds, attention.seconds
            kv = batch * context * kv_bytes_per_token(c, runner.kv_dtype)
            roofline_s = (weights + kv) / bandwidth_bps
            # The rest of the step; below 5% of it, the difference of two noisy timings means nothing.
            dense_s = step_s - attention_s if step_s - attention_s > 0.05 * step_s else None
            on_row({
                "part": "decode", "dtype": dtype, "kv_dtype": str(runner.kv_dtype),
                "attention_impl": runner.model.attention_impl, "batch": batch, "context": context,
                "bucket": inputs.num_tokens, "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
                "weight_bytes": weights, "kv_bytes": kv, "roofline_ms": roofline_s * 1e3,
                "share_of_roofline": roofline_s / step_s, "attention_ms": attention_s * 1e3,
                "attention_share": attention_s / step_s, "attention_gb_per_s": kv / attention_s / 1e9,
                "attention_share_of_bandwidth": kv / attention_s / bandwidth_bps,
                # The rest of the step against the weight bytes alone (issue 14's "dense decode").
                "dense_share_of_weight_roofline": None if dense_s is None else weights / bandwidth_bps / dense_s,
                "compile_s": compile_s, "step_runs": step.runs, "attention_runs": attention.runs,
            })
    del runner


def run_prefill(args, dtype: str, matmul: dict, on_row) -> None:
    from orca_jax.worker.batch import token_bucket
    from orca_jax.bench.roofline import count_params
    from orca_jax.config import EngineConfig

    ps, longest = args.page_size, max(args.prefill_tokens)
    budget = longest  # the buckets up to it are the engine's (powers of two, then the limit)
    runner = build_runner(args.model, dtype, args.kv_cache_dtype, args.attention_impl,
                          max_num_seqs=min(EngineConfig().max_num_seqs, budget), max_num_batched_tokens=budget,
                          max_model_len=-(-longest // ps) * ps, num_pages=-(-longest // ps) + 1, page_size=ps)
    config, c = runner.config, runner.model_config
    rate = max(matmul["roofline_flop_per_s"], matmul["flop_per_s"].get(f"jax_{dtype}", 0.0))
    counts = count_params(runner.params)
    compile_s = _warm_up(runner, [token_bucket(config, n) for n in args.prefill_tokens])
    for tokens in args.prefill_tokens:
        inputs = prefill_inputs(config, c.vocab_size, tokens)
        step, attention = time_step(runner, inputs, repeats(args)), time_attention(runner, inputs, repeats(args))
        step_s, attention_s = step.seconds, attention.seconds
        flops = prefill_flops(c, counts, tokens)
        on_row({
            "part": "prefill", "dtype": dtype, "kv_dtype": str(runner.kv_dtype),
            "attention_impl": runner.model.attention_impl, "tokens": tokens,
            "bucket": inputs.num_tokens, "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s,
            "flops": flops, "flop_per_s_used": rate, "roofline_ms": flops["total"] / rate * 1e3,
            "share_of_roofline": flops["total"] / rate / step_s, "achieved_flop_per_s": flops["total"] / step_s,
            "attention_ms": attention_s * 1e3, "attention_share": attention_s / step_s,
            "attention_over_flop_time": attention_s / (flops["attention"] / rate), "compile_s": compile_s,
            "step_runs": step.runs, "attention_runs": attention.runs,
        })
    del runner


def repeats(args) -> Repeats:
    return Repeats(args.repeats, args.max_seconds)


def _warm_up(runner, buckets: list[int]) -> float:
    """Build the step programs of `buckets` (the runner's own warm-up); seconds taken."""
    return runner.warmup(sorted(set(buckets))).seconds


def sampler_inputs(mix: str, rows: int):
    """SamplingInputs of `rows` rows: greedy, with the mix's settings on all rows or the first."""
    from orca_jax.worker.batch import SamplingInputs

    which, settings = SAMPLER_MIXES[mix]
    fields = dict(temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32),
                  top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
                  presence_penalty=np.zeros(rows, np.float32), frequency_penalty=np.zeros(rows, np.float32),
                  repetition_penalty=np.ones(rows, np.float32), seeds=np.arange(rows, dtype=np.uint32),
                  sample_index=np.zeros(rows, np.int32), want_logprobs=np.zeros(rows, bool))
    hit = slice(None) if which == "all" else slice(0, 1)
    for name, value in settings.items():
        fields[name][hit] = value
    return SamplingInputs(**fields)


def run_sampler(args, on_row) -> None:
    from orca_jax.config import EngineConfig
    from orca_jax.worker.sampling import TokenCounts, sample

    max_logprobs = EngineConfig().max_logprobs
    # One program per shape serves every mix (its optional work sits behind lax.cond).
    program = jax.jit(lambda logits, inputs, counts: sample(logits, inputs, max_logprobs, counts))
    for rows, scale in itertools.product(args.sampler_rows, args.logit_scales):
        logits = jax.random.normal(jax.random.key(rows), (rows, args.vocab_size), jnp.float32) * scale
        counts = TokenCounts(output_counts=jnp.zeros((rows + 1, args.vocab_size), jnp.int32),
                             prompt_seen=jnp.zeros((rows + 1, args.vocab_size), bool),
                             row_slot=jnp.arange(rows, dtype=jnp.int32))
        greedy_ms = None
        for mix in SAMPLER_MIXES:
            inputs = jax.tree.map(jnp.asarray, sampler_inputs(mix, rows))
            timing = median_seconds(lambda: jax.block_until_ready(program(logits, inputs, counts)), repeats(args))
            ms = timing.seconds * 1e3
            greedy_ms = ms if mix == "greedy" else greedy_ms
            on_row({"part": "sampler", "rows": rows, "vocab_size": args.vocab_size, "logit_scale": scale, "mix": mix, "ms": ms,
                    "over_greedy_ms": ms - greedy_ms, "runs": timing.runs})


# ---- report -------------------------------------------------------------------------------
def _pct(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def format_tables(rows: list[dict], bandwidth_gbs: float | None) -> str:
    lines = []
    decode = [r for r in rows if r["part"] == "decode"]
    if decode:
        lines += [f"decode (read bandwidth {bandwidth_gbs:.1f} GB/s)",
                  f"{'dtype':>9} {'kv':>9} {'impl':>9} {'batch':>5} {'ctx':>5} {'step ms':>8} {'roof ms':>8} {'%roof':>6} "
                  f"{'attn ms':>8} {'attn%':>6} {'attn GB/s':>9} {'dense%w':>7}"]
        lines += [f"{r['dtype']:>9} {r['kv_dtype']:>9} {r['attention_impl']:>9} {r['batch']:>5} {r['context']:>5} {r['step_ms']:8.2f} "
                  f"{r['roofline_ms']:8.2f} {_pct(r['share_of_roofline']):>6} {r['attention_ms']:8.2f} "
                  f"{_pct(r['attention_share']):>6} {r['attention_gb_per_s']:9.1f} "
                  f"{_pct(r['dense_share_of_weight_roofline']):>7}" for r in decode]
    prefill = [r for r in rows if r["part"] == "prefill"]
    if prefill:
        lines += ["", "prefill (one sequence, empty cache)",
                  f"{'dtype':>9} {'kv':>9} {'impl':>9} {'tokens':>6} {'step ms':>8} {'roof ms':>8} {'%roof':>6} {'GFLOP/s':>8} "
                  f"{'attn ms':>8} {'attn%':>6} {'attn/flop':>9}"]
        lines += [f"{r['dtype']:>9} {r['kv_dtype']:>9} {r['attention_impl']:>9} {r['tokens']:>6} {r['step_ms']:8.2f} "
                  f"{r['roofline_ms']:8.2f} {_pct(r['share_of_roofline']):>6} {r['achieved_flop_per_s'] / 1e9:8.1f} "
                  f"{r['attention_ms']:8.2f} {_pct(r['attention_share']):>6} {r['attention_over_flop_time']:8.1f}x"
                  for r in prefill]
    sampler = [r for r in rows if r["part"] == "sampler"]
    if sampler:
        lines += ["", "sampler (sample() alone on random logits)",
                  f"{'rows':>5} {'vocab':>6} {'scale':>5} {'mix':>15} {'ms':>8} {'+ms vs greedy':>13}"]
        lines += [f"{r['rows']:>5} {r['vocab_size']:>6} {r.get('logit_scale', 3.0):>5} {r['mix']:>15} {r['ms']:8.2f} "
                  f"{r['over_greedy_ms']:13.2f}"
                  for r in sampler]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    from orca_jax import kernels

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", type=choice_list(("float32", "bfloat16")), default=["float32", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=("same", "auto", "float32", "bfloat16"),
                   help="same: the KV cache in each --dtype; auto: the engine's rule (float32 on CPU)")
    p.add_argument("--attention-impl", default="auto", choices=("auto", *kernels.available_impls()))
    p.add_argument("--parts", type=choice_list(PARTS), default=list(PARTS))
    p.add_argument("--batch-sizes", type=nonempty_sizes, default=[1, 16, 64])
    p.add_argument("--contexts", type=nonempty_sizes, default=[256, 2048], help="cached tokens per decoding sequence")
    p.add_argument("--logit-scales", type=numbers, default=(3.0, 8.0),
                   help="standard deviations of the sampler's random logits (3: flat, 8: peaked)")
    p.add_argument("--prefill-tokens", type=nonempty_sizes, default=[128, 512])
    p.add_argument("--sampler-rows", type=nonempty_sizes, default=[16, 64])
    p.add_argument("--vocab-size", type=int, default=49152, help="sampler logits width")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--max-seconds", type=float, default=15.0,
                   help="stop repeating a timing once its timed runs took this long (at least one run)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--bandwidth-mib", type=int, default=512, help="size of the read-bandwidth array")
    p.add_argument("--matmul-size", type=int, default=2048, help="side of the matmul-rate matrices")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for name in ("repeats", "page_size", "bandwidth_mib", "matmul_size", "vocab_size", "max_seconds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    from orca_jax.bench.environment import record_header
    from orca_jax.bench.harness import ReportFile
    from orca_jax.bench.roofline import measure_matmul_rate

    args = parse_args(argv)
    words = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "benchmarks/cpu_step_bench.py", *words])
    out = ReportFile(args.json, {**record_header("cpu_step_bench", command), "settings": vars(args), "rows": []})
    report, on_row = out.record, out.add_row

    bandwidth = None
    if "decode" in args.parts:
        report["read_bandwidth"] = read_bandwidth(args.bandwidth_mib, repeats(args))
        bandwidth = report["read_bandwidth"]["gb_per_s"]
        on_row()
    if "prefill" in args.parts:
        extra = tuple(d for d in args.dtype if d != "float32")
        report["matmul"] = measure_matmul_rate(args.matmul_size, args.repeats, extra_jax_dtypes=extra)
        on_row()
    # Cheapest first, so that a run cut short keeps the most rows.
    if "sampler" in args.parts:
        run_sampler(args, on_row)
    for dtype in args.dtype:
        if "prefill" in args.parts:
            run_prefill(args, dtype, report["matmul"], on_row)
        if "decode" in args.parts:
            run_decode(args, dtype, bandwidth * 1e9, on_row)
    print(format_tables(report["rows"], bandwidth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
