"""Mixture of experts on whatever device JAX runs on (issue 20): the grouped matmul against a
dense matmul of the same FLOPs, and a MoE model's step against a dense model of the same active
parameter count.

    python benchmarks/moe_bench.py --json docs/moe_cpu.json                     # CPU, ~2-4 minutes on 2 cores
    python benchmarks/moe_bench.py --parts matmul --shapes qwen3_30b_a3b --dtype bfloat16 \\
        --decode-tokens 8,64 --prefill-tokens 256,512 --max-seconds 2 --json moe_bench.json  # gpu_session.sh

Two parts, each a table and rows of the JSON (written after every row, so a cut run keeps what
finished). Nothing here picks a platform: it runs on `jax.default_backend()`.

* matmul: `orca_jax.kernels.grouped_mlp.grouped_matmul(lhs [M, K], rhs [E, K, N], group_sizes)`
  compiled alone, for each `--shapes` entry (hidden D, expert width F, experts E, top-k k) and
  projection (`up`: K = D, N = F, the gate and up projections; `down`: K = F, N = D), at M = T x
  k rows for T in `--decode-tokens` and `--prefill-tokens`. Routing is a random top-k: each
  token picks k distinct experts uniformly (a trained router is more uneven). Timed per impl:
  "blocked" (the CPU path: a loop over blocks of rows of one expert), "ragged_dot"
  (`jax.lax.ragged_dot`: XLA's grouped GEMM on GPU, Mosaic's on TPU, on CPU jax's generic
  lowering, which multiplies a dense [E, M, K] masked copy of the rows by every expert: E times
  the FLOPs, skipped past `--ragged-max-flops` / `--ragged-max-bytes` on CPU, the JSON says
  why), on GPU also "ragged_dot_triton" (the same call under jax's
  `jax_ragged_dot_use_gpu_pallas_triton_lowering`), and "dense": [M, K] @ [K, N], the same
  2 M K N FLOPs on one weight; when asked, "blocked_pow2": the blocked loop under the block
  rule it had before `grouped_mlp.block_rows_for` (`block_rows_pow2`: the power of two at or
  above the mean group size, from 8 to 256), so both rules run by turns on the same rows.
  Also when asked, "blocked_mxfp4" and "ragged_dot_mxfp4": the same two on experts of the same
  shapes packed MXFP4 (`packed_weight`: random codes; the blocked loop unpacks one expert per
  block, ragged_dot gets the whole stack unpacked first), checked against their unpacked values;
  their weight bytes are 4.25 bits per weight.
  Reported: ms, GFLOP/s of the useful 2 M K N FLOPs, each impl's
  rate over dense's, and the expert weight bytes the step must read (experts with a row x K x
  N) per second. Each impl's output is checked against a float32 numpy product of 64 sampled
  rows (max error over the largest reference value) before it is timed; that checked call is
  its warm-up, and an impl whose checked call took over `--max-seconds` is not run again (its
  time is that call's, "first_call_only").
* step: one forward step of a random `qwen3_moe` model (`--moe-model`, built through
  `orca_jax.models.architecture(...).model_class`, random weights in the tree its init
  declares) and of a `qwen3` model with the same attention whose MLP is as wide as the MoE's
  active experts (k x F): the jitted `model.apply` with hand-built AttentionMetadata
  (`orca_jax.kernels.testing.ragged_metadata`), the KV cache random (float32 on CPU, as the
  engine keeps it there; else in `--dtype`) and donated, as the engine's step does: decode,
  `--step-decode-tokens` sequences of one token at `--decode-context` cached tokens, and
  prefill, one sequence of `--step-prefill-tokens` tokens on an empty cache. Reported: ms per
  step of each, MoE over dense, both models' total and active parameters (active: the
  non-expert weights plus k / E of the experts), and, under uniform routing, the experts a
  layer touches and the MoE MLP's weight bytes over the dense MLP's.

Timings are medians of `--repeats` runs after a warm-up run, fewer once an impl's runs pass
`--max-seconds` together (at least one). The impls of a row (and the two models of a step) run
by turns, one run of each per round, so that load from other work on a shared machine falls
on all of them alike. The record names the CPU flags that decide the CPU's matmul speed
(avx2, avx512*, amx*), the jax version and its ragged_dot lowering switches, and the read
bandwidth (a jitted sum over `--bandwidth-mib` MiB) the weight-bytes rates are read against.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.bench.arguments import choice_list, nonempty_sizes

PARTS = ("matmul", "step")
PROJECTIONS = ("up", "down")
IMPLS = ("dense", "blocked", "ragged_dot", "ragged_dot_triton", "blocked_pow2", "blocked_mxfp4", "ragged_dot_mxfp4")
DEFAULT_IMPLS = IMPLS[:4]  # blocked_pow2 only when asked (the block rule's before/after), the *_mxfp4 too
# jax's switches of ragged_dot's lowering, recorded (they decide what "ragged_dot" means on GPU).
RAGGED_DOT_FLAGS = ("jax_ragged_dot_use_ragged_dot_instruction", "jax_ragged_dot_use_gpu_pallas_triton_lowering")
TRITON_FLAG = "jax_ragged_dot_use_gpu_pallas_triton_lowering"


@dataclasses.dataclass(frozen=True)
class Shape:
    """One MoE layer's expert shape: hidden D, expert width F, experts E, experts per token k."""

    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int


