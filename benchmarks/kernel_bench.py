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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few rows only")
    parser.add_argument("--no-tune", action="store_true", help="skip the tuning sweep")
    parser.add_argument("--json", default=None, help="write every number here")
    args = parser.parse_args(argv)
    require_gpu()
    started = time.perf_counter()

    def save() -> None:  # after every stage, so a run stopped by a time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    report = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "device": jax.devices()[0].device_kind,
              "heads": [NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM], "page_size": PAGE_SIZE, "dtype": "bfloat16"}
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
