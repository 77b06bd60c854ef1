"""Pure-jnp ragged paged attention: the CPU path and the oracle for the Pallas kernels.

Every query token finds its sequence from `cu_q_lens`, then walks that sequence's pages in
blocks with an online (flash-style) softmax, so memory stays O(T * block) whatever the context
length. All tokens are processed together (vectorised over T); the block loop runs only as far
as the longest sequence in the step, so short steps stay cheap.

Numerics: scores, softmax and the accumulator are float32 (float64 if the inputs are float64),
the output is cast back to the query dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# A finite "minus infinity": keeps exp(m_old - m_new) defined while a row has seen no key yet.
_MASK_VALUE = -1e30


def write_kv(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter this step's K/V into the paged cache.

    kv_pages: [num_pages, page_size, 2 * num_kv_heads, head_dim]
    k, v:     [T, num_kv_heads, head_dim]
    slot_mapping: int32[T], page * page_size + offset (padding tokens point into page 0)
    """
    num_pages, page_size, two_kv_heads, head_dim = kv_pages.shape
    T, num_kv_heads, _ = k.shape
    # Interleave so K of head h lands in slot 2h and V in slot 2h + 1.
    kv = jnp.stack([k, v], axis=2).reshape(T, two_kv_heads, head_dim).astype(kv_pages.dtype)
    flat = kv_pages.reshape(num_pages * page_size, two_kv_heads, head_dim)
    return flat.at[slot_mapping].set(kv, mode="promise_in_bounds").reshape(kv_pages.shape)


def token_sequence_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """int32[T]: the sequence each flattened token belongs to (padding tokens get a row past
    the last real sequence, which the caller masks)."""
    return jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens, dtype=jnp.int32), side="right").astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "kv_block_tokens"))
def ragged_paged_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # int32[S]
    page_table: jax.Array,  # int32[S, max_pages_per_seq]
    cu_q_lens: jax.Array,  # int32[S + 1]
    num_seqs: jax.Array,  # int32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_block_tokens: int = 128,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    T, num_q_heads, head_dim = q.shape
    _, page_size, two_kv_heads, _ = kv_pages.shape
    num_kv_heads = two_kv_heads // 2
    group = num_q_heads // num_kv_heads
    S, max_pages = page_table.shape
    compute_dtype = jnp.promote_types(q.dtype, jnp.float32)

    pages_per_block = max(1, kv_block_tokens // page_size)
    block_tokens = pages_per_block * page_size
    num_blocks_static = -(-max_pages // pages_per_block)
    # Pad the page table so every block slice is in range; padding points at page 0.
    page_table = jnp.pad(page_table, ((0, 0), (0, num_blocks_static * pages_per_block - max_pages)))

    # Per-token metadata.
    seq = token_sequence_ids(cu_q_lens, T)
    token_valid = (jnp.arange(T) < cu_q_lens[num_seqs[0]]) & (seq < num_seqs[0])
    seq = jnp.minimum(seq, S - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    query_pos = kv_lens[seq] - q_len + (jnp.arange(T) - cu_q_lens[seq])  # [T]
    token_pages = page_table[seq]  # [T, padded max pages]

    # Grouped-query layout: the `group` query heads that share a KV head sit together.
    qg = (q.astype(compute_dtype) * sm_scale).reshape(T, num_kv_heads, group, head_dim)

    max_kv_len = jnp.max(jnp.where(jnp.arange(S) < num_seqs[0], kv_lens, 0))
    num_blocks = (max_kv_len + block_tokens - 1) // block_tokens

    def attend_block(b, carry):
        m, l, acc = carry  # [T, KVH, G], [T, KVH, G], [T, KVH, G, D]
        pages = jax.lax.dynamic_slice_in_dim(token_pages, b * pages_per_block, pages_per_block, axis=1)
        kv = kv_pages[pages].reshape(T, block_tokens, two_kv_heads, head_dim).astype(compute_dtype)
        k, v = kv[:, :, 0::2], kv[:, :, 1::2]  # [T, B, KVH, D]
        key_pos = b * block_tokens + jnp.arange(block_tokens)  # [B]
        visible = (key_pos[None, :] <= query_pos[:, None]) & token_valid[:, None]
        if sliding_window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
        # Unused cache slots may hold anything (NaN in tests): never let them reach a sum.
        v = jnp.where(visible[:, :, None, None], v, 0)
        s = jnp.einsum("tkgd,tbkd->tkgb", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(visible[:, None, None, :], s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(visible[:, None, None, :], jnp.exp(s - m_new[..., None]), 0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("tkgb,tbkd->tkgd", p, v)
        return m_new, l, acc

    init = (
        jnp.full((T, num_kv_heads, group), _MASK_VALUE, compute_dtype),
        jnp.zeros((T, num_kv_heads, group), compute_dtype),
        jnp.zeros((T, num_kv_heads, group, head_dim), compute_dtype),
    )
    _, l, acc = jax.lax.fori_loop(0, num_blocks, attend_block, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1)[..., None], 0)
    return out.reshape(T, num_q_heads, head_dim).astype(q.dtype)
