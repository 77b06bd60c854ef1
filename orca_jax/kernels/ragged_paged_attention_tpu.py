"""Ragged paged attention on TPU: jax's own Pallas TPU kernel, which shares our KV layout.

`jax.experimental.pallas.ops.tpu.ragged_paged_attention` takes exactly our arrays (queries
back to back, pages `[num_pages, page_size, 2 * num_kv_heads, head_dim]` with K and V
interleaved, and the metadata's kv_lens, page table, cu_q_lens and num_seqs, as positional
arguments in that order), so this file only unpacks the metadata, chooses the block sizes
from jax's tuning table and decides when it cannot serve:
  - head_dim must be a multiple of 128 (the TPU lane width);
  - the K/V head axis must tile the TPU's (8 x packing) sublanes, which jax checks in
    `get_min_heads_per_blk`;
  - the window must be static (a model with one attention type on every layer), and there
    are no attention sinks: its `sliding_window` is a Python int, and it has no sink logits;
  - the cache must hold plain values: jax's kernel scales a quantized cache by one float per
    tensor (`k_scale`, `v_scale`), while our 8-bit cache (kv_quant) stores a scale per token
    and head inside each row, which it would read as values.
For shapes outside those rules `unsupported_reason` says why, and the dispatcher
(`orca_jax.kernels`) runs the reference instead.

The kernel does not run in Pallas' CPU interpreter, so tests cover everything around it:
the support rule, the block sizes, the fallback and the dispatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from orca_jax.kernels import kv_quant
from orca_jax.kernels.metadata import AttentionMetadata

TPU_LANES = 128


def _tpu_ops():
    # Imported lazily: the module is importable everywhere, but only TPUs can run it.
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa
    return rpa


def unsupported_reason(num_q_heads: int, num_kv_heads: int, head_dim: int, q_dtype, kv_dtype, *,
                       traced_window: bool = False, has_sinks: bool = False) -> str | None:
    """Why jax's TPU kernel cannot take these shapes and options, or None when it can."""
    if has_sinks:
        return "jax's TPU kernel has no attention sinks (a per-head logit in the softmax denominator)"
    if traced_window:
        return ("the model mixes sliding and full layers, so each layer's window is traced inside the layer scan, "
                "and jax's TPU kernel takes its sliding_window as a static int")
    if kv_quant.is_quantized(kv_dtype):
        return (f"the {jnp.dtype(kv_dtype).name} KV cache keeps a bfloat16 scale per token and head in each row "
                "(kv_quant), which jax's TPU kernel cannot read (it takes one scale per tensor)")
    if head_dim % TPU_LANES:
        return f"head_dim {head_dim} is not a multiple of {TPU_LANES}"
    # jax states its own tiling rule (and its wording); versions without the helper skip it.
    tiling_check = getattr(getattr(_tpu_ops(), "kernel", None), "get_min_heads_per_blk", None)
    if tiling_check is not None:
        try:
            tiling_check(num_q_heads, 2 * num_kv_heads, q_dtype, kv_dtype)
        except (ValueError, NotImplementedError) as e:
            return f"{num_kv_heads} KV heads in {jnp.dtype(kv_dtype).name}: {e}"
    return None


def block_sizes(q, kv_pages, page_table, tuned_lookup=None) -> tuple[int, int]:
    """(KV pages per block, queries per block) from jax's tuning table for this TPU.

    `tuned_lookup` is jax's `get_tuned_block_sizes` where this process runs on a TPU (it reads
    the TPU's version from `jax.devices()`); lowered for a TPU from another host, the one the
    abstract mesh names (`cross_host_tuned_lookup`). Tests pass a stand-in. The answer is
    clamped to this step's page-table width and token count."""
    if tuned_lookup is None:
        on_tpu = jax.devices()[0].platform == "tpu"
        tuned_lookup = _tpu_ops().get_tuned_block_sizes if on_tpu else cross_host_tuned_lookup
    T, num_q_heads, head_dim = q.shape
    _, page_size, two_kv_heads, _ = kv_pages.shape
    pages_per_seq = page_table.shape[1]
    kv_pages_per_block, queries_per_block = tuned_lookup(
        q.dtype, kv_pages.dtype, num_q_heads, two_kv_heads // 2, head_dim, page_size, T, pages_per_seq)
    return max(1, min(kv_pages_per_block, pages_per_seq)), max(1, min(queries_per_block, T))


# jax's untuned block sizes: its default, and v4's (which keeps within v4's smaller VMEM).
DEFAULT_BLOCK_SIZES = (128, 32)
TPU_V4_BLOCK_SIZES = (32, 32)


def cross_host_tuned_lookup(q_dtype, kv_dtype, num_q_heads, num_kv_heads, head_dim, page_size,
                            num_tokens, pages_per_seq) -> tuple[int, int]:
    """jax's tuning-table lookup for the TPU of the abstract mesh being lowered under
    (`jax.sharding.use_abstract_mesh` with an abstract TPU device: a TPU program built on a
    CPU host). jax's own lookup reads `jax.devices()`, which is this host's CPU. Without an
    abstract TPU the defaults stand (what jax itself uses for untuned shapes)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    kind = getattr(device, "device_kind", "") if getattr(device, "platform", None) == "tpu" else ""
    if kind.startswith("TPU v4"):
        return TPU_V4_BLOCK_SIZES
    table_module = _tpu_ops().tuned_block_sizes
    table = getattr(table_module, "TUNED_BLOCK_SIZES", {}).get(" ".join(kind.split()[:2]), {})
    key = table_module.simplify_key((q_dtype, kv_dtype, num_q_heads, num_kv_heads, head_dim, page_size,
                                     num_tokens, pages_per_seq))
    return table.get(key, DEFAULT_BLOCK_SIZES)


def ragged_paged_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    metadata: AttentionMetadata,  # reads kv_lens i32[S], page_table i32[S, max_pages_per_seq],
    #                               cu_q_lens i32[S + 1], num_seqs i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: None = None,  # never given: `unsupported_reason` sends models with sinks to the reference
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """jax's TPU kernel, for shapes it serves (`unsupported_reason` is None)."""
    assert sinks is None, "attention sinks go to the reference (unsupported_reason)"
    kv_pages_per_block, queries_per_block = block_sizes(q, kv_pages, metadata.page_table)
    return _tpu_ops().ragged_paged_attention(
        q, kv_pages, metadata.kv_lens, metadata.page_table, metadata.cu_q_lens, metadata.num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        num_kv_pages_per_block=kv_pages_per_block, num_queries_per_block=queries_per_block)
