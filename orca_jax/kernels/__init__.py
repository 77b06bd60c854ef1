"""The one attention entry point. Implementations share the signature of
`reference.ragged_paged_attention`, `(q, kv_pages, metadata, *, sm_scale, sliding_window,
soft_cap, sinks, <their own options>)`, where `metadata` is the step's `AttentionMetadata` whole;
`impl` picks one, and "auto" picks by backend:

    impl           runs on                    notes
    "reference"    any backend                pure jnp; the oracle the kernels are tested against
    "cpu"          CPUs ("auto" there)        pure jnp laid out for XLA:CPU (vector gathers of
                                              [K_h | V_h] rows, large decode blocks); runs on any
                                              backend, but is built for XLA:CPU
    "pallas_gpu"   NVIDIA GPUs                Triton-lowered Pallas kernel; on other backends
                                              it runs in Pallas' interpreter (tests)
    "pallas_tpu"   TPUs                       jax's own ragged paged attention kernel

The engine resolves `impl` once at start-up (`resolve_impl`) and logs the choice, so a
jitted step never dispatches on anything but a static string. A kernel that cannot take a
model's shapes (say head_dim 80) hands that model to the reference, saying why once.
"""

from __future__ import annotations

import functools
import logging

import jax

from orca_jax.kernels import ragged_paged_attention_cpu as cpu_kernel
from orca_jax.kernels import ragged_paged_attention_gpu as gpu_kernel
from orca_jax.kernels import ragged_paged_attention_tpu as tpu_kernel
from orca_jax.kernels import reference
from orca_jax.kernels.lowering_target import target_backend
from orca_jax.kernels.metadata import AttentionMetadata
from orca_jax.kernels.reference import write_kv

logger = logging.getLogger(__name__)

__all__ = ["AttentionMetadata", "ragged_paged_attention", "write_kv", "resolve_impl", "available_impls",
           "FULL_ATTENTION_WINDOW"]

# The window a full-attention layer passes where the model's layers carry their windows as data
# (sliding and full layers in one scan): wider than any context, small enough that positions
# minus it stay in int32.
FULL_ATTENTION_WINDOW = 1 << 30

# The backend each kernel is built for; "auto" picks the kernel of the running backend.
_KERNEL_FOR_BACKEND = {"cpu": "cpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}


@functools.lru_cache(maxsize=None)
def _log_fallback_once(impl: str, reason: str) -> None:
    logger.warning("attention: %s cannot serve this model (%s); using the reference", impl, reason)


def _pallas_gpu(q, kv_pages, metadata, **kwargs):
    # Off a GPU the same kernel runs in Pallas' interpreter (tests).
    return gpu_kernel.ragged_paged_attention(q, kv_pages, metadata, interpret=target_backend() != "gpu",
                                             **kwargs)


_IMPLS = {
    "reference": reference.ragged_paged_attention,
    "cpu": cpu_kernel.ragged_paged_attention,
    "pallas_gpu": _pallas_gpu,
    "pallas_tpu": tpu_kernel.ragged_paged_attention,
}
# Why a kernel cannot take these arrays and options (None: it can), from static shapes, dtypes
# and whether the window is traced or the sinks given: never from values.
_UNSUPPORTED_REASON = {
    "pallas_gpu": lambda q, kv_pages, sliding_window, sinks: gpu_kernel.unsupported_reason(
        q.shape[-1], kv_pages.shape[1]),
    "pallas_tpu": lambda q, kv_pages, sliding_window, sinks: tpu_kernel.unsupported_reason(
        q.shape[1], kv_pages.shape[2] // 2, q.shape[-1], q.dtype, kv_pages.dtype,
        traced_window=isinstance(sliding_window, jax.Array), has_sinks=sinks is not None),
}


def available_impls() -> tuple[str, ...]:
    return tuple(_IMPLS)


def resolve_impl(impl: str = "auto", backend: str | None = None) -> str:
    """Turn "auto" into a concrete implementation for `backend` (default: JAX's), check that
    the choice can run there, and log it."""
    backend = backend or jax.default_backend()
    if impl == "auto":
        impl = _KERNEL_FOR_BACKEND.get(backend, "reference")
    if impl not in _IMPLS:
        raise ValueError(f"attention implementation {impl!r} is not available; choose from {available_impls()}")
    if impl == "pallas_tpu" and backend != "tpu":
        raise ValueError(f"attention_impl='pallas_tpu' runs only on TPU (this backend is {backend}); "
                         "use 'auto' or 'reference'")
    if impl == "pallas_gpu" and backend not in ("gpu", "cuda"):
        logger.warning("attention: the Pallas GPU kernel runs in interpret mode on %s: correct but slow, "
                       "meant for tests", backend)
    logger.info("attention implementation: %s (backend %s)", impl, backend)
    return impl


def ragged_paged_attention(q, kv_pages, metadata: AttentionMetadata, *,
                           sm_scale, sliding_window=None, soft_cap=None, sinks=None, impl="auto"):
    """Attention of the flattened queries of a ragged batch against the paged KV cache.

    q [T, num_q_heads, head_dim]; kv_pages [num_pages, page_size, 2 * num_kv_heads, head_dim]
    (K at even, V at odd head slots); metadata: the step's AttentionMetadata, of which
    attention reads kv_lens int32[S], page_table int32[S, max_pages_per_seq],
    cu_q_lens int32[S + 1] and num_seqs int32[1]. `soft_cap` (None: off) caps every score at
    `soft_cap * tanh(score / soft_cap)` before the softmax. `sliding_window`: None (full
    attention), an int, or a traced int32 scalar (each layer's own window inside the model's
    scan; a full layer of a mixed model passes one larger than any context). `sinks`
    f32[num_q_heads] (None: none): a learned logit per head joining each softmax's denominator
    (gpt-oss). Returns [T, num_q_heads, head_dim].
    """
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"attention takes the step's AttentionMetadata whole, got {type(metadata).__name__}")
    if impl == "auto":
        impl = resolve_impl(impl)
    if impl not in _IMPLS:
        raise ValueError(f"attention implementation {impl!r} is not available; choose from {available_impls()}")
    reason = (_UNSUPPORTED_REASON[impl](q, kv_pages, sliding_window, sinks) if impl in _UNSUPPORTED_REASON
              else None)
    if reason is not None:
        _log_fallback_once(impl, reason)
        impl = "reference"
    return _IMPLS[impl](q, kv_pages, metadata, sm_scale=sm_scale, sliding_window=sliding_window,
                        soft_cap=soft_cap, sinks=sinks)