# Real per-layer shapes and CPU-sized ones of the same family (fewer experts, narrower hidden).
SHAPES = {s.name: s for s in (
    Shape("qwen3_30b_a3b", 2048, 768, 128, 8),  # Qwen3-30B-A3B: 48 layers of these
    Shape("qwen3_a3b_cpu", 1024, 768, 64, 8),  # half its hidden size and experts
    Shape("mixtral_8x7b", 4096, 14336, 8, 2),
    Shape("mixtral_cpu", 1024, 3584, 8, 2),  # a quarter of Mixtral-8x7B's hidden and width
    Shape("gpt_oss_120b", 2880, 2880, 128, 4),  # gpt-oss-120b (36 layers; the 20b: 24 layers of 32 experts)
    Shape("gpt_oss_cpu", 1024, 1024, 32, 4),  # its top-4 routing at a CPU's size
)}

# The step part's models: a Qwen3-MoE-like model sized to run in seconds on two cores (its
# `intermediate_size` is set to k x F by `moe_config`), and the dense Qwen3 of that width
# (`dense_twin`).
MOE_MODEL = dict(model_type="qwen3_moe", vocab_size=4096, hidden_size=1024, num_layers=4, num_heads=16,
                 num_kv_heads=4, head_dim=64, qk_norm=True, intermediate_size=0, num_experts=64,
                 num_experts_per_tok=8, moe_intermediate_size=256, norm_topk_prob=True, max_position_embeddings=4096,
                 rms_norm_eps=1e-6, rope_theta=1000000.0)


def jax_ragged_dot_flags() -> dict:
    return {name: getattr(jax.config, name, None) for name in RAGGED_DOT_FLAGS}


@contextlib.contextmanager
def jax_flag(name: str, value):
    before = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, before)


# ---- timing -------------------------------------------------------------------------------
def interleaved_medians(fns: dict, repeats: int, max_seconds: float, warm_up: bool = True) -> dict[str, dict]:
    """{name: fn} -> {name: {"ms": median, "runs": n}}: one warm-up call of each (unless the
    caller made it), then rounds of one timed call of each, until each has `repeats` runs or
    its runs took `max_seconds` together (at least one run each). Each fn waits for its own
    result."""
    for fn in fns.values() if warm_up else ():
        fn()
    times = {name: [] for name in fns}

    def wants_more(name):
        runs = times[name]
        return len(runs) < repeats and (not runs or sum(runs) < max_seconds)

    while any(wants_more(name) for name in fns):
        for name, fn in fns.items():
            if wants_more(name):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: {"ms": statistics.median(runs) * 1e3, "runs": len(runs)} for name, runs in times.items()}


def read_bandwidth(mib: int, repeats: int) -> dict:
    """Bytes per second of a jitted sum over a float32 array of `mib` MiB (median)."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    timing = interleaved_medians({"sum": lambda: total(x).block_until_ready()}, repeats, 10.0)["sum"]
    return {"bytes": x.nbytes, "runs": timing["runs"], "ms": timing["ms"], "gb_per_s": x.nbytes / timing["ms"] / 1e6}


# ---- part 1: the grouped matmul -----------------------------------------------------------
def random_routing(tokens: int, experts: int, top_k: int, seed: int) -> np.ndarray:
    """i32[tokens * top_k]: each token's k distinct experts, uniformly at random, sorted (the
    order of the rows after the layer's sort by expert)."""
    rng = np.random.default_rng(seed)
    chosen = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.sort(chosen.reshape(-1)).astype(np.int32)


