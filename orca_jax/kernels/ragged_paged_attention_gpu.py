"""Ragged paged attention as one Pallas kernel for NVIDIA GPUs.

One launch computes the attention of a whole mixed step: decode tokens, prefill chunks and
chunked prefills that continue a cached prefix, with the contract and KV layout of
`reference.ragged_paged_attention` (docs/architecture.md, section "Kernels"): the step's ragged
structure arrives as one `AttentionMetadata`, of which it reads kv_lens, page_table, cu_q_lens
and num_seqs.

Work split. The query tokens of each sequence are cut into blocks of `block_q` tokens; a
program owns one (query block, KV head, KV split). It packs the `group` query heads that share
its KV head into the rows of one matrix, `block_q * group` rows, so K/V pages read once serve
every head of the group (GQA). It walks its sequence's pages through the page table, a block
of `kv_block_tokens` at a time, with an online softmax in float32, masking causally (query
token i of a sequence sits at cache position `kv_len - q_len + i`), by the sliding window and
with the soft cap. Only the KV blocks some row of the program can see are read.

Split KV (flash decoding). A step of a few long decodes would leave most of the GPU idle with
one program per (sequence, KV head). With `num_kv_splits > 1` each program takes one slice of
its KV range and writes a partial output with its log-sum-exp; a small XLA epilogue merges the
slices. "auto" picks the split count from the static shapes and the GPU's core count (read
from the device, `num_cores`): enough programs to fill the GPU.

Sliding window as data. `sliding_window` is None (full attention: no window code in the
kernel at all), an int, or a traced int32 scalar: a model with per-layer attention types runs
its layers in one scan and passes the current layer's window as a value (a full layer of a
mixed model passes one larger than any context, e.g. 2**30). Either way the window reaches
the kernel as a one-element int32 input beside the metadata, so one program serves every
window; a program still starts at the first KV block its first row's window reaches, so a
sliding layer at long context reads only the pages the window covers, and split KV divides
that range.

Attention sinks (gpt-oss). `sinks` f32[num_q_heads] adds one logit per query head to each
softmax's denominator, matched by no value and neither scaled nor capped:
out = sum_i exp(s_i - m) v_i / (sum_i exp(s_i - m) + exp(sink - m)). A sink is a key
whose value is zero, so a program's online softmax starts from it (m = sink, l = 1) rather
than from an empty state: no epilogue, no overflow (a larger score rescales it like any key),
and with split KV only split 0 starts from it, so the merge of the slices' log-sum-exps counts
it exactly once. (Folding it in after the loop instead made Llama-8B's 256-decode kernel, with
a window, spill 4 bytes on sm_90; this way its registers are the window-only kernel's.) Each
program reads its rows' sinks as one contiguous row of f32[K, rows] (`_sinks_by_row`).

Lowering: Triton, chosen explicitly through `pltriton.CompilerParams`, although jax now
defaults Pallas on GPU to Mosaic GPU and deprecates the Triton path, because
  - Mosaic GPU targets Hopper and newer only; Triton also runs on the A100, L4 and T4 that
    serving fleets and Colab notebooks have;
  - the page-table gather is a data-dependent row gather, which Triton's pointer loads express
    directly, where Mosaic GPU wants TMA copies of whole tiles per page;
  - the same kernel body runs on CPU with `interpret=True`, which is how tests check it.
A Mosaic GPU port (warp-specialised, TMA-pipelined pages) is the follow-up for Hopper.

Triton needs power-of-two block shapes, so the wrapper pads the query-head group to a power of
two and the query axis by one block; the padded rows are computed and dropped (padded heads'
sinks are _MASK_VALUE, which weighs nothing).

8-bit cache (kv_quant: int8 or float8_e4m3fn values, each row followed by the two bytes of its
bfloat16 scale, so rows of head_dim + 2). A program loads a KV block's values
`[pages, :, slot, 0:head_dim]` (a power-of-two tile, whatever the row width) and the two
scale bytes as two more loads of one byte per key, and rebuilds each key's float32 scale with
integer operations (bfloat16 is the top half of a float32), since Triton has no bitcast that
changes shape. float8 values are decoded with integer operations too: Triton's float8
conversion needs sm_89 or newer, and jax refuses it for the A100; this way the kernel's Triton
IR stays the same for every target. The scales are applied to the matrix products' operands
that are one value per key rather than to the tiles: K's to the score columns, V's to the
probabilities before P @ V. Values convert exactly to bfloat16 (at most 8 significant bits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from orca_jax.kernels import gpu_info, kv_quant
from orca_jax.kernels.metadata import AttentionMetadata

# A finite "minus infinity" so exp(m_old - m_new) stays defined before a row has seen a key.
_MASK_VALUE = -1e30
# Streaming multiprocessors assumed when the device does not report its own: an H100/H200's.
# Also what Pallas' interpreter (CPU tests) plans for, so tests split KV as an H100 would.
FALLBACK_NUM_CORES = 132
# Programs to aim for per multiprocessor when choosing the KV split: a few, so that uneven
# sequences still leave none idle.
_PROGRAMS_PER_CORE = 4
_MAX_KV_SPLITS = 16


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def unsupported_reason(head_dim: int, page_size: int) -> str | None:
    """Why this kernel cannot take a model's shapes, or None when it can (Triton blocks are
    powers of two, and its matrix products need at least 16 along every axis)."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    if page_size & (page_size - 1):
        return f"page_size {page_size} is not a power of two"
    return None


