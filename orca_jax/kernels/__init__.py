"""The one attention entry point. Implementations share the signature of
`reference.ragged_paged_attention`; `impl` picks one, and "auto" picks by backend.

The engine resolves `impl` once at start-up (`resolve_impl`) and logs the choice, so a
jitted step never dispatches on anything but a static string.
"""

from __future__ import annotations

import logging

import jax

from orca_jax.kernels import reference
from orca_jax.kernels.reference import write_kv

logger = logging.getLogger(__name__)

__all__ = ["ragged_paged_attention", "write_kv", "resolve_impl", "available_impls"]

# Implementations registered here. The Pallas kernels (GPU, TPU) plug in under their names.
_IMPLS = {"reference": reference.ragged_paged_attention}


def available_impls() -> tuple[str, ...]:
    return tuple(_IMPLS)


def resolve_impl(impl: str = "auto", backend: str | None = None) -> str:
    """Turn "auto" into a concrete implementation name for `backend` (default: JAX's)."""
    backend = backend or jax.default_backend()
    if impl == "auto":
        preferred = {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend, "reference")
        impl = preferred if preferred in _IMPLS else "reference"
        if impl != preferred:
            logger.warning("attention: %s kernel not available in this build; using the reference", preferred)
    if impl not in _IMPLS:
        raise ValueError(f"attention implementation {impl!r} is not available; choose from {available_impls()}")
    logger.info("attention implementation: %s (backend %s)", impl, backend)
    return impl


def ragged_paged_attention(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, soft_cap=None, impl="auto"):
    """Attention of the flattened queries of a ragged batch against the paged KV cache.

    q [T, num_q_heads, head_dim]; kv_pages [num_pages, page_size, 2 * num_kv_heads, head_dim]
    (K at even, V at odd head slots); kv_lens int32[S]; page_table int32[S, max_pages_per_seq];
    cu_q_lens int32[S + 1]; num_seqs int32[1]. Returns [T, num_q_heads, head_dim].
    """
    if impl == "auto":
        impl = resolve_impl(impl)
    if impl not in _IMPLS:
        raise ValueError(f"attention implementation {impl!r} is not available; choose from {available_impls()}")
    return _IMPLS[impl](q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs,
                        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
