"""The feature check's kernel part: the backend's attention kernel against the float64 oracle.

On ragged batches as the engine builds them (orca_jax.kernels.testing: decodes, prefills and
chunked prefills side by side, every unowned cache slot NaN), in each activation dtype and with
8-bit caches, with a sliding window and a soft cap on one mix and attention sinks on another
(where the kernel takes them). Heads are those of benchmarks/tiny_families.py's models (8 query
over 4 KV heads of 128), so what passes here is what the engine checks run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 8, 4, 128, 16
SM_SCALE = HEAD_DIM ** -0.5
KERNEL_OF_PLATFORM = {"cpu": "cpu", "gpu": "pallas_gpu", "tpu": "pallas_tpu"}
# (mix of orca_jax.kernels.testing.MIXES, sliding window, soft cap, with sinks)
MIXES = (("mixed", None, None, False), ("chunked", 48, 20.0, False), ("decode", None, None, False),
         ("mixed", None, None, True))
# The kernel tests' tolerances (tests/kernels): an 8-bit cache is compared with the oracle of the
# values it holds, so only float32 arithmetic separates them.
TOLERANCES = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3, "int8": 1e-4, "fp8_e4m3": 1e-4}


def unsupported_reason(impl: str, q_dtype, kv_dtype, with_sinks: bool) -> str | None:
    """Why `impl` cannot take these heads, dtypes and options (the engine then runs the reference)."""
    from orca_jax.kernels import ragged_paged_attention_gpu as gpu_kernel
    from orca_jax.kernels import ragged_paged_attention_tpu as tpu_kernel

    if impl == "pallas_gpu":
        return gpu_kernel.unsupported_reason(HEAD_DIM, PAGE_SIZE)
    if impl == "pallas_tpu":
        return tpu_kernel.unsupported_reason(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, q_dtype, kv_dtype,
                                             has_sinks=with_sinks)
    return None


def draw_sinks(seed: int) -> np.ndarray:
    """Sinks about as large as the top scores, so each takes a visible share of its softmax."""
    return np.random.default_rng(seed).uniform(-2.0, 4.0, NUM_Q_HEADS).astype(np.float32)


def kernel_check(dtype_name: str):
    """A check of the accelerator's kernel with queries (and a float cache) in `dtype_name`, or
    float32 queries over an 8-bit cache of that name."""
    from orca_jax.kernels import kv_quant

    quantized = dtype_name in kv_quant.KV_CACHE_DTYPES
    q_dtype = np.float32 if quantized else jnp.dtype(dtype_name)
    kv_dtype = kv_quant.KV_CACHE_DTYPES[dtype_name] if quantized else None

    def check(runs) -> dict:
        from orca_jax.kernels import ragged_paged_attention
        from orca_jax.kernels.testing import MIXES as SEQS, assert_matches_oracle, make_case

        impl = KERNEL_OF_PLATFORM.get(runs.accelerator.platform, "reference")
        errors, skipped = {}, {}
        for seed, (mix, window, cap, with_sinks) in enumerate(MIXES):
            label = f"{mix} w={window} cap={cap} sinks={with_sinks}"
            reason = unsupported_reason(impl, q_dtype, kv_dtype or q_dtype, with_sinks)
            if reason:
                skipped[label] = reason
                continue
            case = make_case(seed, SEQS[mix], num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                             page_size=PAGE_SIZE, dtype=q_dtype, kv_dtype=kv_dtype)
            sinks = draw_sinks(seed) if with_sinks else None
            with jax.default_device(runs.accelerator), jax.default_matmul_precision("highest"):
                out = ragged_paged_attention(jnp.asarray(case.q), jnp.asarray(case.kv_pages),
                                             jax.tree.map(jnp.asarray, case.metadata), sm_scale=SM_SCALE,
                                             sliding_window=window, soft_cap=cap,
                                             sinks=None if sinks is None else jnp.asarray(sinks), impl=impl)
            errors[label] = assert_matches_oracle(out, case, sm_scale=SM_SCALE, sliding_window=window, soft_cap=cap,
                                                  sinks=sinks, tol=TOLERANCES[dtype_name])
        if not errors:
            return {"impl": impl, "skipped": f"{impl} cannot serve these cases: {sorted(set(skipped.values()))}"}
        return {"ok": True, "impl": impl, "max_abs_err": max(errors.values()), "errors": errors,
                "cases_skipped": skipped}

    return check


# (name, what it checks, tolerance, check): see benchmarks/feature_check.py.
KERNEL_CHECKS = [
    (f"kernel_{name}", f"attention kernel vs float64 oracle, {what}", TOLERANCES[name], kernel_check(name))
    for name, what in (("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
                       ("int8", "float32 queries, int8 KV cache"), ("fp8_e4m3", "float32 queries, fp8 KV cache"))
]
