"""`orca_jax.kernels`: choosing the attention implementation, and the engine running on it."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from orca_jax import SamplingParams
from orca_jax import kernels
from orca_jax.kernels.testing import MIXES, assert_matches_oracle, make_case


@pytest.mark.parametrize("backend,expected", [("gpu", "pallas_gpu"), ("cuda", "pallas_gpu"),
                                              ("tpu", "pallas_tpu"), ("cpu", "cpu"), ("other", "reference")])
def test_auto_picks_the_kernel_of_the_backend(backend, expected, caplog):
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        assert kernels.resolve_impl("auto", backend=backend) == expected
    assert f"attention implementation: {expected}" in caplog.text


def test_explicit_choice_overrides_auto():
    assert kernels.resolve_impl("reference", backend="gpu") == "reference"
    assert kernels.resolve_impl("reference", backend="cpu") == "reference"
    assert kernels.resolve_impl("pallas_gpu", backend="gpu") == "pallas_gpu"
    assert kernels.resolve_impl("cpu", backend="gpu") == "cpu"  # pure jnp: runs anywhere


def test_cpu_kernel_is_dispatched_with_its_results():
    """impl="cpu" runs the CPU kernel: the float64 oracle's answer, and the same numbers as
    calling the kernel module directly."""
    from orca_jax.kernels import ragged_paged_attention_cpu as cpu

    case = make_case(2, MIXES["chunked"], num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=16)
    arrays = case.q, case.kv_pages, case.metadata
    out = kernels.ragged_paged_attention(*arrays, sm_scale=0.125, sliding_window=40, impl="cpu")
    assert_matches_oracle(out, case, sm_scale=0.125, sliding_window=40, tol=1e-5)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(cpu.ragged_paged_attention(
        *arrays, sm_scale=0.125, sliding_window=40)))


def test_impossible_choices_fail_clearly(caplog):
    with pytest.raises(ValueError, match="only on TPU"):
        kernels.resolve_impl("pallas_tpu", backend="cpu")
    with pytest.raises(ValueError, match="not available"):
        kernels.resolve_impl("flash", backend="gpu")
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.resolve_impl("pallas_gpu", backend="cpu") == "pallas_gpu"
    assert "interpret mode" in caplog.text


def test_pallas_gpu_hands_unsupported_head_dims_to_the_reference(caplog):
    kernels._log_fallback_once.cache_clear()
    case = make_case(3, MIXES["mixed"], num_q_heads=4, num_kv_heads=2, head_dim=80, page_size=16)
    arrays = case.q, case.kv_pages, case.metadata
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        out = kernels.ragged_paged_attention(*arrays, sm_scale=0.1, impl="pallas_gpu")
    np.testing.assert_array_equal(np.asarray(out),
                                  np.asarray(kernels.ragged_paged_attention(*arrays, sm_scale=0.1,
                                                                            impl="reference")))
    assert "head_dim 80" in caplog.text


def test_metadata_is_taken_whole():
    case = make_case(4, MIXES["decode"], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    m = case.metadata
    loose = (m.kv_lens, m.page_table, m.cu_q_lens, m.num_seqs)
    with pytest.raises(TypeError, match="AttentionMetadata"):
        kernels.ragged_paged_attention(case.q, case.kv_pages, loose, sm_scale=0.1, impl="reference")


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas_gpu"])
def test_soft_cap_reaches_the_kernel(impl):
    """The dispatcher hands soft_cap on: capped scores match the float64 oracle with the cap,
    and the answer is not the uncapped one (large queries push scores far past the cap)."""
    case = make_case(8, MIXES["mixed"], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, q_scale=3.0)
    arrays = case.q, case.kv_pages, case.metadata
    capped = kernels.ragged_paged_attention(*arrays, sm_scale=0.125, soft_cap=2.0, impl=impl)
    assert_matches_oracle(capped, case, sm_scale=0.125, soft_cap=2.0, tol=1e-5)
    uncapped = kernels.ragged_paged_attention(*arrays, sm_scale=0.125, impl=impl)
    assert_matches_oracle(uncapped, case, sm_scale=0.125, tol=1e-5)
    n = case.num_real_tokens
    assert np.max(np.abs(np.asarray(capped)[:n] - np.asarray(uncapped)[:n])) > 0.1


PROMPTS = [[5, 9, 13, 2, 7, 1, 3, 8, 22, 40, 11, 6, 4, 19, 30, 2, 2, 9, 17, 12, 3],
           [3, 1, 4, 1, 5], [27, 18, 28, 18, 28, 45, 90, 45, 23, 53, 60, 28, 74, 71, 35, 26, 62]]


def greedy_tokens_on(factory, attention_impl: str) -> tuple[dict, str]:
    """Greedy tokens of PROMPTS through the whole engine (chunked prefills mixed with decodes,
    preemption-free) on one attention implementation, and the implementation it resolved."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = factory(attention_impl=attention_impl, max_num_batched_tokens=16, warmup=False)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert all(len(tokens) == 12 for tokens in done.values())
    return done, engine.attention_impl


_REFERENCE_RUN: dict = {}


@pytest.mark.parametrize("impl,auto_on_cpu", [("pallas_gpu", False), ("cpu", True)])
def test_engine_on_a_kernel_matches_the_reference(tiny_engine_factory, caplog, impl, auto_on_cpu):
    """The whole engine on the GPU kernel (interpret mode) or the CPU kernel gives the
    reference's greedy tokens; on a CPU, "auto" is the CPU kernel."""
    kernels._log_fallback_once.cache_clear()
    caplog.set_level(logging.WARNING, logger=kernels.__name__)
    if "reference" not in _REFERENCE_RUN:  # the same for both kernels: run it once
        _REFERENCE_RUN["reference"] = greedy_tokens_on(tiny_engine_factory, "reference")
    expected, resolved = _REFERENCE_RUN["reference"]
    assert resolved == "reference"
    requested = "auto" if auto_on_cpu and jax.default_backend() == "cpu" else impl
    tokens, resolved = greedy_tokens_on(tiny_engine_factory, requested)
    assert resolved == impl
    assert "cannot serve" not in caplog.text  # the kernel ran, not the reference behind it
    assert tokens == expected