def num_cores(device) -> int:
    """Streaming multiprocessors of `device`: its `core_count` when it is a GPU that reports
    one (jaxlib's CUDA devices do), else FALLBACK_NUM_CORES."""
    count = getattr(device, "core_count", None) if getattr(device, "platform", None) == "gpu" else None
    if isinstance(count, int) and count > 0:
        return count
    return FALLBACK_NUM_CORES


def check_inputs(q, kv_pages, metadata: AttentionMetadata, *, sliding_window=None, sinks=None) -> None:
    """Shape and dtype checks that need no data (the kernel trusts the values)."""
    kv_lens, page_table, cu_q_lens, num_seqs = (
        metadata.kv_lens, metadata.page_table, metadata.cu_q_lens, metadata.num_seqs)
    T, num_q_heads, head_dim = q.shape
    _, page_size, two_kv_heads, kv_head_dim = kv_pages.shape
    S = page_table.shape[0]
    if two_kv_heads % 2:
        raise ValueError(f"kv_pages axis 2 holds K and V interleaved and must be even, got {two_kv_heads}")
    if num_q_heads % (two_kv_heads // 2):
        raise ValueError(f"{num_q_heads} query heads do not divide into {two_kv_heads // 2} KV heads")
    if kv_quant.values_head_dim(kv_pages) != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {kv_quant.values_head_dim(kv_pages)} "
                         f"(rows of {kv_head_dim} {jnp.dtype(kv_pages.dtype).name})")
    reason = unsupported_reason(head_dim, page_size)
    if reason is not None:
        raise ValueError(f"the Triton attention kernel cannot run this shape: {reason}")
    if kv_lens.shape != (S,) or cu_q_lens.shape != (S + 1,) or num_seqs.shape != (1,):
        raise ValueError(f"metadata shapes disagree: kv_lens {kv_lens.shape}, page_table {page_table.shape}, "
                         f"cu_q_lens {cu_q_lens.shape}, num_seqs {num_seqs.shape}")
    for name, a in (("kv_lens", kv_lens), ("page_table", page_table), ("cu_q_lens", cu_q_lens),
                    ("num_seqs", num_seqs)):
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
    if sliding_window is not None and (jnp.shape(sliding_window) != ()
                                       or not jnp.issubdtype(jnp.result_type(sliding_window), jnp.integer)):
        raise ValueError(f"sliding_window must be an int or an integer scalar, got {sliding_window!r}")
    if sinks is not None and (jnp.shape(sinks) != (num_q_heads,)
                              or not jnp.issubdtype(jnp.result_type(sinks), jnp.floating)):
        raise ValueError(f"sinks must be floats [{num_q_heads}] (one per query head), got "
                         f"{jnp.shape(sinks)} {jnp.result_type(sinks)}")


def choose_block_rows(num_tokens: int, num_seq_slots: int, head_dim: int) -> int:
    """Matrix rows per program, from static shapes. A step with no more tokens than sequence
    slots is mostly decodes, whose programs hold one token's `group` real rows: 16 rows (the
    smallest a Triton dot takes) wastes least. Prefill chunks want more rows, so that a prefix
    is read once per 64 rows rather than per 16; at head_dim 256, 32 rows keep a program's
    tiles within shared memory and (with 8 warps, `choose_num_warps`) its registers."""
    if num_tokens <= num_seq_slots:
        return 16
    return 32 if head_dim >= 256 else 64


