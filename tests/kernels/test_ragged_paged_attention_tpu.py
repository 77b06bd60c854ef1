"""The TPU path around jax's own ragged paged attention kernel.

The kernel itself runs only on a TPU (Pallas' CPU interpreter cannot run it), so these tests
cover what surrounds it: which shapes it serves, the block sizes handed to it, the arguments
it receives, and the dispatcher's reference fallback for the shapes it cannot take.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax import kernels
from orca_jax.kernels import ragged_paged_attention_tpu as tpu
from orca_jax.kernels import reference
from orca_jax.kernels.testing import MIXES, make_case


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,dtype,served", [
    (32, 8, 128, jnp.bfloat16, True),    # Llama-3-8B
    (8, 2, 128, jnp.float32, True),
    (14, 2, 64, jnp.bfloat16, False),    # Qwen2.5-0.5B: head_dim 64
    (9, 3, 64, jnp.float32, False),      # SmolLM2-135M: head_dim 64
    (12, 3, 128, jnp.bfloat16, False),   # 6 K/V slots do not tile bfloat16 sublanes
])
def test_support_rule(num_q_heads, num_kv_heads, head_dim, dtype, served):
    reason = tpu.unsupported_reason(num_q_heads, num_kv_heads, head_dim, dtype, dtype)
    assert (reason is None) == served, reason
    if head_dim % 128:
        assert f"head_dim {head_dim}" in reason


def test_block_sizes_follow_the_tuning_table_and_are_clamped():
    q = jnp.zeros((64, 8, 128), jnp.bfloat16)
    kv_pages = jnp.zeros((10, 16, 4, 128), jnp.bfloat16)
    page_table = jnp.zeros((8, 4), jnp.int32)
    seen = []

    def lookup(*key):
        seen.append(key)
        return 128, 32  # more pages per block than this step's page table has

    assert tpu.block_sizes(q, kv_pages, page_table, tuned_lookup=lookup) == (4, 32)
    # The key is jax's: (q dtype, kv dtype, q heads, kv heads, head_dim, page size, tokens, pages/seq).
    assert seen == [(jnp.bfloat16, jnp.bfloat16, 8, 2, 128, 16, 64, 4)]
    assert tpu.block_sizes(q[:16], kv_pages, page_table, tuned_lookup=lambda *k: (2, 64)) == (2, 16)


class _RecordingTpuOps:
    """Stands in for jax.experimental.pallas.ops.tpu.ragged_paged_attention."""

    def __init__(self):
        self.calls = []
        self.kernel = None  # no tiling helper: the support rule checks head_dim only

    def get_tuned_block_sizes(self, *key):
        return 8, 16

    def ragged_paged_attention(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return jnp.zeros_like(args[0])


def test_served_shapes_go_to_jax_kernel_with_our_arrays_unchanged(monkeypatch):
    ops = _RecordingTpuOps()
    monkeypatch.setattr(tpu, "_tpu_ops", lambda: ops)
    # Off a TPU (this CPU) the block sizes come from the lookup for an abstract TPU.
    monkeypatch.setattr(tpu, "cross_host_tuned_lookup", ops.get_tuned_block_sizes)
    case = make_case(0, MIXES["mixed"], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    m = case.metadata
    tpu.ragged_paged_attention(case.q, case.kv_pages, m, sm_scale=0.1, sliding_window=64, soft_cap=30.0)
    (args, kwargs), = ops.calls
    # jax's positional order; the layout is shared: no copy, no transpose.
    given = (case.q, case.kv_pages, m.kv_lens, m.page_table, m.cu_q_lens, m.num_seqs)
    assert len(args) == len(given)
    for got, expected in zip(args, given):
        assert got is expected
    assert kwargs == dict(sm_scale=0.1, sliding_window=64, soft_cap=30.0,
                          num_kv_pages_per_block=8, num_queries_per_block=16)


def test_other_shapes_fall_back_to_the_reference_and_say_why_once(caplog):
    kernels._log_fallback_once.cache_clear()
    case = make_case(1, MIXES["chunked"], num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=16)
    arrays = case.q, case.kv_pages, case.metadata
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        out = kernels.ragged_paged_attention(*arrays, sm_scale=0.125, impl="pallas_tpu")
        kernels.ragged_paged_attention(*arrays, sm_scale=0.125, impl="pallas_tpu")
    expected = reference.ragged_paged_attention(*arrays, sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "head_dim 64" in messages[0]
