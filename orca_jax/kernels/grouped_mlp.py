"""The experts of a mixture-of-experts layer as grouped matmuls: rows sorted by expert, each
group of rows through its own expert's gated MLP, `down(act(rows @ gate[g]) * (rows @ up[g]))`.

    impl          runs on            how
    "ragged_dot"  GPUs, TPUs         three `jax.lax.ragged_dot` calls, which XLA lowers to its
                                     grouped GEMM on GPU and to Mosaic's grouped matmul on TPU
    "blocked"     CPUs ("auto")      one loop over blocks of rows that each belong to a single
                                     expert (each group padded to whole blocks, as vLLM's fused
                                     MoE kernel aligns them); the three matmuls of a block run
                                     back to back on that expert's weights

Why a second implementation: on CPU, `ragged_dot` has no lowering of its own and falls back to
jax's generic one, which expands the rows to a dense `[groups, rows, hidden]` array masked per
group and multiplies all of it: every expert's weights against every row, `groups` times the
FLOPs. The blocked loop computes each used block once and skips the rest (its trip count is
data, its shapes are not, so one program serves every routing). On CPU the dense expansion
makes `ragged_dot` the oracle of the tests, not a serving path.

Both take rows past `sum(group_sizes)` as belonging to no group (another device's experts,
padding tokens) and return zeros for them.

Expert weights come as float stacks or packed 4-bit (`packed4.PackedWeight`, gpt-oss's MXFP4
experts, a quarter of bfloat16's bytes). The blocked loop unpacks only the expert of the block
at hand, so no float copy of the layer's experts ever exists; `ragged_dot` takes float weights
only, so that path unpacks the layer's experts into one transient stack per step (the bytes
stay 4-bit at rest; a fused grouped matmul over packed weights is the GPU/TPU kernel still to
write). gpt-oss adds per-expert biases on the gate and up projections and its own gated
activation (`glu`).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from orca_jax.kernels.packed4 import PackedWeight

IMPLS = ("ragged_dot", "blocked")
_IMPL_FOR_BACKEND = {"cpu": "blocked", "gpu": "ragged_dot", "cuda": "ragged_dot", "tpu": "ragged_dot"}


def resolve_impl(impl: str, backend: str) -> str:
    """`impl`, or for "auto" the implementation built for `backend`."""
    if impl == "auto":
        return _IMPL_FOR_BACKEND.get(backend, "blocked")
    if impl not in IMPLS:
        raise ValueError(f"unknown grouped MLP implementation {impl!r}; available: auto, {', '.join(IMPLS)}")
    return impl


def grouped_mlp(rows, group_sizes, gate, up, down, act: Callable, impl: str, *, gate_bias=None, up_bias=None,
                glu: Callable | None = None):
    """rows [M, D] sorted by group; group_sizes i32[G] (their sum may be below M); gate, up
    [G, D, F] and down [G, F, D], each a float stack or a `PackedWeight` of the same matrices;
    gate_bias, up_bias [G, F] or None. Each group's rows go through
    `down(glu(rows @ gate + gate_bias, rows @ up + up_bias))`, `glu(g, u)` being `act(g) * u`
    unless given. Returns [M, D], zero past the groups' rows."""
    glu = glu or (lambda g, u: act(g) * u)
    if impl == "ragged_dot":
        return _ragged_dot_mlp(rows, group_sizes, gate, up, down, glu, gate_bias, up_bias)
    if impl == "blocked":
        return _blocked_mlp(rows, group_sizes, gate, up, down, glu, gate_bias, up_bias)
    raise ValueError(f"unknown grouped MLP implementation {impl!r}; available: {', '.join(IMPLS)}")


def grouped_matmul(lhs, rhs, group_sizes, impl: str):
    """One grouped matmul: lhs [M, K] sorted by group, rhs [G, K, N] (or a `PackedWeight`) ->
    [M, N] (zero past the groups' rows). The MLP above is three of these; this one is what the
    benchmark times."""
    if impl == "ragged_dot":
        out = jax.lax.ragged_dot(lhs, _stacked(rhs, lhs.dtype), group_sizes)
        return jnp.where(_in_groups(lhs.shape[0], group_sizes)[:, None], out, 0)
    block_rows = block_rows_for(lhs.shape[0], groups_of(rhs))
    return _block_loop(lhs, group_sizes, block_rows, _out_dim(rhs),
                       lambda block, g: block @ _matrix(rhs, g, block.dtype))


def groups_of(weight) -> int:
    """The groups (experts) of a float stack or a `PackedWeight`."""
    return weight.num_groups if isinstance(weight, PackedWeight) else weight.shape[0]


def _out_dim(weight) -> int:
    return weight.blocks.shape[1] if isinstance(weight, PackedWeight) else weight.shape[2]


def _matrix(weight, group, dtype):
    """Group `group`'s [K, N] matrix (unpacked if packed)."""
    if isinstance(weight, PackedWeight):
        return weight.matrix(group, dtype)
    return jnp.asarray(weight)[group]