def choose_num_warps(block_rows: int, kv_block_tokens: int, head_dim: int) -> int:
    """Warps per program, from its tile sizes. A program holds its float32 accumulator
    (block_rows x head_dim) and the operands of its two products, about
    (block_rows + kv_block_tokens) * head_dim values, spread over 32 threads per warp. Past
    12288 of them 4 warps run out of registers and spill to local memory: compiled by
    triton 3.9 for sm_80 and sm_90 (orca_jax/kernels/triton_compile.py), bfloat16 at 64 rows of
    head_dim 128 takes 255 registers and spills 28 bytes on sm_80 with 4 warps, 175 and none
    with 8, and head_dim 256 spills with 4 warps at 16 and 32 rows. 8 warps share the tiles;
    smaller tiles keep 4, which leaves more programs per multiprocessor."""
    return 8 if (block_rows + kv_block_tokens) * head_dim > 12288 else 4


# Keys per inner step where Triton makes the dots tensor-core MMA (sm_80 and newer).
MMA_KV_BLOCK_TOKENS = 64
# ... and where it leaves them to FMA code (sm_75, sm_70), whose operands all sit in registers.
FMA_KV_BLOCK_TOKENS = 16


def choose_tiles(capability: int | None, head_dim: int) -> tuple[int, int | str]:
    """(kv_block_tokens, num_warps) for a GPU of `capability` (None: unknown, taken as one
    with tensor cores). Below sm_80 Triton compiles the two products to FMA code
    (kernels/gpu_info.py), whose operands and accumulator live in registers: with the MMA
    tiles (64 keys, 4 warps) triton 3.9 for sm_75 used 255 registers and spilled 608-1836
    bytes per thread at Llama-8B's decode and prefill steps (sm_70: up to 14 KB); 16 keys over
    8 warps spill nothing at SmolLM2's and Llama-8B's serving shapes (120-230 registers).
    "auto" warps elsewhere: `choose_num_warps`."""
    if capability is not None and capability < gpu_info.TRITON_MMA_MIN_CAPABILITY:
        return FMA_KV_BLOCK_TOKENS, 8
    return MMA_KV_BLOCK_TOKENS, "auto"


def estimate_busy_blocks(num_tokens: int, num_seq_slots: int, block_q: int) -> int:
    """Query blocks that hold real rows when a step's tokens spread over all its sequence
    slots (the grid's other rows exit at once): every sequence's partial block, plus whole
    blocks of the rest, and never more blocks than tokens."""
    return min(num_tokens, num_seq_slots + num_tokens // block_q)


def choose_num_kv_splits(num_q_blocks: int, num_kv_heads: int, max_kv_blocks: int,
                         num_cores: int = FALLBACK_NUM_CORES) -> int:
    """Split the KV range only when the grid without splits would leave the GPU's
    `num_cores` multiprocessors underused, and never into slices shorter than one KV block.
    `num_q_blocks`: query blocks that do work (`estimate_busy_blocks`)."""
    programs = num_q_blocks * num_kv_heads
    splits = -(-(_PROGRAMS_PER_CORE * num_cores) // max(programs, 1))
    return int(max(1, min(splits, max_kv_blocks, _MAX_KV_SPLITS)))


def _query_blocks(cu_q_lens, num_seqs, block_q: int, num_blocks: int):
    """Which sequence, and which of its query blocks, each grid row works on.

    Returns block_seq i32[num_blocks] and block_index i32[num_blocks]; rows past the real
    blocks get block_seq = -1 and do nothing. `num_blocks` is a static upper bound."""
    S = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    real = jnp.arange(S) < num_seqs[0]
    blocks_per_seq = jnp.where(real, (q_lens + block_q - 1) // block_q, 0)
    first_block = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(blocks_per_seq, dtype=jnp.int32)])
    rows = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(first_block, rows, side="right").astype(jnp.int32) - 1, 0, S - 1)
    in_use = rows < first_block[-1]
    return jnp.where(in_use, seq, -1), jnp.where(in_use, rows - first_block[seq], 0)


def _split_refs(refs, *, windowed: bool, with_sinks: bool):
    """The kernel's refs after the metadata: the optional window and sinks inputs (present
    only when the call has them, so a call without them keeps its program), q, the cache,
    the output and, when splitting KV, the log-sum-exps."""
    refs = list(refs)
    window_ref = refs.pop(0) if windowed else None
    sinks_ref = refs.pop(0) if with_sinks else None
    q_ref, kv_ref, o_ref, *lse_refs = refs
    return window_ref, sinks_ref, q_ref, kv_ref, o_ref, lse_refs


