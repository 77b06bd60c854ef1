"""What a sliding layer's decode step costs at long context (issue 34): it must read only the
pages its window covers, so at an 8k context it should cost about what it costs at its window
length, while a full layer at 8k reads all of it.

    python benchmarks/sliding_window_bench.py --json docs/sliding_window_cpu.json   # ~1 minute on 2 cores
    python benchmarks/sliding_window_bench.py --impl pallas_gpu --dtype bfloat16 --json sliding_window_gpu.json

One attention call (`orca_jax.kernels.ragged_paged_attention`, `--impl`, "auto" by backend) on a
decode step of `--batch` sequences, in three settings run by turns (one run of each per
round, so load on a shared machine falls on all alike):
  - `window_context`: full attention at a context of `--window` tokens (the cost to match),
    in a cache of the same size as the long settings' (an engine's pool does not shrink with
    its contexts; a bfloat16 cache on CPU is copied whole once per call, see
    ragged_paged_attention_cpu's docstring);
  - `sliding_long`: the window traced, as the layer scan of a model mixing sliding and full
    layers passes it, at a context of `--context` tokens;
  - `full_long`: full attention at `--context` tokens (what the window saves).
Reported: the median ms of each over `--repeats` runs after a warm-up, and sliding_long over
window_context (about 1 when only the window's pages are read) and over full_long; and, so that
a fast kernel that skips the wrong pages cannot pass, the largest difference of sliding_long's
output from the reference implementation's on the same inputs, computed in float32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orca_jax import kernels  # noqa: E402
from orca_jax.bench.arguments import positive_int  # noqa: E402
from orca_jax.bench.environment import record_header  # noqa: E402
from orca_jax.bench.harness import write_json  # noqa: E402
from orca_jax.kernels.testing import ragged_metadata  # noqa: E402


def decode_inputs(batch: int, context: int, *, capacity: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  page_size: int, dtype, seed: int = 0):
    """q [batch, N, H], a cache with room for `batch` sequences of `capacity` tokens (as an
    engine's pool is sized once, whatever the contexts in it), holding `batch` sequences of
    `context` tokens, and their metadata."""
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-capacity // page_size)
    num_pages = 1 + batch * pages_per_seq  # page 0: the padding sink
    page_table = (1 + np.arange(batch * pages_per_seq, dtype=np.int32)).reshape(batch, pages_per_seq)
    metadata = ragged_metadata([(1, context)] * batch, page_table, np.full(batch, context, np.int32),
                               page_size=page_size, num_tokens=batch)
    q = jnp.asarray(rng.standard_normal((batch, num_q_heads, head_dim)), dtype)
    kv_pages = jnp.asarray(rng.standard_normal((num_pages, page_size, 2 * num_kv_heads, head_dim)), dtype)
    return q, kv_pages, jax.tree.map(jnp.asarray, metadata)


def time_settings(calls: dict, repeats: int) -> dict[str, float]:
    """Median ms of each call, run by turns after one warm-up (compile) run each."""
    for call in calls.values():
        jax.block_until_ready(call())
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def run(args: argparse.Namespace) -> dict:
    dtype = jnp.dtype(args.dtype)
    impl = kernels.resolve_impl(args.impl)
    shape = dict(capacity=args.context, num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                 head_dim=args.head_dim, page_size=args.page_size, dtype=dtype)
    short = decode_inputs(args.batch, args.window, **shape)
    long = decode_inputs(args.batch, args.context, **shape)
    sm_scale = args.head_dim ** -0.5

    @jax.jit
    def attend(q, kv_pages, metadata, window):
        return kernels.ragged_paged_attention(q, kv_pages, metadata, sm_scale=sm_scale, sliding_window=window,
                                              impl=impl)

    window = jnp.int32(args.window)
    full = jnp.int32(kernels.FULL_ATTENTION_WINDOW)
    medians = time_settings({
        "window_context": lambda: attend(*short, full),
        "sliding_long": lambda: attend(*long, window),
        "full_long": lambda: attend(*long, full),
    }, args.repeats)
    reference = kernels.ragged_paged_attention(long[0].astype(jnp.float32), long[1].astype(jnp.float32), long[2],
                                               sm_scale=sm_scale, sliding_window=args.window, impl="reference")
    error = float(jnp.max(jnp.abs(attend(*long, window).astype(jnp.float32) - reference)))
    command = "python benchmarks/sliding_window_bench.py " + " ".join(sys.argv[1:])
    return {
        **record_header("sliding_window", command.strip()),
        "settings": {**vars(args), "impl": impl},
        "ms": medians,
        "sliding_long_over_window_context": medians["sliding_long"] / medians["window_context"],
        "sliding_long_over_full_long": medians["sliding_long"] / medians["full_long"],
        "sliding_long_max_abs_error_vs_reference": error,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", default="auto", choices=("auto", *kernels.available_impls()))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--window", type=positive_int, default=512)
    parser.add_argument("--context", type=positive_int, default=8192)
    parser.add_argument("--num-q-heads", type=positive_int, default=8)
    parser.add_argument("--num-kv-heads", type=positive_int, default=2)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--page-size", type=positive_int, default=16)
    parser.add_argument("--repeats", type=positive_int, default=21)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    record = run(args)
    ms = record["ms"]
    print(f"{record['settings']['impl']}, batch {args.batch}, window {args.window}, context {args.context}: "
          f"full at {args.window} {ms['window_context']:.3f} ms, sliding at {args.context} {ms['sliding_long']:.3f} ms "
          f"({record['sliding_long_over_window_context']:.2f}x), full at {args.context} {ms['full_long']:.3f} ms "
          f"(sliding {record['sliding_long_over_full_long']:.2f}x of it); max |error| vs the reference "
          f"{record['sliding_long_max_abs_error_vs_reference']:.2e}")
    write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