def _stacked(weight, dtype):
    return weight.stacked(dtype) if isinstance(weight, PackedWeight) else weight


def _in_groups(num_rows: int, group_sizes):
    return jnp.arange(num_rows) < jnp.sum(group_sizes)


def _row_bias(bias, group_sizes, num_rows: int):
    """Each sorted row's group's bias row: bias [G, F] -> [M, F] (rows past the groups get the
    last group's, masked out afterwards)."""
    group_of_row = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(num_rows), side="right")
    return bias[jnp.minimum(group_of_row, bias.shape[0] - 1)]


def _ragged_dot_mlp(rows, group_sizes, gate, up, down, glu, gate_bias, up_bias):
    dtype = rows.dtype
    g = jax.lax.ragged_dot(rows, _stacked(gate, dtype), group_sizes)
    u = jax.lax.ragged_dot(rows, _stacked(up, dtype), group_sizes)
    if gate_bias is not None:
        g = g + _row_bias(gate_bias, group_sizes, rows.shape[0]).astype(g.dtype)
    if up_bias is not None:
        u = u + _row_bias(up_bias, group_sizes, rows.shape[0]).astype(u.dtype)
    out = jax.lax.ragged_dot(glu(g, u).astype(dtype), _stacked(down, dtype), group_sizes)
    # Rows past the groups are left to the lowering (zero in jax's, unspecified in others).
    return jnp.where(_in_groups(rows.shape[0], group_sizes)[:, None], out, 0)


def block_rows_for(num_rows: int, num_groups: int) -> int:
    """Rows per block: the mean group size plus two standard deviations of a uniform routing's
    (binomial: about sqrt(mean)), rounded up to a multiple of 8, from 8 to 256. Most groups then
    fit one block: a power of two at the mean left half of them spilling into a second, mostly
    empty block (1.4-1.6x the rows computed at prefill; this rule measured 6-25% faster there,
    docs/benchmarks.md). Small blocks waste little when most experts hold a row or two (decode).
    Static: the bucket's row count decides it, so it adds no program."""
    mean = num_rows / num_groups
    size = math.ceil((mean + 2 * math.sqrt(mean)) / 8) * 8
    return min(max(size, 8), 256)


def _blocked_mlp(rows, group_sizes, gate, up, down, glu, gate_bias, up_bias):
    block_rows = block_rows_for(rows.shape[0], groups_of(gate))

    def expert_mlp(block, g):
        dtype = block.dtype
        gate_out, up_out = block @ _matrix(gate, g, dtype), block @ _matrix(up, g, dtype)
        if gate_bias is not None:
            gate_out = gate_out + gate_bias[g].astype(dtype)
        if up_bias is not None:
            up_out = up_out + up_bias[g].astype(dtype)
        return glu(gate_out, up_out).astype(dtype) @ _matrix(down, g, dtype)

    return _block_loop(rows, group_sizes, block_rows, _out_dim(down), expert_mlp)


def _block_loop(rows, group_sizes, block_rows: int, out_dim: int, block_fn: Callable):
    """Run `block_fn(block [block_rows, K], group) -> [block_rows, out_dim]` over every block of
    every group, in order, and put each block's own rows of the result in place.

    Each group's rows start a new block: group g covers blocks [pstart_g, pend_g) of the padded
    layout, and its i-th block reads rows start_g + i * block_rows onwards. Rows are read from
    the sorted array directly (padded at the end so a slice never runs off it) rather than
    copied into a padded buffer, whose static size would be rows + groups * block_rows."""
    num_rows = rows.shape[0]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    padded_sizes = (group_sizes + block_rows - 1) // block_rows * block_rows
    padded_ends = jnp.cumsum(padded_sizes)
    padded_starts = padded_ends - padded_sizes
    num_blocks = padded_ends[-1] // block_rows
    rows = jnp.concatenate([rows, jnp.zeros((block_rows, rows.shape[1]), rows.dtype)])
    out = jnp.zeros((num_rows + block_rows, out_dim), rows.dtype)
    row_offsets = jnp.arange(block_rows)

    def body(block_index, out):
        padded_row = block_index * block_rows
        g = jnp.searchsorted(padded_ends, padded_row, side="right")
        first = starts[g] + padded_row - padded_starts[g]
        block = jax.lax.dynamic_slice_in_dim(rows, first, block_rows)
        result = block_fn(block, g).astype(out.dtype)
        # Only the block's own rows are written: the rest of the slice belongs to the next group
        # (written by its own blocks, later) or to no group (left zero).
        mine = (first + row_offsets < ends[g])[:, None]
        current = jax.lax.dynamic_slice_in_dim(out, first, block_rows)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, result, current), first, 0)

    out = jax.lax.fori_loop(0, num_blocks, body, out)
    return out[:num_rows]