def _kernel(block_seq_ref, block_index_ref, kv_lens_ref, page_table_ref, cu_q_lens_ref,  # metadata
            *refs,  # [window_ref] [sinks_ref] q_ref kv_ref (data), o_ref [lse_ref] (outputs)
            sm_scale, windowed, with_sinks, soft_cap, block_q, group, pages_per_block, num_kv_splits):
    """One program: query block `program_id(0)`, KV head `program_id(1)`, KV split `program_id(2)`.

    window_ref i32[1] (when `windowed`); sinks_ref f32[num_kv_heads, rows], each row's sink
    (when `with_sinks`);
    q_ref [T_pad, num_kv_heads, group, head_dim]; kv_ref [num_pages, page_size, 2K, head_dim]
    (head_dim + 2 when quantized); o_ref [splits, T_pad, num_kv_heads, group, head_dim];
    lse_ref [splits, T_pad, K, group]."""
    window_ref, sinks_ref, q_ref, kv_ref, o_ref, lse_refs = _split_refs(
        refs, windowed=windowed, with_sinks=with_sinks)
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = block_seq_ref[b]
    page_size, head_dim = kv_ref.shape[1], q_ref.shape[3]
    quantized = kv_quant.is_quantized(kv_ref.dtype)
    block_kv = pages_per_block * page_size
    rows = block_q * group

    @pl.when(seq >= 0)
    def _():
        q_start_seq = cu_q_lens_ref[seq]
        q_len = cu_q_lens_ref[seq + 1] - q_start_seq
        kv_len = kv_lens_ref[seq]
        first_query = block_index_ref[b] * block_q  # this block's first query, within the sequence
        q_start = q_start_seq + first_query
        window = window_ref[0] if windowed else None

        # Row r is query token r // group, head r % group of this KV head's group.
        token = first_query + jnp.arange(rows, dtype=jnp.int32) // group
        row_valid = token < q_len
        query_pos = kv_len - q_len + token
        last_pos = kv_len - q_len + jnp.minimum(first_query + block_q, q_len) - 1

        # KV blocks any row can see: causal up to the last row, the window from the first.
        first_kv_block = 0
        if windowed:
            first_kv_block = jnp.maximum(kv_len - q_len + first_query - window + 1, 0) // block_kv
        end_kv_block = last_pos // block_kv + 1
        per_split = (end_kv_block - first_kv_block + num_kv_splits - 1) // num_kv_splits
        lo = first_kv_block + split * per_split
        hi = jnp.minimum(lo + per_split, end_kv_block)

        q = q_ref[pl.ds(q_start, block_q), h, :, :].reshape(rows, head_dim)
        precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

        def visit(kv_block, carry):
            m, l, acc = carry
            pages = page_table_ref[seq, pl.ds(kv_block * pages_per_block, pages_per_block)]
            if quantized:
                k, k_scale = _load_quantized(kv_ref, pages, 2 * h, head_dim, q.dtype)
                v, v_scale = _load_quantized(kv_ref, pages, 2 * h + 1, head_dim, q.dtype)
            else:
                k = kv_ref[pages, :, 2 * h, :].reshape(block_kv, head_dim)
                v = kv_ref[pages, :, 2 * h + 1, :].reshape(block_kv, head_dim)
            key_pos = kv_block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
            written = key_pos < kv_len
            if quantized:  # unwritten slots' scales may be NaN too (tests)
                v_scale = jnp.where(written, v_scale, 0.0)
            # Slots past the sequence's end may hold anything (NaN in tests): 0 * NaN is NaN,
            # so those values are replaced before the product, not only weighted by zero.
            v = jnp.where(written[:, None], v, jnp.zeros_like(v))
            s = pltriton.dot(q, k, trans_b=True, precision=precision)  # [rows, block_kv] f32
            s = s * (k_scale * sm_scale)[None, :] if quantized else s * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            visible = (key_pos[None, :] <= query_pos[:, None]) & row_valid[:, None]
            if windowed:
                visible &= key_pos[None, :] > query_pos[:, None] - window
            s = jnp.where(visible, s, _MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = l * alpha + jnp.sum(p, axis=1)
            if quantized:
                p = p * v_scale[None, :]  # scaling P's columns scales V's rows
            acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v, precision=precision)
            return m_new, l, acc

        m, l = jnp.full((rows,), _MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32)
        if with_sinks:
            m, l = _start_from_sinks(sinks_ref[h, :], split)
        init = (m, l, jnp.zeros((rows, head_dim), jnp.float32))
        m, l, acc = jax.lax.fori_loop(lo, hi, visit, init)

        has_keys = l > 0
        out = jnp.where(has_keys[:, None], acc / jnp.where(has_keys, l, 1.0)[:, None], 0.0)
        out = out.reshape(block_q, group, head_dim).astype(o_ref.dtype)
        store_rows = (token < q_len).reshape(block_q, group)
        pltriton.store(o_ref.at[split, pl.ds(q_start, block_q), h, :, :], out,
                       mask=jnp.broadcast_to(store_rows[:, :, None], out.shape))
        if lse_refs:
            lse = jnp.where(has_keys, m + jnp.log(jnp.where(has_keys, l, 1.0)), -jnp.inf)
            pltriton.store(lse_refs[0].at[split, pl.ds(q_start, block_q), h, :],
                           lse.reshape(block_q, group), mask=store_rows)


