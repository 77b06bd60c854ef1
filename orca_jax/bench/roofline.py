"""The compute roofline of an offline run: a measured matmul rate over the FLOPs of the
workload's useful tokens. It says how far from the machine's limit every system is."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from orca_jax.bench.trace import Trace


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


def workload_flops(trace: Trace, model_config, params: dict[str, int]) -> dict[str, float]:
    """FLOPs of the useful work, each request's prompt + output tokens processed once:

    * linear layers: 2 * layer matmul params per processed token;
    * LM head: 2 * vocab * hidden per output token (logits are needed only there);
    * attention scores and values: 4 * num_heads * head_dim per (query, key) pair, causal, so a
      token at position t (1-based) reads t keys.

    Norms, RoPE, activations and sampling are not counted (a few percent at most)."""
    c = model_config
    processed = trace.useful_processed_tokens
    pairs = sum(n * (n + 1) // 2 for n in (i + o for i, o in zip(trace.input_lens, trace.output_lens)))
    linear = 2.0 * params["layer_matmul"] * processed
    head = 2.0 * params["lm_head"] * trace.useful_output_tokens
    attention = 4.0 * c.num_layers * c.num_heads * c.head_dim * pairs
    return {"linear": linear, "lm_head": head, "attention": attention, "total": linear + head + attention}


def roofline(trace: Trace, flops: dict[str, float], rate: float, param_counts: dict[str, int]) -> dict[str, float]:
    ideal_s = flops["total"] / rate
    per_token = rate / (2.0 * param_counts["matmul_without_embedding_lookup"])
    return {
        "flop_per_s": rate,
        # The simple form: every processed token costs 2 * (params without the embedding lookup).
        "simple_processed_tokens_per_s": per_token,
        "simple_useful_output_tokens_per_s": per_token * trace.useful_output_tokens / trace.useful_processed_tokens,
        "ideal_seconds": ideal_s,
        "useful_output_tokens_per_s": trace.useful_output_tokens / ideal_s,
        "processed_tokens_per_s": trace.useful_processed_tokens / ideal_s,
    }
