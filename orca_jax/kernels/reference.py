"""Pure-jnp ragged paged attention: the oracle for every other implementation (the CPU path
is ragged_paged_attention_cpu, laid out for XLA:CPU).

Every query token finds its sequence from `cu_q_lens`, then walks that sequence's pages in
blocks with an online (flash-style) softmax, so memory stays O(T * block) whatever the context
length. All tokens are processed together (vectorised over T); the block loop runs only as far
as the longest sequence in the step, so short steps stay cheap.

A sliding window may be a Python int or a traced int32 scalar (the window of the layer a scan
is in: models that mix sliding and full layers pass each layer's window, a full layer's larger
than any context); either way only the blocks the window covers are visited. Attention sinks
(gpt-oss) are one more logit per head in the softmax's denominator, folded in after the last
block (`add_sinks`).

Numerics: scores, softmax and the accumulator are float32 (float64 if the inputs are float64),
the output is cast back to the query dtype. An 8-bit cache (kv_quant) is dequantized block by
block after the gather, exactly (value times its row's bfloat16 scale fits float32), then
read as a float cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from orca_jax.kernels import kv_quant
from orca_jax.kernels.metadata import AttentionMetadata

# A finite "minus infinity": keeps exp(m_old - m_new) defined while a row has seen no key yet.
_MASK_VALUE = -1e30


def write_kv(kv_pages: jax.Array, k: jax.Array, v: jax.Array, metadata: AttentionMetadata) -> jax.Array:
    """Scatter this step's K/V into the paged cache, token t into `metadata.slot_mapping[t]`.

    kv_pages: [num_pages, page_size, 2 * num_kv_heads, head_dim] (head_dim + 2 when quantized:
              k and v are quantized row by row on the way in, see kv_quant)
    k, v:     [T, num_kv_heads, head_dim]
    metadata.slot_mapping: int32[T], page * page_size + offset (padding tokens point into page 0)
    """
    slot_mapping = metadata.slot_mapping
    num_pages, page_size, two_kv_heads, head_dim = kv_pages.shape
    T, num_kv_heads, _ = k.shape
    if kv_quant.is_quantized(kv_pages.dtype):
        # Each token's rows carry their own scale (kv_quant): [T, K, head_dim + 2] each.
        k, v = kv_quant.quantize_rows(k, kv_pages.dtype), kv_quant.quantize_rows(v, kv_pages.dtype)
    # Interleave so K of head h lands in slot 2h and V in slot 2h + 1.
    kv = jnp.stack([k, v], axis=2).reshape(T, two_kv_heads, head_dim).astype(kv_pages.dtype)
    flat = kv_pages.reshape(num_pages * page_size, two_kv_heads, head_dim)
    return flat.at[slot_mapping].set(kv, mode="promise_in_bounds").reshape(kv_pages.shape)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "q_block", "kv_block_tokens"))
def ragged_paged_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim (+ 2 if quantized)]
    metadata: AttentionMetadata,  # reads kv_lens i32[S], page_table i32[S, max_pages_per_seq],
    #                               cu_q_lens i32[S + 1], num_seqs i32[1]
    *,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,  # an int, or traced i32[] (a layer's window in a scan)
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[num_q_heads]: one more logit per head in the denominator
    q_block: int = 32,
    kv_block_tokens: int = 64,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Two passes, so that no token pays for another sequence's context:

    1. sequences with one query token (decodes), all at once: each row gathers its own pages;
    2. sequences with several (prefill chunks), one after another, in blocks of `q_block` query
       rows that share one gather of each KV block.
    Loops run only as far as the data: to each sequence's own causal (and window) bounds.
    """
    kv_lens, page_table, cu_q_lens, num_seqs = (
        metadata.kv_lens, metadata.page_table, metadata.cu_q_lens, metadata.num_seqs)
    T, num_q_heads, head_dim = q.shape
    S, max_pages = page_table.shape
    page_size = kv_pages.shape[1]
    compute_dtype = jnp.promote_types(q.dtype, jnp.float32)
    pages_per_block = max(1, kv_block_tokens // page_size)
    # Pad the page table so every block slice is in range; padding points at page 0.
    padded_pages = -(-max_pages // pages_per_block) * pages_per_block
    page_table = jnp.pad(page_table, ((0, 0), (0, padded_pages - max_pages)))
    attend = functools.partial(
        _attend_one_sequence, kv_pages=kv_pages, pages_per_block=pages_per_block,
        sliding_window=sliding_window, soft_cap=soft_cap,
        sinks=None if sinks is None else sinks.astype(compute_dtype),
    )

    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    is_real = jnp.arange(S) < num_seqs[0]
    single = is_real & (q_lens == 1)
    multi = is_real & (q_lens > 1)
    qs = (q.astype(compute_dtype) * sm_scale)
    # Room for a whole query block past the last token, so block reads and writes stay in range.
    qs = jnp.pad(qs, ((0, q_block), (0, 0), (0, 0)))
    out = jnp.zeros((T + q_block, num_q_heads, head_dim), compute_dtype)

    # Pass 1: one query row per sequence slot.
    first_token = jnp.minimum(cu_q_lens[:-1], T)
    single_out = jax.vmap(attend)(
        qs[first_token][:, None], page_table, (kv_lens - 1)[:, None], single[:, None]
    )[:, 0]
    out = out.at[jnp.where(single, first_token, T + q_block)].set(single_out, mode="drop")

    # Pass 2: multi-token sequences, compacted to the front of `order`.
    order = jnp.nonzero(multi, size=S, fill_value=0)[0]

    def one_sequence(i, out):
        s = order[i]

        def one_block(j, out):
            start = cu_q_lens[s] + j * q_block
            offsets = j * q_block + jnp.arange(q_block)
            rows_valid = offsets < q_lens[s]
            query_pos = kv_lens[s] - q_lens[s] + offsets
            q_rows = jax.lax.dynamic_slice_in_dim(qs, start, q_block)
            new = attend(q_rows, page_table[s], query_pos, rows_valid)
            old = jax.lax.dynamic_slice_in_dim(out, start, q_block)
            merged = jnp.where(rows_valid[:, None, None], new, old)  # do not clobber the next sequence
            return jax.lax.dynamic_update_slice_in_dim(out, merged, start, axis=0)

        return jax.lax.fori_loop(0, (q_lens[s] + q_block - 1) // q_block, one_block, out)

    out = jax.lax.fori_loop(0, jnp.sum(multi), one_sequence, out)
    return out[:T].astype(q.dtype)


def _attend_one_sequence(q_rows, pages, query_pos, rows_valid, *, kv_pages, pages_per_block,
                         sliding_window, soft_cap, sinks):
    """Flash-style attention of R query rows of one sequence over its pages.

    q_rows [R, num_q_heads, head_dim] (already scaled); pages i32[padded max pages];
    query_pos i32[R] (cache position of each row); rows_valid bool[R]. Returns [R, N, H] with
    zeros for invalid rows. Visits only the KV blocks some valid row can see."""
    R, num_q_heads, head_dim = q_rows.shape
    page_size, two_kv_heads = kv_pages.shape[1], kv_pages.shape[2]
    num_kv_heads = two_kv_heads // 2
    group = num_q_heads // num_kv_heads
    block_tokens = pages_per_block * page_size
    dtype = q_rows.dtype
    qg = q_rows.reshape(R, num_kv_heads, group, head_dim)

    last_pos = jnp.max(jnp.where(rows_valid, query_pos, -1))
    first_block = 0
    if sliding_window is not None:
        first_pos = jnp.min(jnp.where(rows_valid, query_pos, jnp.iinfo(jnp.int32).max))
        first_block = jnp.maximum(first_pos - sliding_window + 1, 0) // block_tokens
    end_block = (last_pos + block_tokens) // block_tokens  # blocks holding positions <= last_pos

    def attend_block(b, carry):
        m, l, acc = carry  # [R, K, G], [R, K, G], [R, K, G, D]
        block_pages = jax.lax.dynamic_slice_in_dim(pages, b * pages_per_block, pages_per_block)
        kv = _dequantized(kv_pages[block_pages]).reshape(block_tokens, num_kv_heads, 2, head_dim).astype(dtype)
        k, v = kv[:, :, 0], kv[:, :, 1]  # [B, K, D]
        key_pos = b * block_tokens + jnp.arange(block_tokens)
        visible = (key_pos[None, :] <= query_pos[:, None]) & rows_valid[:, None]  # [R, B]
        if sliding_window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
        s = jnp.einsum("rkgd,bkd->rkgb", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        vis = visible[:, None, None, :]
        s = jnp.where(vis, s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0)
        # Cache slots past a sequence's end may hold anything (NaN in tests): 0 * NaN is NaN,
        # so masked-out values are replaced, not just weighted by zero.
        v = jnp.where(visible.any(axis=0)[:, None, None], v, 0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("rkgb,bkd->rkgd", p, v)
        return m_new, l, acc

    init = (
        jnp.full((R, num_kv_heads, group), _MASK_VALUE, dtype),
        jnp.zeros((R, num_kv_heads, group), dtype),
        jnp.zeros((R, num_kv_heads, group, head_dim), dtype),
    )
    m, l, acc = jax.lax.fori_loop(first_block, end_block, attend_block, init)
    if sinks is not None:
        l, acc = add_sinks(m, l, acc, sinks.reshape(num_kv_heads, group))
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1)[..., None], 0)
    return out.reshape(R, num_q_heads, head_dim)


def add_sinks(m, l, acc, sinks):
    """Fold attention sinks into a finished online softmax: one more logit per head in the
    denominator, matched by no value (gpt-oss). m, l [..., heads]: running max and normaliser;
    acc [..., heads, D]; sinks [heads] (broadcast against m's trailing axes). Returns (l, acc)
    rescaled to the common maximum of the scores and the sink."""
    top = jnp.maximum(m, sinks)
    rescale = jnp.exp(m - top)
    return l * rescale + jnp.exp(sinks - top), acc * rescale[..., None]


def _dequantized(block):
    """Gathered cache rows [..., cache head_dim] as values [..., head_dim]: quantized rows times
    their own scales (float32), float rows as they are (the same program as before)."""
    return kv_quant.dequantize_rows(block) if kv_quant.is_quantized(block.dtype) else block
