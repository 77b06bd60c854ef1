"""Ragged paged attention on one GPU: the Pallas kernel against the XLA reference and jax's
decode-only Pallas paged attention, with achieved HBM bandwidth against a measured copy.

    python benchmarks/kernel_bench.py                 # the full table, ~3-5 minutes on an H200
    python benchmarks/kernel_bench.py --quick         # a few rows, for a smoke run
    python benchmarks/kernel_bench.py --json kernel_bench.json

Heads are Llama-3-8B's (32 query / 8 KV heads, head_dim 128), bfloat16, page size 16, pages of
every sequence scattered at random over the pool as a long-running server leaves them.

1. Correctness on the GPU first: the kernel against the float64 oracle
   (orca_jax.kernels.testing) on ragged batches, float32 and bfloat16. A wrong kernel is not
   timed.
2. Copy bandwidth: a device-to-device copy of 4 GiB (bytes read + written per second), the
   ceiling a memory-bound kernel is measured against.
3. Decode-heavy steps (64..256 sequences of one token, contexts 1k..8k) and mixed steps (a few
   512-token prefill chunks with 128 decodes): median time of the kernel, the reference, and on
   decode-only rows jax's `pallas.ops.gpu.paged_attention` (on its own [K, P, page, D] layout,
   converted once outside the timing). Bytes that must move = K/V of every sequence's context +
   queries + outputs; achieved bandwidth = bytes / kernel time.
4. A small tuning sweep (rows per program, KV block, warps) on one decode and one mixed shape.
Targets (issue 3): >= 70% of copy bandwidth on decode-heavy steps, >= 5x the reference.

Without a GPU it exits with status 2 and says so: the numbers only mean something on one.

`--cpu` measures the CPU path instead (issue 14), on any machine, on SmolLM2-135M's heads (9
query / 3 KV heads, head_dim 64), page size 16, float32 (`--dtype bfloat16` for a bfloat16
cache and queries):

    python benchmarks/kernel_bench.py --cpu --json cpu_kernel_bench.json     # ~1.5-4 minutes on 2 cores
    python benchmarks/kernel_bench.py --cpu --cases spec --json spec.json    # speculation's rows, ~1 minute

1. Correctness first: the CPU kernel (`kernels/ragged_paged_attention_cpu.py`) against the
   float64 oracle on ragged batches, and against the reference on every benchmark shape.
2. Read bandwidth: a column sum over a 1 GiB array (a matrix-vector product reads no faster
   under XLA:CPU), the ceiling a decode is measured against.
3. Decode steps at batch 1/16/64 x context 256/2048 and single prefills of 128/512 tokens:
   the CPU kernel and the reference, median of a few runs. Every call reads the next layer's
   cache of a pool of 1 GB or 32 layers, whichever is smaller, as a 30-layer step reads each
   layer once: a large step's cache comes from memory, a small one's from the last-level
   cache, as in the engine. Effective read bandwidth = K+V bytes of the visited context / time.
Target (issue 14): decode at context 2048 reads the cache at >= 60% of the read bandwidth.
`--cases spec` (or `issue14,spec`) times what speculative decoding asks of attention instead:
rows verifying drafts (4 or 6 query tokens: k = 3 or 5 drafts after the row's last token) against
decode rows of one token, at context 400 (the copy workload of `orca-jax bench spec`), batch 1
and 16, and the 16-row step of 8 verifying and 8 decoding rows (40 query tokens).
With `--dtype bfloat16` both implementations pay for a pass over the whole pool per call
(XLA:CPU widens or copies a bfloat16 cache before gathering from it; see the CPU kernel's
docstring), so that run takes several minutes and measures the pool size as much as the step.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
DTYPE = jnp.bfloat16


def require_gpu() -> None:
    if jax.default_backend() != "gpu":
        print(f"kernel_bench: needs a GPU; JAX sees {jax.devices()} (install jax[cuda13] on a GPU machine)",
              file=sys.stderr)
        sys.exit(2)


def median_ms(fn, *args, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn(*args) in ms, each run waited for (after warm-up runs)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def copy_bandwidth_gbs(num_bytes: int = 4 << 30) -> float:
    """Bytes read + written per second by a plain elementwise pass over a large array."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    bump = jax.jit(lambda a: a + 1.0)  # one read and one write of every byte
    return 2 * num_bytes / (median_ms(bump, x) * 1e-3) / 1e9


