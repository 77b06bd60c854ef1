"""Ragged paged attention shaped for XLA:CPU: the reference's contract and numerics, laid out
so that XLA's CPU code generator reads the paged cache with vector copies and hands the
arithmetic to its matrix kernels (YNNPACK) in shapes they run fast.

Same signature and contract as `reference.ragged_paged_attention` (docs/architecture.md,
section "Kernels"): queries of all scheduled tokens back to back, the cache
`[num_pages, page_size, 2 * num_kv_heads, head_dim]` with K at even and V at odd head slots,
and the step's AttentionMetadata; query token i of sequence s sits at cache position
`kv_lens[s] - q_len_s + i`; padding tokens get zeros.

What XLA:CPU does well and badly, measured on the 2-core AVX-512 machine of issue 14, decides
the layout:
  - A gather of 64-float rows (one K or V head of one token) mostly compiles to scalar moves
    (one per value), as does a gather followed by a strided K/V slice; a gather of 128-float
    rows compiles to vector moves. The two slots of one KV head, K_h and V_h, are adjacent in the cache
    (slots 2h, 2h + 1), so every read here gathers `[K_h | V_h]` rows of 2 * head_dim values,
    masked (padding is NaN in tests) and converted to float32 in the same pass.
  - Batched matrix products run fast when the gathered block is the left operand row-major
    or the right operand with the reduction over its leading axis; transposing a block first
    costs a pass over it. Scores therefore contract a `[K_h | V_h]` row with `[q | 0]` (the
    zero half spares a copy of the K half: on cached data the extra multiplies are cheaper
    than the copy), and the output contracts the probabilities with the same rows, keeping
    the V half at the end.
  - XLA:CPU has no bfloat16 gather: it converts the whole cache to float32 first, on every
    call. A bfloat16 cache is therefore read through its uint16 view and widened to float32
    with an integer shift in the gather's own loop. XLA still copies the whole array into that
    view once per call (a bitcast between types is not free on CPU), so a bfloat16 cache
    stays slower than a float32 one here: keep the KV cache in float32 on CPU.
  - Worse for float8: XLA:CPU runs every float8 operation through float16. An 8-bit cache
    (kv_quant: int8 or float8_e4m3fn values, each row followed by its bfloat16 scale) is
    therefore gathered as bytes, [K_h, scale | V_h, scale] rows of 2 * (head_dim + 2) bytes,
    float8 through its uint8 view, and decoded with integer operations (kv_quant) to float32
    [K_h | V_h] rows in the gather's own pass; from there on it is read as a float cache.
    Measured at 16 decodes x 1024 tokens, head_dim 64: int8 and float8 about as fast as
    float32 (native float8 conversion was 15x slower).
  - Every operation in a loop body costs a few microseconds however small (tens when other
    processes hold the cores), so loop steps are large: a decode step takes 128-256 tokens
    of every sequence at once (`default_decode_block_tokens`).

Two passes, as in the reference, so that no token pays for another sequence's context:
  1. decodes (sequences with one query token), all sequence slots at once, a block of
     `decode_block_tokens` of every sequence per step, with an online softmax; the loop runs
     only as far as the longest decode context in the step;
  2. prefill chunks (several query tokens, perhaps after a cached prefix), one sequence after
     another, in blocks of `q_block` query tokens against KV blocks of `kv_block_tokens`,
     from the first key a row can see (sliding window) to the last (causality).
Loop bounds come from the metadata at run time (fori_loop), block sizes from the static
shapes, so one compiled program serves every step of a shape bucket.

The sliding window may be traced (a layer's window inside the model's scan), and attention
sinks are folded in after the last block, both as in the reference.

Numerics as the reference's: scores, softmax and accumulators in float32 (float64 for float64
inputs), the output cast back to the query dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from orca_jax.kernels import kv_quant
from orca_jax.kernels.metadata import AttentionMetadata
from orca_jax.kernels.reference import add_sinks

# A finite "minus infinity": keeps exp(m_old - m_new) defined while a row has seen no key yet.
_MASK_VALUE = -1e30
# Decode blocks: tokens of every sequence per loop step. Measured on the 2-core machine at
# batch 1-64 x context 2048 (benchmarks/kernel_bench.py --cpu): 128 and 256 are within noise of
# each other everywhere, 64 is 10-40% slower (per-step overhead), 512 slower at batch 64 (a
# 25 MiB block). So: about _DECODE_TOKENS_PER_STEP tokens of all rows together, within bounds.
_DECODE_TOKENS_PER_STEP = 8192
_MIN_DECODE_BLOCK, _MAX_DECODE_BLOCK = 128, 256
# The view a float8 cache is gathered through (its bits); int8 caches are gathered as int8.
_FP8_BITS = jnp.uint8


def default_decode_block_tokens(num_seq_slots: int, page_size: int) -> int:
    """Tokens per sequence per decode loop step for a step of `num_seq_slots` rows: a power of
    two, a whole number of pages."""
    target = max(1, _DECODE_TOKENS_PER_STEP // max(1, num_seq_slots))
    block = 1 << (target.bit_length() - 1)  # largest power of two <= target
    block = min(max(block, _MIN_DECODE_BLOCK), _MAX_DECODE_BLOCK)
    return -(-block // page_size) * page_size


def _check_inputs(q, kv_pages, metadata) -> None:
    if q.ndim != 3 or kv_pages.ndim != 4:
        raise ValueError(f"q must be [T, heads, head_dim] and kv_pages [pages, page_size, 2 * kv_heads, head_dim]; "
                         f"got {q.shape} and {kv_pages.shape}")
    T, num_q_heads, head_dim = q.shape
    two_kv_heads = kv_pages.shape[2]
    if kv_quant.values_head_dim(kv_pages) != head_dim:
        raise ValueError(f"head_dim differs: q has {head_dim}, kv_pages {kv_quant.values_head_dim(kv_pages)} "
                         f"(cache rows of {kv_pages.shape[3]} {jnp.dtype(kv_pages.dtype).name})")
    if two_kv_heads % 2 or num_q_heads % (two_kv_heads // 2):
        raise ValueError(f"{num_q_heads} query heads cannot share {two_kv_heads} K/V slots "
                         "(need an even slot count, K/V interleaved, and whole query groups per KV head)")
    S = metadata.page_table.shape[0]
    if metadata.kv_lens.shape != (S,) or metadata.cu_q_lens.shape != (S + 1,):
        raise ValueError(f"metadata rows disagree: page_table {metadata.page_table.shape}, "
                         f"kv_lens {metadata.kv_lens.shape}, cu_q_lens {metadata.cu_q_lens.shape}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "decode_block_tokens",
                                             "q_block", "kv_block_tokens"))
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
    decode_block_tokens: int | None = None,  # None: default_decode_block_tokens(S, page_size)
    q_block: int = 64,
    kv_block_tokens: int = 128,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Attention of the flattened queries of a ragged step against the paged cache, in two
    passes (decode rows, then prefill chunks; see the module docstring). The block sizes only
    change speed, never the answer beyond float rounding."""
    _check_inputs(q, kv_pages, metadata)
    T, num_q_heads, head_dim = q.shape
    num_pages, page_size, two_kv_heads, _ = kv_pages.shape
    S = metadata.page_table.shape[0]
    compute_dtype = jnp.promote_types(q.dtype, jnp.float32)
    kv_lens, cu_q_lens = metadata.kv_lens, metadata.cu_q_lens
    # Entries past a sequence's pages are never read for data, but they are gathered from (and
    # masked) inside a block: keep them in range.
    page_table = jnp.clip(metadata.page_table, 0, num_pages - 1)
    rows = _kv_row_view(kv_pages)

    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    is_real = jnp.arange(S) < metadata.num_seqs[0]
    is_decode = is_real & (q_lens == 1)
    is_prefill = is_real & (q_lens > 1)
    qs = q.astype(compute_dtype) * sm_scale
    # Room for one query block past the last token, so block reads and writes stay in range.
    out = jnp.zeros((T + q_block, num_q_heads, head_dim), compute_dtype)

    num_kv_heads = two_kv_heads // 2
    if sinks is not None:  # per KV head, as the passes lay the query heads out
        sinks = sinks.astype(compute_dtype).reshape(num_kv_heads, num_q_heads // num_kv_heads)
    first_token = jnp.minimum(cu_q_lens[:-1], T - 1)  # each row's query, if it is a decode
    decode_out = _decode_rows(
        qs[first_token], rows, page_table, jnp.where(is_decode, kv_lens, 0), num_kv_heads=num_kv_heads,
        page_size=page_size, block_tokens=decode_block_tokens or default_decode_block_tokens(S, page_size),
        sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    out = out.at[jnp.where(is_decode, first_token, T + q_block)].set(decode_out, mode="drop")

    out = _prefill_chunks(
        jnp.pad(qs, ((0, q_block), (0, 0), (0, 0))), out, rows, page_table, kv_lens, cu_q_lens, q_lens,
        is_prefill, num_kv_heads=num_kv_heads, page_size=page_size, q_block=q_block, kv_block_tokens=kv_block_tokens,
        sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    return out[:T].astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------

def _kv_row_view(kv_pages):
    """The cache as rows of [K_h | V_h], one per (token slot, KV head): row
    `(page * page_size + offset) * num_kv_heads + h`. bfloat16 as its uint16 bits, float8 as
    its uint8 bits (XLA:CPU gathers neither type: it would convert the whole cache first; see
    the module docstring); int8 as it is. A quantized row is [K_h, its scale | V_h, its scale]."""
    num_pages, page_size, two_kv_heads, row_width = kv_pages.shape
    if kv_pages.dtype == jnp.bfloat16:
        kv_pages = jax.lax.bitcast_convert_type(kv_pages, jnp.uint16)
    if kv_pages.dtype == jnp.float8_e4m3fn:
        kv_pages = jax.lax.bitcast_convert_type(kv_pages, _FP8_BITS)
    return kv_pages.reshape(num_pages * page_size * (two_kv_heads // 2), 2 * row_width)


def _load_block(rows, token_slots, visible, num_kv_heads, dtype):
    """The [K_h | V_h] rows of the tokens at cache slots `token_slots` [..., B], for every KV
    head: [..., num_kv_heads, B, 2 * head_dim] in `dtype`, zero where `visible` [..., B] is
    False (unused slots may hold NaN, and a probability of 0 times NaN is still NaN)."""
    heads = jnp.arange(num_kv_heads)
    row_ids = token_slots[..., None, :] * num_kv_heads + heads[:, None]  # [..., K, B]
    x = rows.at[row_ids].get(mode="promise_in_bounds")  # page_table is clipped: slots in range
    if rows.dtype == jnp.uint16:  # bfloat16 bits: the high half of a float32
        x = jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
    if rows.dtype in (jnp.int8, _FP8_BITS):  # 8-bit rows, each with its scale
        x = _dequantize_pairs(x)
    return jnp.where(visible[..., None, :, None], x, 0).astype(dtype)


def _dequantize_pairs(x):
    """Gathered quantized rows [..., 2 * (head_dim + 2)] (K_h and V_h with their scales; float8
    as its uint8 bits) -> float32 [K_h | V_h] rows [..., 2 * head_dim], the float layout the
    rest of this file reads. Decoded from the bytes: XLA:CPU runs float8 arrays through
    float16 one operation at a time. Unused slots may hold NaN scales: masked by the caller."""
    storage = jnp.float8_e4m3fn if x.dtype == _FP8_BITS else jnp.int8
    pairs = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    values = kv_quant.dequantize_row_bits(pairs, storage)  # [..., 2, head_dim]
    return values.reshape(*x.shape[:-1], 2 * values.shape[-1])


def _cap(scores, soft_cap):
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def _online_softmax_step(m, l, scores, visible, axis):
    """One block of an online softmax along `axis`: new running max `m`, normaliser `l`, the
    block's probabilities (0 where not visible) and the factor that rescales what was summed."""
    scores = jnp.where(visible, scores, _MASK_VALUE)
    m_new = jnp.maximum(m, scores.max(axis=axis))
    p = jnp.where(visible, jnp.exp(scores - jnp.expand_dims(m_new, axis)), 0)
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + p.sum(axis=axis), p, alpha


def _normalise(acc, l):
    return acc / jnp.where(l > 0, l, 1)[..., None]  # rows that saw no key stay 0


# --------------------------------------------------------------------------------------------
# Pass 1: decode rows
# --------------------------------------------------------------------------------------------

def _decode_rows(q_rows, rows, page_table, lens, *, num_kv_heads, page_size, block_tokens, sliding_window,
                 soft_cap, sinks):
    """One query per sequence slot against its own pages.

    q_rows [S, N, D] (scaled); rows: the cache as [K_h | V_h] rows; page_table i32[S, P];
    lens i32[S]: keys of each row (0: not a decode, nothing is read for it). Returns
    [S, N, D], zero for rows that saw no key."""
    S, num_q_heads, head_dim = q_rows.shape
    group = num_q_heads // num_kv_heads
    dtype = q_rows.dtype
    pages_per_block = block_tokens // page_size
    page_table = _pad_to_blocks(page_table, pages_per_block)

    # [q | 0] per KV head, laid out to be reduced over its leading axis against [K_h | V_h] rows.
    qg = q_rows.reshape(S, num_kv_heads, group, head_dim)
    q_pad = jnp.concatenate([qg, jnp.zeros_like(qg)], axis=-1).transpose(0, 1, 3, 2)  # [S, K, 2D, G]

    query_pos = lens - 1
    longest = jnp.max(lens)
    first_block = 0
    if sliding_window is not None:
        # The earliest key any decode row can see; rows that are not decodes do not count.
        first_key = jnp.min(jnp.where(lens > 0, jnp.maximum(lens - sliding_window, 0), longest))
        first_block = first_key // block_tokens
    end_block = (longest + block_tokens - 1) // block_tokens
    offsets = jnp.arange(block_tokens)

    def attend_block(b, carry):
        m, l, acc = carry  # [S, K, G], [S, K, G], [S, K, G, 2D]
        key_pos = b * block_tokens + offsets
        visible = key_pos[None, :] < lens[:, None]  # [S, B]
        if sliding_window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
        pages = jax.lax.dynamic_slice_in_dim(page_table, b * pages_per_block, pages_per_block, axis=1)
        slots = jnp.repeat(pages, page_size, axis=1) * page_size + offsets % page_size
        # Keys no row sees are read from page 0's first slot (in cache), then masked.
        x = _load_block(rows, jnp.where(visible, slots, 0), visible, num_kv_heads, dtype)  # [S, K, B, 2D]
        scores = _cap(jnp.einsum("skbx,skxg->skbg", x, q_pad), soft_cap)
        m, l, p, alpha = _online_softmax_step(m, l, scores, visible[:, None, :, None], axis=2)
        acc = acc * alpha[..., None] + jnp.einsum("skbg,skbx->skgx", p, x)
        return m, l, acc

    init = (jnp.full((S, num_kv_heads, group), _MASK_VALUE, dtype),
            jnp.zeros((S, num_kv_heads, group), dtype),
            jnp.zeros((S, num_kv_heads, group, 2 * head_dim), dtype))
    m, l, acc = jax.lax.fori_loop(first_block, end_block, attend_block, init)
    if sinks is not None:
        l, acc = add_sinks(m, l, acc, sinks)
    return _normalise(acc[..., head_dim:], l).reshape(S, num_q_heads, head_dim)


# --------------------------------------------------------------------------------------------
# Pass 2: prefill chunks
# --------------------------------------------------------------------------------------------

def _prefill_chunks(qs, out, rows, page_table, kv_lens, cu_q_lens, q_lens, is_prefill, *, num_kv_heads,
                    page_size, q_block, kv_block_tokens, sliding_window, soft_cap, sinks):
    """Sequences with several query tokens, one after another, `q_block` tokens at a time.

    qs [T + q_block, N, D] (scaled, padded by a block); out [T + q_block, N, D] with the decode
    rows already in place. Returns `out` with every prefill token's row written."""
    S = page_table.shape[0]
    pages_per_block = max(1, kv_block_tokens // page_size)
    page_table = _pad_to_blocks(page_table, pages_per_block)
    attend = functools.partial(_attend_query_block, rows=rows, num_kv_heads=num_kv_heads, page_size=page_size,
                               pages_per_block=pages_per_block, sliding_window=sliding_window, soft_cap=soft_cap,
                               sinks=sinks)
    order = jnp.nonzero(is_prefill, size=S, fill_value=0)[0]  # prefill sequences first

    def one_sequence(i, out):
        s = order[i]

        def one_block(j, out):
            start = cu_q_lens[s] + j * q_block
            offsets = j * q_block + jnp.arange(q_block)
            rows_valid = offsets < q_lens[s]
            query_pos = kv_lens[s] - q_lens[s] + offsets
            new = attend(jax.lax.dynamic_slice_in_dim(qs, start, q_block), page_table[s], query_pos, rows_valid)
            old = jax.lax.dynamic_slice_in_dim(out, start, q_block)
            merged = jnp.where(rows_valid[:, None, None], new, old)  # do not clobber the next sequence
            return jax.lax.dynamic_update_slice_in_dim(out, merged, start, axis=0)

        return jax.lax.fori_loop(0, (q_lens[s] + q_block - 1) // q_block, one_block, out)

    return jax.lax.fori_loop(0, jnp.sum(is_prefill), one_sequence, out)


def _attend_query_block(q_rows, pages, query_pos, rows_valid, *, rows, num_kv_heads, page_size, pages_per_block,
                        sliding_window, soft_cap, sinks):
    """R query tokens of one sequence against the KV blocks some of them can see.

    q_rows [R, N, D] (scaled); pages i32[padded pages]; query_pos i32[R] (cache position of
    each row); rows_valid bool[R]. The G query heads of a KV head and the R tokens form the
    R * G rows of one matrix per KV head. Returns [R, N, D], zero for invalid rows."""
    R, num_q_heads, head_dim = q_rows.shape
    group = num_q_heads // num_kv_heads
    dtype = q_rows.dtype
    block_tokens = pages_per_block * page_size
    qg = q_rows.reshape(R, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3).reshape(
        num_kv_heads, R * group, head_dim)  # row r = token r // G, head r % G

    last_pos = jnp.max(jnp.where(rows_valid, query_pos, -1))
    first_block = 0
    if sliding_window is not None:
        first_pos = jnp.min(jnp.where(rows_valid, query_pos, jnp.iinfo(jnp.int32).max))
        first_block = jnp.maximum(first_pos - sliding_window + 1, 0) // block_tokens
    end_block = (last_pos + block_tokens) // block_tokens  # blocks holding positions <= last_pos
    offsets = jnp.arange(block_tokens)

    def attend_block(b, carry):
        m, l, acc = carry  # [K, R*G], [K, R*G], [K, R*G, D]
        key_pos = b * block_tokens + offsets
        written = key_pos <= last_pos  # later slots of the sequence hold anything
        slots = jnp.repeat(jax.lax.dynamic_slice_in_dim(pages, b * pages_per_block, pages_per_block),
                           page_size) * page_size + offsets % page_size
        x = _load_block(rows, jnp.where(written, slots, 0), written, num_kv_heads, dtype)  # [K, B, 2D]
        # R * G query rows reuse every loaded key, so here the K and V halves are taken apart
        # (a copy of the block) and multiplied without the zero padding of the decode pass.
        scores = _cap(jnp.einsum("krd,kbd->krb", qg, x[..., :head_dim]), soft_cap)
        visible = (key_pos[None, :] <= query_pos[:, None]) & rows_valid[:, None]  # [R, B]
        if sliding_window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
        visible = jnp.repeat(visible, group, axis=0)  # [R*G, B]
        m, l, p, alpha = _online_softmax_step(m, l, scores, visible[None], axis=2)
        acc = acc * alpha[..., None] + jnp.einsum("krb,kbd->krd", p, x[..., head_dim:])
        return m, l, acc

    init = (jnp.full((num_kv_heads, R * group), _MASK_VALUE, dtype),
            jnp.zeros((num_kv_heads, R * group), dtype),
            jnp.zeros((num_kv_heads, R * group, head_dim), dtype))
    m, l, acc = jax.lax.fori_loop(first_block, end_block, attend_block, init)
    if sinks is not None:  # rows are token r // G, head r % G of each KV head
        l, acc = add_sinks(m, l, acc, jnp.tile(sinks, (1, R)))
    out = _normalise(acc, l).reshape(num_kv_heads, R, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(R, num_q_heads, head_dim)


def _pad_to_blocks(page_table, pages_per_block):
    """Pad the page table's columns to whole blocks (padding points at page 0), so that every
    block's slice is in range."""
    width = page_table.shape[1]
    return jnp.pad(page_table, ((0, 0), (0, -(-width // pages_per_block) * pages_per_block - width)))
