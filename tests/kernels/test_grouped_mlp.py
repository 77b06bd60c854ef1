"""The grouped expert MLP (orca_jax/kernels/grouped_mlp.py): the blocked loop (the CPU path) and
`ragged_dot` (GPU/TPU; on CPU jax's generic lowering) against a float64 numpy reference that
runs each group's rows through its own expert. Float32 inputs of unit scale; tolerance 1e-4
absolute on outputs of magnitude ~10 (float32 summation over D = 32 and F = 48 terms)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from orca_jax.kernels import grouped_mlp

ATOL = 1e-4
D, F = 32, 48


def reference(rows, group_sizes, gate, up, down):
    rows, gate, up, down = (np.asarray(a, np.float64) for a in (rows, gate, up, down))
    out = np.zeros((rows.shape[0], down.shape[2]))
    start = 0
    for g, size in enumerate(group_sizes):
        x = rows[start:start + size]
        h = x @ gate[g]
        out[start:start + size] = (h / (1 + np.exp(-h)) * (x @ up[g])) @ down[g]
        start += size
    return out


def random_case(rng, group_sizes, num_rows):
    G = len(group_sizes)
    rows = rng.standard_normal((num_rows, D)).astype(np.float32)
    gate, up = (rng.standard_normal((G, D, F)).astype(np.float32) / np.sqrt(D) for _ in range(2))
    down = rng.standard_normal((G, F, D)).astype(np.float32) / np.sqrt(F)
    return rows, np.asarray(group_sizes, np.int32), gate, up, down


@pytest.mark.parametrize("impl", grouped_mlp.IMPLS)
@pytest.mark.parametrize("group_sizes, num_rows", [
    ([3, 0, 17, 1, 9], 37),  # empty groups, and rows past the groups (another shard's, padding)
    ([100, 150, 40], 290),  # groups of many blocks (block_rows 128)
    ([0, 0, 0, 0], 8),  # no row for this shard at all
    ([0, 600], 600),  # one group takes everything
    ([1] * 16, 16),  # decode: a row per expert
])
def test_matches_the_reference(impl, group_sizes, num_rows):
    case = random_case(np.random.default_rng(len(group_sizes) + num_rows), group_sizes, num_rows)
    run = jax.jit(lambda *a: grouped_mlp.grouped_mlp(*a, act=jax.nn.silu, impl=impl))
    out = np.asarray(run(*case))
    np.testing.assert_allclose(out, reference(*case), atol=ATOL, rtol=0)
    assert not out[sum(group_sizes):].any()  # rows past the groups are zero


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=9), st.integers(0, 30))
def test_blocked_equals_the_reference_for_any_grouping(group_sizes, spare_rows):
    case = random_case(np.random.default_rng(sum(group_sizes)), group_sizes, sum(group_sizes) + spare_rows)
    out = grouped_mlp.grouped_mlp(*(jnp.asarray(a) for a in case), act=jax.nn.silu, impl="blocked")
    np.testing.assert_allclose(np.asarray(out), reference(*case), atol=ATOL, rtol=0)


@pytest.mark.parametrize("impl", grouped_mlp.IMPLS)
def test_one_grouped_matmul(impl):
    rng = np.random.default_rng(0)
    sizes = np.array([5, 0, 30, 2], np.int32)
    lhs = rng.standard_normal((40, D)).astype(np.float32)
    rhs = rng.standard_normal((4, D, F)).astype(np.float32)
    expected = np.zeros((40, F))
    for g, (start, size) in enumerate(zip(np.cumsum(sizes) - sizes, sizes)):
        expected[start:start + size] = lhs[start:start + size].astype(np.float64) @ rhs[g]
    out = jax.jit(lambda a, b, s: grouped_mlp.grouped_matmul(a, b, s, impl))(lhs, rhs, sizes)
    np.testing.assert_allclose(np.asarray(out), expected, atol=ATOL, rtol=0)


def test_one_program_serves_every_routing():
    """The loop's trip count is data: new group sizes reuse the compiled program."""
    rng = np.random.default_rng(1)
    run = jax.jit(lambda *a: grouped_mlp.grouped_mlp(*a, act=jax.nn.silu, impl="blocked"))
    for sizes in ([8, 8, 8, 8], [32, 0, 0, 0], [1, 2, 3, 4]):
        run(*random_case(rng, sizes, 32))
    assert run._cache_size() == 1


def test_block_rows_follow_the_mean_group_size():
    assert grouped_mlp.block_rows_for(16, 128) == 8  # decode over many experts: the floor
    assert grouped_mlp.block_rows_for(1024, 8) == 152  # prefill over few: 128 + 2 * sqrt(128), to 8s
    assert grouped_mlp.block_rows_for(4096, 64) == 80  # 64 + 16
    assert grouped_mlp.block_rows_for(100_000, 2) == 256  # capped


def test_auto_picks_by_backend():
    assert grouped_mlp.resolve_impl("auto", "cpu") == "blocked"
    assert grouped_mlp.resolve_impl("auto", "gpu") == "ragged_dot"
    assert grouped_mlp.resolve_impl("auto", "tpu") == "ragged_dot"
    with pytest.raises(ValueError, match="unknown grouped MLP implementation 'dense'"):
        grouped_mlp.resolve_impl("dense", "cpu")