def _start_from_sinks(sinks, split):
    """The online softmax's starting (max, normaliser) [rows] with each row's sink logit in it:
    a sink is a key whose value is zero, so starting from m = sink, l = exp(sink - m) = 1 adds
    it to the denominator and nothing to the output, and a later larger score rescales it as
    any key's. Only split 0 starts from it, so that the merge counts it once."""
    first = split == 0
    return (jnp.where(first, sinks, jnp.full_like(sinks, _MASK_VALUE)),
            jnp.where(first, jnp.ones_like(sinks), jnp.zeros_like(sinks)))


def _load_quantized(kv_ref, pages, slot, head_dim, dtype):
    """One head slot of a KV block of an 8-bit cache: its values [block_kv, head_dim] in
    `dtype` (exact) and each key's scale float32[block_kv]. Three loads of power-of-two tiles:
    the values, then the scale's low and high bytes."""
    block_kv = pages.shape[0] * kv_ref.shape[1]
    values = kv_ref[pages, :, slot, pl.ds(0, head_dim)].reshape(block_kv, head_dim)
    low = kv_ref[pages, :, slot, head_dim].reshape(block_kv)
    high = kv_ref[pages, :, slot, head_dim + 1].reshape(block_kv)
    scale = kv_quant.bf16_bytes_to_f32(kv_quant.as_int8_bits(low), kv_quant.as_int8_bits(high))
    if values.dtype == jnp.int8:
        return values.astype(dtype), scale
    return kv_quant.e4m3_bits_to_f32(kv_quant.as_int8_bits(values)).astype(dtype), scale