def block_layout(group_sizes: np.ndarray, block_rows: int) -> dict:
    """What the blocked loop runs for these groups: blocks (each group padded to whole blocks)
    and the rows they compute, padding included."""
    blocks = int(np.sum(-(-group_sizes // block_rows)))
    return {"block_rows": block_rows, "blocks": blocks, "computed_rows": blocks * block_rows}


def ragged_dot_cpu_cost(rows: int, k: int, n: int, experts: int, itemsize: int) -> tuple[float, int]:
    """(FLOPs, bytes of the masked copy) of jax's generic ragged_dot lowering (the CPU's): the
    rows broadcast to [E, M, K], masked per group, contracted with all of [E, K, N]."""
    return 2.0 * experts * rows * k * n, experts * rows * k * itemsize


def skip_reason(impl: str, backend: str, rows: int, k: int, n: int, experts: int, itemsize: int, args) -> str | None:
    if impl == "ragged_dot_triton" and backend != "gpu":
        return f"the Triton lowering is GPU-only (backend {backend})"
    if impl == "ragged_dot_triton" and not hasattr(jax.config, TRITON_FLAG):
        return f"this jax ({jax.__version__}) has no {TRITON_FLAG}"
    if impl in ("ragged_dot", "ragged_dot_mxfp4") and backend == "cpu":
        flops, nbytes = ragged_dot_cpu_cost(rows, k, n, experts, itemsize)
        if flops > args.ragged_max_flops:
            return (f"CPU lowering is dense-masked: {flops / 1e9:.0f} GFLOP ({experts}x the useful FLOPs) "
                    f"> --ragged-max-flops {args.ragged_max_flops / 1e9:.0f} GFLOP")
        if nbytes > args.ragged_max_bytes:
            return (f"CPU lowering is dense-masked: a [{experts}, {rows}, {k}] masked copy of {nbytes / 2**30:.1f} GiB "
                    f"> --ragged-max-bytes {args.ragged_max_bytes / 2**30:.1f} GiB")
    return None


def sampled_reference(lhs_host: np.ndarray, rhs_host: np.ndarray, experts_of_rows: np.ndarray,
                      sample: np.ndarray) -> np.ndarray:
    """The sampled rows' products in float32 numpy, each row through its own expert."""
    return np.stack([lhs_host[r] @ rhs_host[experts_of_rows[r]] for r in sample])


def relative_error(out, reference: np.ndarray, sample: np.ndarray) -> float:
    """max |out - reference| / max |reference| over the sampled rows."""
    got = np.asarray(jnp.asarray(out)[jnp.asarray(sample)], np.float32)
    return float(np.max(np.abs(got - reference)) / max(float(np.max(np.abs(reference))), 1e-30))


def block_rows_pow2(num_rows: int, num_groups: int) -> int:
    """The block rule before the current `grouped_mlp.block_rows_for`: the power of two at or
    above the mean group size, from 8 to 256."""
    mean = max(1, -(-num_rows // num_groups))
    return min(max(1 << (mean - 1).bit_length(), 8), 256)


@contextlib.contextmanager
def block_rule(rule):
    """grouped_mlp's block rule replaced by `rule` while a program is traced."""
    from orca_jax.kernels import grouped_mlp

    saved = grouped_mlp.block_rows_for
    grouped_mlp.block_rows_for = rule
    try:
        yield
    finally:
        grouped_mlp.block_rows_for = saved


def compile_impl(impl: str, lhs, weight, group_sizes):
    """(compiled program of one impl: (lhs, rhs or the dense weight, group_sizes) -> [M, N],
    what its lowering holds). Compiled ahead of time, so that "ragged_dot_triton" is lowered
    under its jax flag (part of jit's cache key) and every timed call runs that program."""
    import re

    from orca_jax.kernels import grouped_mlp

    if impl == "dense":
        fn = jax.jit(lambda lhs, weight, group_sizes: lhs @ weight)
    else:
        inner = "ragged_dot" if impl.startswith("ragged_dot") else "blocked" if impl.startswith("blocked") else impl
        fn = jax.jit(lambda lhs, rhs, group_sizes: grouped_mlp.grouped_matmul(lhs, rhs, group_sizes, inner))
    flag = (jax_flag(TRITON_FLAG, True) if impl == "ragged_dot_triton" else block_rule(block_rows_pow2)
            if impl == "blocked_pow2" else contextlib.nullcontext())
    with flag:
        lowered = fn.lower(lhs, weight, group_sizes)
        compiled = lowered.compile()
    lowering = {}
    if impl.startswith("ragged_dot"):
        hlo = compiled.as_text() or ""
        lowering = {"stablehlo_ragged_dot": "chlo.ragged_dot" in lowered.as_text(),
                    "hlo_ragged_dot": "ragged-dot" in hlo, "hlo_mentions_triton": "triton" in hlo.lower(),
                    "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))}
    return compiled, lowering


def packed_weight(experts: int, K: int, N: int, seed: int):
    """Experts of the same shapes in MXFP4 (orca_jax/kernels/packed4.py): random codes at a scale
    of 2 ** -5 (values up to 0.19), made on the device (packing gpt-oss-120b's 1e9 weights with
    numpy would take the stage's time; the time of a matmul does not depend on the values).
    Returns (PackedWeight, its exact float values [E, K, N] on the host, the *_mxfp4 impls'
    reference)."""
    from orca_jax.kernels import packed4

    blocks = jax.random.randint(jax.random.key(seed), (experts, N, K // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jnp.full((experts, N, K // 32), packed4.E8M0_BIAS - 5, jnp.uint8)
    weight = packed4.PackedWeight(blocks, scales, "mxfp4")
    return weight, np.asarray(weight.stacked(jnp.float32))


def run_matmul(args, backend: str, bandwidth_gbs: float | None, on_row) -> None:
    dtype = jnp.dtype(args.dtype)
    for s_index, shape in enumerate(args.shapes):
        for projection in args.projections:
            K, N = (shape.hidden, shape.intermediate) if projection == "up" else (shape.intermediate, shape.hidden)
            rhs = (jax.random.normal(jax.random.key(1000 + s_index), (shape.experts, K, N), jnp.float32)
                   * K ** -0.5).astype(dtype)
            weights = {"rhs": rhs, "dense": rhs[0], "host": np.asarray(rhs.astype(jnp.float32))}
            if any(impl.endswith("_mxfp4") for impl in args.impls):
                weights["mxfp4"], weights["mxfp4_host"] = packed_weight(shape.experts, K, N, 2000 + s_index)
            for phase, token_counts in (("decode", args.decode_tokens), ("prefill", args.prefill_tokens)):
                for tokens in token_counts:
                    on_row(matmul_row(args, backend, bandwidth_gbs, shape, projection, weights, phase, tokens))
            del rhs, weights


def matmul_row(args, backend: str, bandwidth_gbs: float | None, shape: Shape, projection: str, weights: dict,
               phase: str, tokens: int) -> dict:
    """One row of the matmul part: every impl on the same routing, checked, then timed by turns."""
    from orca_jax.kernels import grouped_mlp

    rhs, rhs_host = weights["rhs"], weights["host"]
    dtype = rhs.dtype
    _, K, N = rhs.shape
    rows = tokens * shape.top_k
    experts_of_rows = random_routing(tokens, shape.experts, shape.top_k, seed=tokens)
    group_sizes_host = np.bincount(experts_of_rows, minlength=shape.experts).astype(np.int32)
    group_sizes = jnp.asarray(group_sizes_host)
    lhs = jax.random.normal(jax.random.key(tokens), (rows, K), jnp.float32).astype(dtype)
    sample = np.random.default_rng(0).choice(rows, size=min(rows, 64), replace=False)
    reference = sampled_reference(np.asarray(lhs.astype(jnp.float32)), rhs_host, experts_of_rows, sample)
    packed_reference = (sampled_reference(np.asarray(lhs.astype(jnp.float32)), weights["mxfp4_host"], experts_of_rows,
                                          sample) if "mxfp4" in weights else None)
    used = int(np.count_nonzero(group_sizes_host))
    flops = 2.0 * rows * K * N
    row = {"part": "matmul", "shape": shape.name, "hidden": shape.hidden, "intermediate": shape.intermediate,
           "experts": shape.experts, "top_k": shape.top_k, "projection": projection, "K": K, "N": N,
           "dtype": str(dtype), "phase": phase, "tokens": tokens, "rows": rows, "experts_used": used,
           "max_group_rows": int(group_sizes_host.max()), "flops": flops,
           "expert_weight_bytes_read": used * K * N * dtype.itemsize, "dense_weight_bytes": K * N * dtype.itemsize,
           "blocked_layout": block_layout(group_sizes_host, grouped_mlp.block_rows_for(rows, shape.experts)),
           "impls": {}}
    if "blocked_pow2" in args.impls:
        row["blocked_pow2_layout"] = block_layout(group_sizes_host, block_rows_pow2(rows, shape.experts))
    fns, first_calls = {}, {}
    for impl in args.impls:
        reason = skip_reason(impl, backend, rows, K, N, shape.experts, dtype.itemsize, args)
        if reason is not None:
            row["impls"][impl] = {"skipped": reason}
            continue
        weight = weights["dense"] if impl == "dense" else weights["mxfp4"] if impl.endswith("_mxfp4") else rhs
        try:  # a lowering that fails on this device is recorded, not fatal
            fn, lowering = compile_impl(impl, lhs, weight, group_sizes)
            start = time.perf_counter()
            out = fn(lhs, weight, group_sizes)
            out.block_until_ready()
            first_calls[impl] = time.perf_counter() - start
        except Exception as failure:  # noqa: BLE001
            row["impls"][impl] = {"skipped": f"failed: {type(failure).__name__}: {str(failure)[:300]}"}
            continue
        if impl != "dense":
            error = relative_error(out, packed_reference if impl.endswith("_mxfp4") else reference, sample)
            row["impls"][impl] = {"max_rel_error": error, **({"lowering": lowering} if lowering else {})}
            if not error <= args.max_error:
                row["impls"][impl]["skipped"] = f"wrong: max relative error {error:.2e} > {args.max_error}"
                del first_calls[impl]
                continue
        del out
        if first_calls[impl] <= args.max_seconds:  # else too slow to repeat: its checked call is its time
            fns[impl] = functools.partial(lambda fn, w: fn(lhs, w, group_sizes).block_until_ready(), fn, weight)
    # The checked call above was each impl's warm-up.
    timings = interleaved_medians(fns, args.repeats, args.max_seconds, warm_up=False)
    timings.update({impl: {"ms": seconds * 1e3, "runs": 1, "first_call_only": True}
                    for impl, seconds in first_calls.items() if impl not in fns})
    for impl in (i for i in args.impls if i in timings):
        timing, entry = timings[impl], row["impls"].setdefault(impl, {})
        entry.update(timing, gflop_per_s=flops / timing["ms"] / 1e6)
        if impl != "dense":
            bytes_read = row["expert_weight_bytes_read"]
            if impl.endswith("_mxfp4"):  # half a byte per weight and a scale byte per 32
                bytes_read = bytes_read / dtype.itemsize * (0.5 + 1 / 32)
            entry["expert_weight_gb_per_s"] = bytes_read / timing["ms"] / 1e6
            if bandwidth_gbs:
                entry["share_of_read_bandwidth"] = entry["expert_weight_gb_per_s"] / bandwidth_gbs
            if "dense" in timings:
                entry["rate_over_dense"] = timings["dense"]["ms"] / timing["ms"]
        if impl.startswith("blocked"):  # its rate on the rows it computes, padding included
            layout = "blocked_pow2_layout" if impl == "blocked_pow2" else "blocked_layout"
            computed = row[layout]["computed_rows"] / rows
            entry["computed_gflop_per_s"] = flops * computed / timing["ms"] / 1e6
    if "blocked" in timings and "ragged_dot" in timings:
        row["ragged_dot_over_blocked"] = timings["blocked"]["ms"] / timings["ragged_dot"]["ms"]
    return row


# ---- part 2: the model step ---------------------------------------------------------------
def moe_config(overrides: dict):
    """The step part's MoE model; its `intermediate_size` (unused by the experts) is its
    active width, k x F, as its dense twin's."""
    from orca_jax.config import ModelConfig

    fields = {**MOE_MODEL, **overrides}
    fields["intermediate_size"] = fields["num_experts_per_tok"] * fields["moe_intermediate_size"]
    return ModelConfig(**fields)


def dense_twin(moe):
    """The dense Qwen3 with the MoE's attention and an MLP as wide as its active experts."""
    return dataclasses.replace(moe, model_type="qwen3", intermediate_size=moe.num_experts_per_tok *
                               moe.moe_intermediate_size, num_experts=0, num_experts_per_tok=0,
                               moe_intermediate_size=0, norm_topk_prob=False)


EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")


def param_counts(params, config) -> dict:
    """Total parameters, the routed experts' share, and the active ones per token: everything
    but the experts, plus k / E of them. Embedding and head counted as the tree holds them."""
    total = expert = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params["params"])[0]:
        keys = [getattr(p, "key", None) for p in path]
        size = int(np.prod(leaf.shape))
        total += size
        if "moe" in keys and keys[-1] in EXPERT_LEAVES:
            expert += size
    active = total - expert
    if config.num_experts:
        active += expert * config.num_experts_per_tok // config.num_experts
    embed = int(np.prod(params["params"]["embed"].shape))
    return {"total": total, "routed_experts": expert, "active": active, "embedding": embed,
            "active_without_embedding": active - embed}


def expected_experts_used(experts: int, top_k: int, tokens: int) -> float:
    """Experts that get at least one of `tokens` tokens when each picks `top_k` of `experts`
    uniformly: E (1 - (1 - k/E)^T)."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def step_case(config, phase: str, tokens: int, context: int, page_size: int):
    """(input_ids, metadata, logits_indices, num_pages) of a decode step (`tokens` sequences of
    one token, each with `context` tokens in the cache counting it) or a prefill (one sequence
    of `tokens` tokens on an empty cache). Every sequence owns its own pages."""
    from orca_jax.kernels.testing import ragged_metadata

    seqs = [(1, context)] * tokens if phase == "decode" else [(tokens, tokens)]
    pages_per_seq = max(-(-kv_len // page_size) for _, kv_len in seqs)
    page_table = (1 + np.arange(len(seqs))[:, None] * pages_per_seq + np.arange(pages_per_seq)).astype(np.int32)
    kv_lens = np.array([kv_len for _, kv_len in seqs], np.int32)
    num_tokens = sum(q_len for q_len, _ in seqs)
    metadata = ragged_metadata(seqs, page_table, kv_lens, page_size=page_size, num_tokens=num_tokens)
    ids = np.random.default_rng(tokens).integers(0, config.vocab_size, num_tokens).astype(np.int32)
    logits_indices = np.asarray(metadata.cu_q_lens[1:] - 1, np.int32)
    return ids, jax.tree.map(jnp.asarray, metadata), jnp.asarray(logits_indices), 1 + len(seqs) * pages_per_seq


def build_model(config, dtype, attention_impl: str):
    """(model, params) of `config`: the tree its init declares (traced, not compiled or run),
    filled with normal(0, 0.02) values, norm scales with ones, as the model's init would."""
    import flax.linen as nn

    from orca_jax.kernels.testing import ragged_metadata
    from orca_jax.models import architecture

    model = architecture(config.model_type).model_class(config, attention_impl, dtype)
    metadata = ragged_metadata([(8, 8)], np.ones((1, 1), np.int32), np.array([8], np.int32), page_size=8,
                               num_tokens=8)
    kv = jax.ShapeDtypeStruct((config.num_layers, 2, 8, 2 * config.num_kv_heads, config.head_dim), dtype)
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros(8, jnp.int32), kv,
                                     jax.tree.map(jnp.asarray, metadata), jnp.array([7], jnp.int32)))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    rng, filled = np.random.default_rng(0), []
    for path, leaf in leaves:
        if getattr(path[-1], "key", None) == "scale":
            value = np.ones(leaf.shape, leaf.dtype)
        else:
            value = (rng.standard_normal(leaf.shape, np.float32) * 0.02).astype(leaf.dtype)
        filled.append(jax.device_put(value))
    return model, jax.tree_util.tree_unflatten(treedef, filled)


def run_step(args, backend: str, on_row, report: dict) -> None:
    from orca_jax import kernels

    dtype = jnp.dtype(args.dtype)
    kv_dtype = jnp.float32 if backend == "cpu" else dtype  # the engine's rule: a float32 cache on CPU
    attention_impl = kernels.resolve_impl("auto")
    moe = moe_config(args.moe_model)
    configs = {"moe": moe, "dense": dense_twin(moe)}
    models = {}
    for name, config in configs.items():
        start = time.perf_counter()
        model, params = build_model(config, dtype, attention_impl)
        jax.block_until_ready(params)
        models[name] = (model, params)
        report["models"][name] = {"config": {k: v for k, v in dataclasses.asdict(config).items()
                                             if v not in (None, (), 0, False) or k in ("num_experts",)},
                                  "params": param_counts(params, config), "init_s": time.perf_counter() - start}
    on_row()
    for phase, token_counts in (("decode", args.step_decode_tokens), ("prefill", args.step_prefill_tokens)):
        for tokens in token_counts:
            ids, metadata, logits_indices, num_pages = step_case(moe, phase, tokens, args.decode_context,
                                                                 args.page_size)
            fns, compile_s = {}, {}
            for name, (model, params) in models.items():
                c = configs[name]
                kv_shape = (c.num_layers, num_pages, args.page_size, 2 * c.num_kv_heads, c.head_dim)
                cache = [jax.random.normal(jax.random.key(7), kv_shape, jnp.float32).astype(kv_dtype)]
                step = jax.jit(model.apply, donate_argnums=2)

                def run(step=step, params=params, cache=cache):
                    logits, cache[0] = step(params, ids, cache[0], metadata, logits_indices)
                    logits.block_until_ready()

                start = time.perf_counter()
                run()
                compile_s[name] = time.perf_counter() - start
                fns[name] = run
            timings = interleaved_medians(fns, args.repeats, args.max_seconds)
            used = expected_experts_used(moe.num_experts, moe.num_experts_per_tok, tokens)
            on_row({"part": "step", "phase": phase, "tokens": tokens,
                    "context": args.decode_context if phase == "decode" else tokens,
                    "dtype": str(dtype), "kv_dtype": str(jnp.dtype(kv_dtype)), "attention_impl": attention_impl,
                    "moe_impl": _moe_impl(backend), "moe_ms": timings["moe"]["ms"],
                    "dense_ms": timings["dense"]["ms"], "moe_over_dense": timings["moe"]["ms"] / timings["dense"]["ms"],
                    "runs": {name: t["runs"] for name, t in timings.items()},
                    # Under uniform routing: experts with a row per layer, and the MoE MLP's
                    # weight bytes per layer over the dense twin's (used x 3DF over 3D x kF).
                    "expected_experts_used": used, "expert_bytes_over_dense_mlp": used / moe.num_experts_per_tok,
                    "first_call_s": compile_s})
            del fns


def _moe_impl(backend: str) -> str:
    from orca_jax.kernels import grouped_mlp

    return grouped_mlp.resolve_impl("auto", backend)


# ---- report -------------------------------------------------------------------------------
def _ms(entry: dict | None) -> str:
    if not entry:
        return "-"
    return "skip" if "ms" not in entry else f"{entry['ms']:.2f}"


def format_tables(rows: list[dict], impls: list[str], models: dict) -> str:
    lines = []
    matmul = [r for r in rows if r["part"] == "matmul"]
    if matmul:
        timed = [i for i in impls if i != "dense" and any("ms" in r["impls"].get(i, {}) for r in matmul)]
        lines += ["grouped matmul (ms; GFLOP/s of 2MKN; rate over dense)",
                  f"{'shape':>14} {'proj':>4} {'phase':>7} {'T':>5} {'M':>6} {'used':>4} {'blk':>4} {'pad':>4} "
                  f"{'dense ms':>9} {'GF/s':>6} "
                  + " ".join(f"{i + ' ms':>14} {'GF/s':>6} {'x dense':>7}" for i in timed)]
        for r in matmul:
            dense = r["impls"].get("dense", {})
            cells = []
            for impl in timed:
                e = r["impls"].get(impl, {})
                cells.append(f"{_ms(e):>14} {e.get('gflop_per_s', 0):6.1f} {e.get('rate_over_dense', 0):7.2f}"
                             if "ms" in e else f"{_ms(e):>14} {'-':>6} {'-':>7}")
            lines.append(f"{r['shape']:>14} {r['projection']:>4} {r['phase']:>7} {r['tokens']:>5} {r['rows']:>6} "
                         f"{r['experts_used']:>4} {r['blocked_layout']['block_rows']:>4} "
                         f"{r['blocked_layout']['computed_rows'] / r['rows']:4.2f} {_ms(dense):>9} "
                         f"{dense.get('gflop_per_s', 0):6.1f} " + " ".join(cells))
    step = [r for r in rows if r["part"] == "step"]
    if step:
        p = {name: m["params"] for name, m in models.items()}
        lines += ["", f"model step (MoE {p['moe']['total'] / 1e6:.1f}M params, {p['moe']['active'] / 1e6:.1f}M active; "
                      f"dense {p['dense']['total'] / 1e6:.1f}M)",
                  f"{'phase':>7} {'tokens':>6} {'ctx':>5} {'moe ms':>9} {'dense ms':>9} {'moe/dense':>9} "
                  f"{'MLP bytes x':>11}"]
        lines += [f"{r['phase']:>7} {r['tokens']:>6} {r['context']:>5} {r['moe_ms']:9.2f} {r['dense_ms']:9.2f} "
                  f"{r['moe_over_dense']:9.2f} {r['expert_bytes_over_dense_mlp']:11.2f}" for r in step]
    return "\n".join(lines)


# ---- arguments ----------------------------------------------------------------------------
# Comma-separated lists of positive integers / of allowed names: cpu_step_bench's parsers.


def _shapes(text: str) -> list[Shape]:
    """Preset names or D:F:E:k, comma-separated."""
    shapes = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        if word in SHAPES:
            shapes.append(SHAPES[word])
            continue
        try:
            D, F, E, k = (int(v) for v in word.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a shape is one of {', '.join(SHAPES)} or D:F:E:k; got {word!r}")
        if min(D, F, E, k) < 1 or k > E:
            raise argparse.ArgumentTypeError(f"shape {word!r}: sizes must be positive and k <= E")
        shapes.append(Shape(word, D, F, E, k))
    if not shapes:
        raise argparse.ArgumentTypeError("no shape given")
    return shapes


def _model_overrides(text: str) -> dict:
    """KEY=INT,... over MOE_MODEL's integer fields (hidden_size=512,num_experts=32,...)."""
    overrides = {}
    for word in (w.strip() for w in text.split(",") if w.strip()):
        key, _, value = word.partition("=")
        settable = sorted(k for k, v in MOE_MODEL.items() if type(v) is int and k != "intermediate_size")
        if key not in settable:
            raise argparse.ArgumentTypeError(f"--moe-model sets {', '.join(settable)}; got {key!r}")
        try:
            overrides[key] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--moe-model {key}: expected an integer, got {value!r}")
    return overrides


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", type=choice_list(PARTS), default=list(PARTS))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--shapes", type=_shapes, default=_shapes("qwen3_a3b_cpu,mixtral_cpu"),
                   help=f"expert shapes: {', '.join(SHAPES)} or D:F:E:k (comma-separated)")
    p.add_argument("--projections", type=choice_list(PROJECTIONS), default=list(PROJECTIONS),
                   help="up: [M, D] x [E, D, F] (gate and up); down: [M, F] x [E, F, D]")
    p.add_argument("--impls", type=choice_list(IMPLS), default=list(DEFAULT_IMPLS),
                   help=f"dense is the same-FLOPs reference; ragged_dot_triton runs on GPUs only; blocked_pow2 is "
                        f"the blocked loop under the previous block rule (default {','.join(DEFAULT_IMPLS)})")
    p.add_argument("--decode-tokens", type=nonempty_sizes, default=[8, 64], help="matmul part: tokens (rows = tokens x k)")
    p.add_argument("--prefill-tokens", type=nonempty_sizes, default=[256, 512])
    p.add_argument("--ragged-max-flops", type=float, default=1e11,
                   help="CPU: skip ragged_dot (dense-masked lowering) past this many executed FLOPs per call")
    p.add_argument("--ragged-max-bytes", type=float, default=2**30,
                   help="CPU: skip ragged_dot past a masked [E, M, K] copy of this many bytes")
    p.add_argument("--max-error", type=float, default=2e-2,
                   help="largest relative error of a grouped matmul against numpy before it is not timed")
    p.add_argument("--moe-model", type=_model_overrides, default={},
                   help="step part: KEY=INT overrides of the MoE model (hidden_size, num_layers, num_experts, "
                        "num_experts_per_tok, moe_intermediate_size, vocab_size, num_heads, num_kv_heads, head_dim)")
    p.add_argument("--step-decode-tokens", type=nonempty_sizes, default=[8, 32], help="step part: decoding sequences")
    p.add_argument("--step-prefill-tokens", type=nonempty_sizes, default=[256, 512], help="step part: prompt tokens")
    p.add_argument("--decode-context", type=int, default=256, help="cached tokens of each decoding sequence")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--max-seconds", type=float, default=5.0,
                   help="stop repeating an impl once its timed runs took this long (at least one run)")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="size of the read-bandwidth array (0: skip)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for name in ("repeats", "page_size", "decode_context"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_seconds <= 0 or args.bandwidth_mib < 0:
        p.error("--max-seconds must be > 0 and --bandwidth-mib >= 0")
    try:
        moe = moe_config(args.moe_model)
    except (TypeError, ValueError) as error:
        p.error(f"--moe-model: {error}")
    if "step" in args.parts and not moe.num_heads % moe.num_kv_heads == 0:
        p.error("--moe-model: num_heads must be a multiple of num_kv_heads")
    return args


def main(argv=None) -> int:
    from orca_jax.bench.environment import load_average, record_header
    from orca_jax.bench.harness import ReportFile

    args = parse_args(argv)
    words = sys.argv[1:] if argv is None else argv
    backend = jax.default_backend()
    settings = {k: ([dataclasses.asdict(s) for s in v] if k == "shapes" else v) for k, v in vars(args).items()}
    command = shlex.join(["python", "benchmarks/moe_bench.py", *words])
    out = ReportFile(args.json, {**record_header("moe_bench", command), "settings": settings, "backend": backend,
                                 "jax_ragged_dot_flags": jax_ragged_dot_flags(), "models": {}, "rows": []})
    report, on_row = out.record, out.add_row
    print(f"moe_bench on {backend} ({jax.devices()[0].device_kind}), jax {jax.__version__}, {args.dtype}", flush=True)

    bandwidth = None
    if args.bandwidth_mib:
        report["read_bandwidth"] = read_bandwidth(args.bandwidth_mib, args.repeats)
        bandwidth = report["read_bandwidth"]["gb_per_s"]
        on_row()
    if "matmul" in args.parts:
        run_matmul(args, backend, bandwidth, on_row)
    if "step" in args.parts:
        run_step(args, backend, on_row, report)
    report["load_average_end"] = load_average()
    on_row()
    print(format_tables(report["rows"], args.impls, report["models"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