# ------------------------------------------------------------------------------------------
# Batches
# ------------------------------------------------------------------------------------------

def make_step(seqs: list[tuple[int, int]], seed: int = 0, num_seq_slots: int | None = None):
    """A step of sequences [(q_len, kv_len)] on a random-page cache: the attention arguments
    (q, kv_pages, AttentionMetadata) on the device, and the bytes attention must move."""
    from orca_jax.kernels.testing import ragged_metadata

    rng = np.random.default_rng(seed)
    pages_needed = [-(-kv // PAGE_SIZE) for _, kv in seqs]
    num_pages = 1 + sum(pages_needed)
    max_pages = max(pages_needed)
    S = num_seq_slots or len(seqs)
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    page_table = np.zeros((S, max_pages), np.int32)
    offset = 0
    for s, n in enumerate(pages_needed):
        page_table[s, :n] = perm[offset: offset + n]
        offset += n
    kv_lens = np.zeros(S, np.int32)
    kv_lens[: len(seqs)] = [kv for _, kv in seqs]
    T = sum(q for q, _ in seqs)
    metadata = ragged_metadata(seqs, page_table, kv_lens, page_size=PAGE_SIZE, num_tokens=T)
    key = jax.random.key(seed)
    q = jax.random.normal(key, (T, NUM_Q_HEADS, HEAD_DIM), DTYPE)
    kv_pages = jax.random.normal(jax.random.fold_in(key, 1), (num_pages, PAGE_SIZE, 2 * NUM_KV_HEADS, HEAD_DIM), DTYPE)
    itemsize = jnp.dtype(DTYPE).itemsize
    kv_bytes = sum(kv for _, kv in seqs) * 2 * NUM_KV_HEADS * HEAD_DIM * itemsize
    qo_bytes = 2 * T * NUM_Q_HEADS * HEAD_DIM * itemsize
    return (q, kv_pages, jax.tree.map(jnp.asarray, metadata)), kv_bytes + qo_bytes


def decode_cases(quick: bool):
    batches, contexts = ((64, 256), (1024, 8192)) if quick else ((64, 128, 256), (1024, 2048, 4096, 8192))
    for b in batches:
        for ctx in contexts:
            yield f"decode b={b} ctx={ctx}", [(1, ctx)] * b, True


def mixed_cases(quick: bool):
    for chunks in ((2,) if quick else (1, 2, 4)):
        for ctx in ((2048,) if quick else (1024, 4096)):
            # Prefill chunks of 512 continuing a cached prefix of 512, next to 128 decodes.
            yield f"mixed {chunks}x512 + 128 dec ctx={ctx}", [(512, 1024)] * chunks + [(1, ctx)] * 128, False


# ------------------------------------------------------------------------------------------
# Implementations
# ------------------------------------------------------------------------------------------

def pallas_fn(**kernel_kw):
    from orca_jax.kernels import ragged_paged_attention_gpu as gpu
    return jax.jit(functools.partial(gpu.ragged_paged_attention, sm_scale=HEAD_DIM ** -0.5, **kernel_kw))


def reference_fn():
    from orca_jax.kernels import reference
    return jax.jit(functools.partial(reference.ragged_paged_attention, sm_scale=HEAD_DIM ** -0.5))


def jax_paged_attention_args(arrays):
    """jax's decode kernel wants K and V as [K, P, page, D] and one query per sequence."""
    q, kv_pages, metadata = arrays
    k = jnp.transpose(kv_pages[:, :, 0::2], (2, 0, 1, 3))
    v = jnp.transpose(kv_pages[:, :, 1::2], (2, 0, 1, 3))
    return q, k, v, metadata.page_table, metadata.kv_lens


def jax_paged_attention_fn(pages_per_seq: int):
    from jax.experimental.pallas.ops.gpu import paged_attention as pa
    k_splits = next(s for s in (16, 8, 4, 2, 1) if pages_per_seq % s == 0)
    return jax.jit(functools.partial(pa.paged_attention, pages_per_compute_block=8 if pages_per_seq // k_splits >= 8 else 1,
                                     k_splits=k_splits))


# ------------------------------------------------------------------------------------------
# Steps of the benchmark
# ------------------------------------------------------------------------------------------

def check_correctness() -> dict:
    from orca_jax.kernels import ragged_paged_attention_gpu as gpu
    from orca_jax.kernels.testing import MIXES, assert_matches_oracle, make_case

    errors = {}
    for dtype, tol in ((np.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        for mix, window, cap in (("mixed", None, None), ("chunked", 48, 20.0), ("decode", None, None)):
            case = make_case(5, MIXES[mix], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=dtype)
            q, kv_pages = jnp.asarray(case.q), jnp.asarray(case.kv_pages)
            metadata = jax.tree.map(jnp.asarray, case.metadata)
            for splits in (1, 4):
                with jax.default_matmul_precision("highest"):
                    out = gpu.ragged_paged_attention(q, kv_pages, metadata, sm_scale=0.125,
                                                     sliding_window=window, soft_cap=cap, num_kv_splits=splits)
                err = assert_matches_oracle(out, case, sm_scale=0.125, sliding_window=window, soft_cap=cap, tol=tol)
                errors[f"{jnp.dtype(dtype).name} {mix} w={window} cap={cap} splits={splits}"] = err
    return errors


def time_case(name, seqs, decode_only, copy_gbs, pallas, reference) -> dict:
    arrays, moved = make_step(seqs)
    row = {"case": name, "bytes_moved": moved}
    row["pallas_ms"] = median_ms(pallas, *arrays)
    row["pallas_gbs"] = moved / (row["pallas_ms"] * 1e-3) / 1e9
    row["pallas_share_of_copy"] = row["pallas_gbs"] / copy_gbs
    row["reference_ms"] = median_ms(reference, *arrays, repeats=5, warmup=1)
    row["speedup_vs_reference"] = row["reference_ms"] / row["pallas_ms"]
    if decode_only:
        jax_args = jax_paged_attention_args(arrays)
        pages_per_seq = arrays[2].page_table.shape[1]
        row["jax_paged_attention_ms"] = median_ms(jax_paged_attention_fn(pages_per_seq), *jax_args)
    del arrays
    return row


def tune(copy_gbs: float, quick: bool) -> list[dict]:
    """A small grid over the kernel's static knobs on one decode and one mixed shape."""
    # block_rows trades wasted rows on decodes (group real rows of block_rows) against
    # re-reading a prefix once per query block on prefill chunks.
    grid = [dict(block_rows=rows, kv_block_tokens=kb, num_warps=w, num_stages=2)
            for rows in (16, 64) for kb in ((64,) if quick else (32, 64, 128)) for w in (4, 8)]
    rows = []
    for name, seqs in (("decode b=128 ctx=4096", [(1, 4096)] * 128),
                       ("mixed 2x512 + 128 dec ctx=2048", [(512, 1024)] * 2 + [(1, 2048)] * 128)):
        arrays, moved = make_step(seqs, seed=1)
        for knobs in grid:
            ms = median_ms(pallas_fn(**knobs), *arrays, repeats=10)
            rows.append({"case": name, **knobs, "ms": ms, "share_of_copy": moved / (ms * 1e-3) / 1e9 / copy_gbs})
        del arrays
    return rows


def print_table(rows: list[dict], columns: list[str]) -> None:
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(f"{row[c]:.3g}" if isinstance(row.get(c), float) else str(row.get(c, "-")) for c in columns))


# ------------------------------------------------------------------------------------------
# The CPU case (--cpu)
# ------------------------------------------------------------------------------------------

CPU_HEADS = (9, 3, 64)  # SmolLM2-135M: query heads, KV heads, head_dim
CPU_POOL_BYTES = 1 << 30  # each timed call reads the next layer's pages of a pool this large (<= 32 layers)


def cpu_read_bandwidth_gbs(num_bytes: int = 1 << 30) -> float:
    """Bytes read per second by a column sum over a large float32 array."""
    x = jnp.ones((num_bytes // 4096, 1024), jnp.float32)
    column_sum = jax.jit(lambda a: a.sum(axis=0))
    return num_bytes / (median_ms(column_sum, x, repeats=7, warmup=2) * 1e-3) / 1e9


def make_cpu_layers(seqs: list[tuple[int, int]], dtype, seed: int = 0):
    """A step of sequences [(q_len, kv_len)] over as many layers as fill CPU_POOL_BYTES (2 to
    32): queries, one page pool, one AttentionMetadata per layer (each layer's pages a random
    permutation of its own range), and the K+V bytes one call reads."""
    from orca_jax.kernels.testing import ragged_metadata

    num_q_heads, num_kv_heads, head_dim = CPU_HEADS
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = sum(kv for _, kv in seqs) * 2 * num_kv_heads * head_dim * itemsize
    pages_needed = [-(-kv // PAGE_SIZE) for _, kv in seqs]
    per_layer = sum(pages_needed)
    page_bytes = PAGE_SIZE * 2 * num_kv_heads * head_dim * itemsize
    num_layers = max(2, min(32, CPU_POOL_BYTES // (per_layer * page_bytes)))
    rng = np.random.default_rng(seed)
    T = sum(q for q, _ in seqs)
    metadatas = []
    for layer in range(num_layers):
        perm = rng.permutation(np.arange(1 + layer * per_layer, 1 + (layer + 1) * per_layer)).astype(np.int32)
        page_table = np.zeros((len(seqs), max(pages_needed)), np.int32)
        offset = 0
        for s, n in enumerate(pages_needed):
            page_table[s, :n] = perm[offset: offset + n]
            offset += n
        kv_lens = np.array([kv for _, kv in seqs], np.int32)
        metadatas.append(jax.tree.map(jnp.asarray, ragged_metadata(seqs, page_table, kv_lens, page_size=PAGE_SIZE,
                                                                    num_tokens=T)))
    key = jax.random.key(seed)
    q = jax.random.normal(key, (T, num_q_heads, head_dim), dtype)
    kv_pages = jax.random.normal(jax.random.fold_in(key, 1),
                                 (1 + num_layers * per_layer, PAGE_SIZE, 2 * num_kv_heads, head_dim), dtype)
    return q, kv_pages, metadatas, kv_bytes


def ms_over_layers(fn, q, kv_pages, metadatas, repeats: int) -> float:
    """Median over `repeats` sweeps of the mean time of one call, each call on the next layer
    (after one warm-up call)."""
    jax.block_until_ready(fn(q, kv_pages, metadatas[0]))
    sweeps = []
    for _ in range(repeats):
        start = time.perf_counter()
        for metadata in metadatas:
            jax.block_until_ready(fn(q, kv_pages, metadata))
        sweeps.append((time.perf_counter() - start) / len(metadatas))
    return float(np.median(sweeps) * 1e3)


def cpu_cases(quick: bool):
    for batch in ((16,) if quick else (1, 16, 64)):
        for ctx in ((2048,) if quick else (256, 2048)):
            yield f"decode b={batch} ctx={ctx}", [(1, ctx)] * batch
    for tokens in ((128,) if quick else (128, 512)):
        yield f"prefill {tokens}", [(tokens, tokens)]


SPEC_CONTEXT = 400  # cached tokens of a copy-workload request of `bench spec` (357 prompt + outputs)


def spec_cases(quick: bool):
    """Speculation's attention rows: (name, [(q_len, kv_len)]); a verification row's q_len is
    1 + k (its last token, then k drafts), causal over the last q_len of its kv_len tokens."""
    ctx = SPEC_CONTEXT
    for batch in ((16,) if quick else (1, 16)):
        yield f"decode b={batch} ctx={ctx}", [(1, ctx)] * batch
        for q in ((4,) if quick else (4, 6)):
            yield f"verify q={q} b={batch} ctx={ctx}", [(q, ctx)] * batch
    yield f"verify q=4 b=8 + decode b=8 ctx={ctx}", [(4, ctx)] * 8 + [(1, ctx)] * 8


CASE_SETS = {"issue14": "cpu_cases", "spec": "spec_cases"}  # looked up when run (tests replace them)


def check_cpu_correctness(dtype) -> dict:
    from orca_jax.kernels import ragged_paged_attention_cpu as cpu
    from orca_jax.kernels.testing import MIXES, assert_matches_oracle, make_case

    errors, tol = {}, (1e-5 if dtype == jnp.float32 else 2e-2)
    num_q_heads, num_kv_heads, head_dim = CPU_HEADS
    for mix, window, cap in (("mixed", None, None), ("chunked", 48, 20.0), ("decode", None, None)):
        case = make_case(5, MIXES[mix], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         page_size=PAGE_SIZE, dtype=dtype)
        out = cpu.ragged_paged_attention(case.q, case.kv_pages, case.metadata, sm_scale=head_dim ** -0.5,
                                         sliding_window=window, soft_cap=cap)
        errors[f"{mix} w={window} cap={cap}"] = assert_matches_oracle(
            out, case, sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap, tol=tol)
    return errors


def time_cpu_case(name, seqs, dtype, read_gbs, repeats) -> dict:
    from orca_jax.kernels import ragged_paged_attention_cpu as cpu
    from orca_jax.kernels import reference

    sm_scale = CPU_HEADS[2] ** -0.5
    impls = {"cpu": functools.partial(cpu.ragged_paged_attention, sm_scale=sm_scale),
             "reference": functools.partial(reference.ragged_paged_attention, sm_scale=sm_scale)}
    q, kv_pages, metadatas, kv_bytes = make_cpu_layers(seqs, dtype)
    outs = {k: np.asarray(fn(q, kv_pages, metadatas[0]), np.float32) for k, fn in impls.items()}
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(outs["cpu"], outs["reference"], rtol=tol, atol=tol,
                               err_msg=f"{name}: the CPU kernel disagrees with the reference")
    row = {"case": name, "kv_bytes": kv_bytes, "layers": len(metadatas)}
    # Sweeps alternate between the implementations, so that load from other processes falls on both.
    sweeps = {k: [] for k in impls}
    for _ in range(repeats):
        for k, fn in impls.items():
            sweeps[k].append(ms_over_layers(fn, q, kv_pages, metadatas, repeats=1))
    for k in impls:
        row[f"{k}_ms"] = ms = float(np.median(sweeps[k]))
        row[f"{k}_gbs"] = kv_bytes / (ms * 1e-3) / 1e9
        row[f"{k}_share_of_read"] = row[f"{k}_gbs"] / read_gbs
    row["speedup_vs_reference"] = row["reference_ms"] / row["cpu_ms"]
    if name.startswith("prefill"):
        tokens = seqs[0][0]
        # QK^T and PV over the causal triangle: 2 products x 2 FLOPs per multiply-add.
        flops = 4 * CPU_HEADS[0] * CPU_HEADS[2] * tokens * (tokens + 1) / 2
        row["cpu_gflops"] = flops / (row["cpu_ms"] * 1e-3) / 1e9
        row["reference_gflops"] = flops / (row["reference_ms"] * 1e-3) / 1e9
    del q, kv_pages
    return row


def run_cpu(args) -> int:

    from orca_jax.bench.environment import load_average, record_header
    from orca_jax.bench.harness import ReportFile

    dtype = jnp.dtype(args.dtype)
    started = time.perf_counter()
    out = ReportFile(args.json, {**record_header("kernel_bench_cpu", args.command), "backend": jax.default_backend(),
                                 "heads": list(CPU_HEADS), "page_size": PAGE_SIZE, "dtype": dtype.name})
    report, save = out.record, out.save

    report["correctness_max_abs_err"] = check_cpu_correctness(dtype)
    print("correctness vs float64 oracle (max abs err):", json.dumps(report["correctness_max_abs_err"]), flush=True)
    report["read_gbs"] = cpu_read_bandwidth_gbs()
    print(f"read bandwidth (column sum of 1 GiB): {report['read_gbs']:.1f} GB/s", flush=True)
    rows = []
    report["cases_sets"] = list(args.cases)
    cases = [case for name in args.cases for case in globals()[CASE_SETS[name]](args.quick)]
    for name, seqs in cases:
        rows.append(time_cpu_case(name, seqs, dtype, report["read_gbs"], repeats=3 if args.quick else 5))
        print(json.dumps(rows[-1]), flush=True)
        report["cases"] = rows
        save()
    print_table(rows, ["case", "cpu_ms", "cpu_gbs", "cpu_share_of_read", "reference_ms", "reference_gbs",
                       "speedup_vs_reference"])
    long_decodes = [r for r in rows if r["case"].startswith("decode") and r["case"].endswith("ctx=2048")]
    if long_decodes:
        report["targets"] = {"decode_ctx2048_min_share_of_read": min(r["cpu_share_of_read"] for r in long_decodes)}
        print("target (>= 0.60 of read bandwidth at context 2048):", json.dumps(report["targets"]))
    report["wall_s"] = time.perf_counter() - started
    report["load_average_end"] = load_average()
    save()
    return 0


def _case_sets(text: str) -> list[str]:
    names = [t for t in text.split(",") if t]
    unknown = [n for n in names if n not in CASE_SETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--cases: among {', '.join(CASE_SETS)}, got {text!r}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few rows only")
    parser.add_argument("--no-tune", action="store_true", help="skip the tuning sweep")
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--cpu", action="store_true", help="measure the CPU kernel against the reference instead")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="cache and query dtype of the --cpu case")
    parser.add_argument("--cases", default=["issue14"], type=_case_sets,
                        help="--cpu: comma-separated among issue14 (decode at batch 1/16/64 x context 256/2048, "
                             "prefill 128/512; the default) and spec (verification rows of 4 and 6 query tokens "
                             "against decode rows at context 400)")
    args = parser.parse_args(argv)
    args.command = " ".join(["python", "benchmarks/kernel_bench.py", *(sys.argv[1:] if argv is None else argv)])
    if args.cpu:
        return run_cpu(args)
    require_gpu()
    from orca_jax.bench.environment import record_header
    from orca_jax.bench.harness import ReportFile

    started = time.perf_counter()
    # Saved after every stage, so a run stopped by the GPU session's time limit keeps what it measured.
    out = ReportFile(args.json, {**record_header("kernel_bench", args.command),
                                 "device": jax.devices()[0].device_kind,
                                 "heads": [NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM], "page_size": PAGE_SIZE,
                                 "dtype": "bfloat16"})
    report, save = out.record, out.save
    report["correctness_max_abs_err"] = check_correctness()
    print("correctness vs float64 oracle (max abs err):", json.dumps(report["correctness_max_abs_err"], indent=1))
    save()
    report["copy_gbs"] = copy_bandwidth_gbs()
    print(f"device-to-device copy: {report['copy_gbs']:.0f} GB/s (read + write)", flush=True)

    pallas, reference = pallas_fn(), reference_fn()
    rows = []
    for name, seqs, decode_only in [*decode_cases(args.quick), *mixed_cases(args.quick)]:
        rows.append(time_case(name, seqs, decode_only, report["copy_gbs"], pallas, reference))
        print(json.dumps(rows[-1]), flush=True)
        report["cases"] = rows
        save()
    print_table(rows, ["case", "pallas_ms", "pallas_gbs", "pallas_share_of_copy", "reference_ms",
                       "speedup_vs_reference", "jax_paged_attention_ms"])
    decode_rows = [r for r in rows if r["case"].startswith("decode")]
    report["targets"] = {
        "decode_min_share_of_copy": min(r["pallas_share_of_copy"] for r in decode_rows),
        "decode_median_share_of_copy": float(np.median([r["pallas_share_of_copy"] for r in decode_rows])),
        "min_speedup_vs_reference": min(r["speedup_vs_reference"] for r in rows),
    }
    save()
    if not args.no_tune:
        report["tuning"] = tune(report["copy_gbs"], args.quick)
        print_table(report["tuning"], ["case", "block_rows", "kv_block_tokens", "num_warps", "ms", "share_of_copy"])
    report["wall_s"] = time.perf_counter() - started
    print("targets (>= 0.70 of copy on decode, >= 5x reference):", json.dumps(report["targets"]))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
