"""Per-layer windows (traced inside the model's layer scan) and attention sinks, in the
reference and the CPU kernel, against the float64 oracle of `kernels/testing.py` (the GPU
kernel's own tests cover it in Pallas' interpreter; jax's TPU kernel takes neither, and the
dispatcher hands such models to the reference, saying why once).

Tolerances as the kernels' own tests: float32 1e-5, bfloat16 2e-2 (relative and absolute).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax import kernels
from orca_jax.kernels import ragged_paged_attention_cpu as cpu
from orca_jax.kernels import reference
from orca_jax.kernels.testing import MIXES, assert_matches_oracle, make_case

TOLERANCES = {"float32": 1e-5, "bfloat16": 2e-2}
SMALL_BLOCKS = dict(decode_block_tokens=8, q_block=8, kv_block_tokens=8)
IMPLS = {
    "reference": reference.ragged_paged_attention,
    "cpu": cpu.ragged_paged_attention,
    "cpu_small_blocks": functools.partial(cpu.ragged_paged_attention, **SMALL_BLOCKS),
}


def _sinks(num_heads: int, seed: int = 0) -> np.ndarray:
    # Around the scores' size, so the sink takes a real share of each row's mass.
    return np.random.default_rng(seed).normal(0.0, 2.0, num_heads).astype(np.float32)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("mix, window, cap", [("mixed", None, None), ("chunked", 20, 5.0), ("decode", 9, None)])
def test_sinks_match_the_oracle(impl, mix, window, cap):
    case = make_case(11, MIXES[mix], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=8)
    sinks = _sinks(8)
    out = IMPLS[impl](case.q, case.kv_pages, case.metadata, sm_scale=0.125, sliding_window=window, soft_cap=cap,
                      sinks=jnp.asarray(sinks))
    assert_matches_oracle(out, case, sm_scale=0.125, sliding_window=window, soft_cap=cap, sinks=sinks,
                          tol=TOLERANCES["float32"])


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_sinks_in_bfloat16(impl):
    case = make_case(5, MIXES["mixed"], num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
                     dtype=jnp.bfloat16)
    sinks = _sinks(4, seed=1)
    out = IMPLS[impl](case.q, case.kv_pages, case.metadata, sm_scale=0.125, sinks=jnp.asarray(sinks))
    assert_matches_oracle(out, case, sm_scale=0.125, sinks=sinks, tol=TOLERANCES["bfloat16"])


def test_sinks_take_mass_from_every_row():
    """Guards the cases above: with sinks the output really differs from without."""
    case = make_case(11, MIXES["mixed"], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=8)
    with_sinks = cpu.ragged_paged_attention(case.q, case.kv_pages, case.metadata, sm_scale=0.125,
                                            sinks=jnp.asarray(_sinks(8)))
    without = cpu.ragged_paged_attention(case.q, case.kv_pages, case.metadata, sm_scale=0.125)
    n = case.num_real_tokens
    assert np.abs(np.asarray(with_sinks)[:n] - np.asarray(without)[:n]).max() > 1e-2


@pytest.mark.parametrize("impl", list(IMPLS))
def test_traced_window_matches_the_static_one_in_one_program(impl):
    """A layer's window as the scan passes it (traced i32[]) gives the static window's answer,
    FULL_ATTENTION_WINDOW (a full layer's) gives full attention, and all of them run one
    compiled program."""
    case = make_case(3, MIXES["chunked"], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    run = jax.jit(lambda w, q, kv, md: IMPLS[impl](q, kv, md, sm_scale=0.125, sliding_window=w))
    for window in (1, 9, 40, kernels.FULL_ATTENTION_WINDOW):
        out = run(jnp.int32(window), case.q, case.kv_pages, case.metadata)
        static = None if window == kernels.FULL_ATTENTION_WINDOW else window
        assert_matches_oracle(out, case, sm_scale=0.125, sliding_window=static, tol=TOLERANCES["float32"])
    assert run._cache_size() == 1


# The KV block each implementation reads whole (a block the window starts inside is read, and
# masked): the reference's and the CPU kernel's prefill blocks (the CPU decode pass gathers
# only visible keys).
KV_BLOCK = {"reference": 64, "cpu": 128, "cpu_small_blocks": 8}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_a_windowed_layer_reads_only_its_window(impl):
    """Keys in the blocks before every query's window are set to NaN: an implementation that
    read them (multiplied by a zero probability or not) would return NaN."""
    window, block = 16, KV_BLOCK[impl]
    case = make_case(6, [(1, 600), (1, 460), (24, 520)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    kv_lens, page_table, cu = (np.asarray(a) for a in (case.metadata.kv_lens, case.metadata.page_table,
                                                        case.metadata.cu_q_lens))
    kv_pages = np.array(case.kv_pages)
    page_size = kv_pages.shape[1]
    for s in range(3):
        first_query = kv_lens[s] - (cu[s + 1] - cu[s])
        poisoned = ((first_query - window + 1) // block) * block
        assert poisoned >= 256  # most of the context
        for pos in range(poisoned):
            kv_pages[page_table[s, pos // page_size], pos % page_size] = np.nan
    case.kv_pages = kv_pages
    run = jax.jit(lambda w, q, kv, md: IMPLS[impl](q, kv, md, sm_scale=0.125, sliding_window=w))
    out = run(jnp.int32(window), case.q, case.kv_pages, case.metadata)
    assert_matches_oracle(out, case, sm_scale=0.125, sliding_window=window, tol=TOLERANCES["float32"])


def test_tpu_kernel_refuses_traced_windows_and_sinks_saying_why():
    from orca_jax.kernels import ragged_paged_attention_tpu as tpu

    assert "static int" in tpu.unsupported_reason(8, 8, 128, jnp.bfloat16, jnp.bfloat16, traced_window=True)
    assert "sinks" in tpu.unsupported_reason(8, 8, 128, jnp.bfloat16, jnp.bfloat16, has_sinks=True)
    assert tpu.unsupported_reason(8, 8, 128, jnp.bfloat16, jnp.bfloat16) is None


def test_dispatcher_sends_what_a_kernel_cannot_take_to_the_reference(monkeypatch, caplog):
    """pallas_tpu cannot run here, so stand in for it with a kernel that must not be called:
    a model with sinks goes to the reference, with one warning naming why."""
    case = make_case(2, MIXES["mixed"], num_q_heads=8, num_kv_heads=8, head_dim=128, page_size=16,
                     dtype=jnp.bfloat16)
    monkeypatch.setitem(kernels._IMPLS, "pallas_tpu", lambda *a, **k: pytest.fail("the TPU kernel was called"))
    kernels._log_fallback_once.cache_clear()
    sinks = _sinks(8)
    with caplog.at_level(logging.WARNING, logger="orca_jax.kernels"):
        for _ in range(2):
            out = kernels.ragged_paged_attention(case.q, case.kv_pages, case.metadata, sm_scale=0.1,
                                                 sinks=jnp.asarray(sinks), impl="pallas_tpu")
    assert len([r for r in caplog.records if "sinks" in r.getMessage()]) == 1
    assert_matches_oracle(out, case, sm_scale=0.1, sinks=sinks, tol=TOLERANCES["bfloat16"])