def _merge_splits(partial_out, lse):
    """Combine per-split outputs by their log-sum-exp weights (empty splits weigh zero). With
    sinks, split 0's log-sum-exp holds them (`_start_from_sinks`), so they count once.

    partial_out [splits, T, K, G, D] float32; lse [splits, T, K, G]."""
    top = jnp.max(lse, axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(lse - top)  # exp(-inf) = 0 for empty splits
    total = jnp.sum(weights, axis=0)
    merged = jnp.sum(weights[..., None] * jnp.where(weights[..., None] > 0, partial_out, 0.0), axis=0)
    return merged / jnp.where(total > 0, total, 1.0)[..., None]


def _sinks_by_row(sinks, num_kv_heads: int, group: int, block_q: int):
    """sinks [num_q_heads] as f32[num_kv_heads, block_q * group]: the sink of each row of a
    program (row r is head r % group of its KV head's group), so that a program loads its rows'
    sinks in one contiguous load, with no reshape in the kernel. Padded heads get _MASK_VALUE,
    which weighs nothing next to any score (their rows are dropped anyway)."""
    real_group = sinks.shape[0] // num_kv_heads
    grouped = sinks.astype(jnp.float32).reshape(num_kv_heads, real_group)
    grouped = jnp.pad(grouped, ((0, 0), (0, group - real_group)), constant_values=_MASK_VALUE)
    return jnp.tile(grouped, (1, block_q))


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "soft_cap", "block_rows", "kv_block_tokens", "num_kv_splits",
    "num_warps", "num_stages", "interpret"))
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
    block_rows: int | str = "auto",
    kv_block_tokens: int | str = "auto",
    num_kv_splits: int | str = "auto",
    num_warps: int | str = "auto",
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """The Pallas GPU kernel. `block_rows`: matrix rows per program (query tokens x heads of
    one KV head's group; "auto": `choose_block_rows`); `kv_block_tokens`: keys per inner step
    ("auto": `choose_tiles`, by the GPU's compute capability); `num_warps` ("auto":
    `choose_tiles`, then `choose_num_warps`); `interpret=True` runs the same kernel on any
    backend (tests on CPU). `sliding_window` and `sinks` are data: changing them compiles
    nothing."""
    check_inputs(q, kv_pages, metadata, sliding_window=sliding_window, sinks=sinks)
    kv_lens, page_table, cu_q_lens, num_seqs = (
        metadata.kv_lens, metadata.page_table, metadata.cu_q_lens, metadata.num_seqs)
    T, num_q_heads, head_dim = q.shape
    _, page_size, two_kv_heads, _ = kv_pages.shape
    num_kv_heads = two_kv_heads // 2
    S, max_pages = page_table.shape
    group = _next_power_of_2(num_q_heads // num_kv_heads)
    if block_rows == "auto":
        block_rows = choose_block_rows(T, S, head_dim)
    if kv_block_tokens == "auto" or num_warps == "auto":
        # The GPU this traces for (under an abstract mesh from a CPU: none, so sm_80+ tiles).
        tiles = choose_tiles(gpu_info.compute_capability(jax.devices()[0]), head_dim)
        kv_block_tokens = tiles[0] if kv_block_tokens == "auto" else kv_block_tokens
        num_warps = tiles[1] if num_warps == "auto" else num_warps
    block_q = max(1, block_rows // group)
    if num_warps == "auto":
        num_warps = choose_num_warps(block_q * group, kv_block_tokens, head_dim)
    pages_per_block = max(1, kv_block_tokens // page_size)
    num_q_blocks = -(-T // block_q) + S  # every sequence may leave one partial block
    max_kv_blocks = -(-max_pages // pages_per_block)
    splits = (choose_num_kv_splits(estimate_busy_blocks(T, S, block_q), num_kv_heads, max_kv_blocks,
                                   num_cores(jax.devices()[0]))
              if num_kv_splits == "auto" else int(num_kv_splits))

    # Queries as [T + block_q, K, group (padded to a power of two), D]: a block that starts on
    # a sequence's last token reads whole rows, and padded heads are computed then dropped.
    real_group = num_q_heads // num_kv_heads
    qg = q.reshape(T, num_kv_heads, real_group, head_dim)
    qg = jnp.pad(qg, ((0, block_q), (0, 0), (0, group - real_group), (0, 0)))
    # Room for the last KV block's page-table slice, pointing at the padding page. Entries are
    # clamped into the pool: a KV block reads every entry of its slice, also those past a
    # sequence's last page, and a GPU gather has no bounds check.
    page_table = jnp.clip(page_table, 0, kv_pages.shape[0] - 1)
    page_table = jnp.pad(page_table, ((0, 0), (0, max_kv_blocks * pages_per_block - max_pages)))
    block_seq, block_index = _query_blocks(cu_q_lens, num_seqs, block_q, num_q_blocks)
    # Optional inputs, present only when used (a call without them keeps its program): the
    # window as i32[1], the sinks as f32[K, rows], each program row's own.
    windowed, with_sinks = sliding_window is not None, sinks is not None
    optional_inputs = []
    if windowed:
        optional_inputs.append(jnp.asarray(sliding_window, jnp.int32).reshape(1))
    if with_sinks:
        optional_inputs.append(_sinks_by_row(sinks, num_kv_heads, group, block_q))

    out_dtype = q.dtype if splits == 1 else jnp.float32
    out_shape = [jax.ShapeDtypeStruct((splits, T + block_q, num_kv_heads, group, head_dim), out_dtype)]
    if splits > 1:
        out_shape.append(jax.ShapeDtypeStruct((splits, T + block_q, num_kv_heads, group), jnp.float32))
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, windowed=windowed, with_sinks=with_sinks, soft_cap=soft_cap,
        block_q=block_q, group=group, pages_per_block=pages_per_block, num_kv_splits=splits)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_q_blocks, num_kv_heads, splits),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(block_seq, block_index, kv_lens, page_table, cu_q_lens, *optional_inputs, qg, kv_pages)

    out = outs[0][0] if splits == 1 else _merge_splits(outs[0], outs[1])
    out = out[:T, :, :real_group].reshape(T, num_q_heads, head_dim)
    # Rows of padding tokens were never written: give them the reference's zeros.
    is_real_token = jnp.arange(T) < cu_q_lens[num_seqs[0]]
    return jnp.where(is_real_token[:, None, None], out, 0).astype(q.dtype)
