"""Quantized weights (orca_jax/kernels/quantization.py): each format's round trip within its bound, the
quantized product against a float64 reference, GGUF blocks kept exactly, the quantized tree as
the model declares it, no float copy of the stacked weights in the step, and the engine and
checkpoints running them."""

from __future__ import annotations

import copy
import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax import models
from orca_jax.distributed import parallel
from orca_jax.kernels import quantization
from orca_jax.config import ModelConfig
from orca_jax.models.layers import Einsum

RNG = np.random.default_rng(0)


def _weights(*shape, outliers: bool = True) -> np.ndarray:
    w = RNG.standard_normal(shape).astype(np.float32) * 0.05
    if outliers:  # a few large weights, as real checkpoints have, so scales differ per channel
        w.reshape(-1)[RNG.integers(0, w.size, 8)] *= 20
    return w


# ---- round trips ------------------------------------------------------------------------------
def test_int8_round_trip_is_within_half_a_step_per_output_channel():
    w = _weights(2, 64, 4, 16)  # [layers, D, N, H]: contraction D, output channels N x H
    q = quantization.quantize_kernel(w, num_lead=1, num_contract=1, method="int8")
    assert q["kernel"].dtype == np.int8 and q["qscale"].shape == (2, 1, 4, 16)
    amax = np.abs(w).max(axis=1, keepdims=True)
    np.testing.assert_allclose(q["qscale"], amax / 127, rtol=1e-6)
    error = np.abs(quantization.dequantize_kernel_np(q, num_lead=1) - w)
    assert np.all(error <= q["qscale"] / 2 + 1e-7)
    assert np.abs(q["kernel"]).max() == 127  # each channel's largest weight uses the full range


def test_fp8_round_trip_keeps_three_mantissa_bits():
    w = _weights(64, 32)
    q = quantization.quantize_kernel(w, num_lead=0, num_contract=1, method="fp8")
    assert q["kernel"].dtype == jnp.float8_e4m3fn
    back = quantization.dequantize_kernel_np(q, num_lead=0)
    # e4m3 rounds to 3 mantissa bits: relative error <= 2^-4 for normal values; values below
    # the smallest normal (2^-6 x scale) have an absolute error <= 2^-10 x scale.
    bound = np.maximum(np.abs(w) * 2.0 ** -4, q["qscale"] * 2.0 ** -10)
    assert np.all(np.abs(back - w) <= bound + 1e-9)


def test_zero_channels_quantize_to_zero_without_nan():
    w = _weights(32, 8)
    w[:, 3] = 0
    for method in quantization.METHODS:
        back = quantization.dequantize_kernel_np(quantization.quantize_kernel(w, 0, 1, method), 0)
        assert np.all(np.isfinite(back)) and np.all(back[:, 3] == 0), method


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_1", "Q4_0"])
def test_gguf_blocks_come_back_as_the_file_stored_them(ggml_type):
    import gguf

    kind = gguf.GGMLQuantizationType[ggml_type]
    rows = _weights(48, 128, outliers=False)  # GGUF layout [out, in], blocks of 32 along in
    stored = gguf.quants.dequantize(gguf.quants.quantize(rows, kind), kind).astype(np.float32)
    kernel = stored.T  # the model's [in, out] layout: blocks along the contraction
    q = quantization.quantize_kernel(kernel, num_lead=0, num_contract=1, method="gguf")
    assert q["qscale"].shape == (4, 48) and q["qscale"].dtype == np.float16
    back = quantization.dequantize_kernel_np(q, num_lead=0)
    if ggml_type == "Q4_0":
        # Q4_0's levels (q - 8) * d need not reach both ends of a block, so they are re-fitted
        # as int8 (scale amax / 127): within half an int8 step of the stored values.
        step = np.repeat(q["qscale"].astype(np.float32), 32, axis=0)
        assert np.all(np.abs(back - kernel) <= step / 2 + 1e-6)
    else:
        # Q8_0 and Q4_1 blocks are exactly representable: the same floats, up to float16
        # rounding of the product the file's own dequantization does in float32.
        np.testing.assert_allclose(back, kernel, rtol=0, atol=1e-6)
    if ggml_type == "Q4_1":
        assert q["kernel"].min() >= 0 and q["kernel"].max() <= 15  # 4-bit levels in int8


def test_embedding_rows_quantize_per_row():
    table = _weights(100, 64)
    q = quantization.quantize_rows(table, "int8")
    assert q["values"].shape == (100, 64) and q["qscale"].shape == (100, 1)
    back = q["values"].astype(np.float32) * q["qscale"]
    assert np.all(np.abs(back - table) <= q["qscale"] / 2 + 1e-7)


# ---- the quantized product --------------------------------------------------------------------
@pytest.mark.parametrize("method,tolerance", [("int8", 2e-6), ("gguf", 2e-6), ("fp8", 2e-6)])
@pytest.mark.parametrize("spec,shape,axes", [
    ("TD,DNH->TNH", (64, 4, 16), ("embed", "heads", "head_dim")),  # column-parallel projection
    ("TNH,NHD->TD", (4, 16, 64), ("heads", "head_dim", "embed")),  # output projection: 2 contraction axes
])
def test_quantized_einsum_equals_a_float64_product_with_the_dequantized_weight(method, tolerance, spec, shape, axes):
    """The layer computes x @ dequantize(w): checked against float64 on the same dequantized
    weight, so the tolerance is float32 arithmetic (relative to the output's scale), not the
    quantization error, which the round-trip tests bound."""
    w = _weights(*shape)
    num_contract = 1 if spec.startswith("TD") else 2
    quantized = quantization.quantize_kernel(w, 0, num_contract, method)
    module = Einsum(spec, shape, axes, quantization=method)
    x = RNG.standard_normal((5, *([64] if num_contract == 1 else [4, 16]))).astype(np.float32)
    params = {"params": {key: jnp.asarray(value) for key, value in quantized.items()}}
    y = np.asarray(module.apply(params, jnp.asarray(x)), np.float64)
    w64 = quantization.dequantize_kernel_np(quantized, 0).astype(np.float64)
    expected = np.einsum(spec, x.astype(np.float64), w64)
    assert np.max(np.abs(y - expected)) <= tolerance * np.max(np.abs(expected)) * 64


# ---- the tree ---------------------------------------------------------------------------------
TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16)


@pytest.mark.parametrize("model_type,tie", [("llama", False), ("llama", True), ("gpt2", True)])
@pytest.mark.parametrize("method", quantization.METHODS)
def test_quantized_tree_is_the_one_the_quantized_model_declares(model_type, tie, method):
    config = dataclasses.replace(TINY, model_type=model_type, tie_word_embeddings=tie,
                                 hidden_act="gelu_new" if model_type == "gpt2" else "silu",
                                 qkv_bias=model_type == "gpt2", o_bias=model_type == "gpt2",
                                 mlp_bias=model_type == "gpt2")
    floats = jax.tree.map(lambda a: RNG.standard_normal(a.shape).astype(np.float32),
                          nn.unbox(models.abstract_variables(config)))
    quantized_config = dataclasses.replace(config, quantization=method)
    quantized = parallel.tree_paths(models.quantize_params(copy.deepcopy(floats), quantized_config)["params"])
    declared = parallel.tree_paths(nn.unbox(models.abstract_variables(quantized_config))["params"])
    assert quantized.keys() == declared.keys()
    for name, leaf in declared.items():
        assert quantized[name].shape == tuple(leaf.shape) and quantized[name].dtype == leaf.dtype, name
    # Every matrix is quantized; norms and biases stay float.
    one_byte = {name for name, leaf in quantized.items() if leaf.dtype.itemsize == 1}
    assert "embed" in one_byte and "layers/mlp/" + ("proj" if model_type == "gpt2" else "down_proj") + "/kernel" in one_byte
    assert not any("norm" in name or name.endswith("bias") for name in one_byte)
    assert ("lm_head" in one_byte) == (not tie)


def test_the_step_never_holds_a_float_copy_of_the_stacked_weights(tiny_llama_dir):
    """XLA may convert int8 weights to floats next to the product, one layer at a time; a
    float array of a whole stacked weight would mean the conversion was hoisted out of the
    layer loop, and the memory saving lost."""
    from orca_jax.engine.engine import LLMEngine

    engine = LLMEngine(model=str(tiny_llama_dir), quantization="int8", max_num_seqs=4, max_num_batched_tokens=16,
                       min_token_bucket=16, page_size=8, num_pages=16, max_model_len=64, warmup=False)
    layers = engine.runner.params["params"]["layers"]
    stacked = {tuple(leaf.shape) for leaf in jax.tree.leaves(layers) if leaf.dtype == jnp.int8}
    assert len(stacked) >= 4
    engine.runner.warmup()
    hlo = engine.runner._programs[16].as_text()
    # Conversions (alone or fused) and the float arrays they make, by shape.
    converted = {tuple(int(d) for d in dims.split(","))
                 for dims in re.findall(r"= f32\[([\d,]+)\]\S* (?:convert|fusion)\(.*convert", hlo)}
    assert converted, "the int8 weights are converted somewhere"
    assert not stacked & converted, stacked & converted


# ---- the engine and checkpoints ------------------------------------------------------------------
def _greedy(llm_or_engine_kwargs, prompts, max_tokens=8):
    from orca_jax import LLM, SamplingParams

    llm = LLM(**llm_or_engine_kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=64, max_model_len=128,
              min_token_bucket=32)  # one step program: the test is about the weights, not the buckets


def test_a_checkpoint_converted_with_int8_restores_without_quantizing_again(tiny_llama_dir, tmp_path, caplog):
    from orca_jax.loading import checkpoint
    from orca_jax.loading.convert import convert
    from orca_jax.loading.loader import load_model

    convert(str(tiny_llama_dir), tmp_path / "ckpt", quantization="int8")
    opened = checkpoint.open_checkpoint(tmp_path / "ckpt")
    assert opened.config.quantization == "int8"
    restored = parallel.tree_paths(opened.restore_host()["params"])
    expected = parallel.tree_paths(load_model(str(tiny_llama_dir), quantization="int8").params["params"])
    assert restored.keys() == expected.keys()
    for name in expected:
        assert restored[name].dtype == expected[name].dtype, name
        np.testing.assert_array_equal(restored[name], expected[name], err_msg=name)

    prompts = [[5, 9, 13, 2, 40], [7, 7, 3]]
    _, from_hf = _greedy(dict(model=str(tiny_llama_dir), quantization="int8", **ENGINE), prompts)
    with caplog.at_level("INFO", logger="orca_jax.loading.loader"):
        llm, from_checkpoint = _greedy(dict(model=str(tmp_path / "ckpt"), **ENGINE), prompts)
    assert from_checkpoint == from_hf
    assert "quantized to" not in caplog.text and "as the checkpoint holds them" in caplog.text
    assert llm.engine.model_config.quantization == "int8"
    with pytest.raises(ValueError, match="cannot be re-quantized"):
        load_model(str(tmp_path / "ckpt"), quantization="fp8")


def test_gguf_format_needs_a_gguf_file(tiny_llama_dir):
    from orca_jax.loading.loader import load_model

    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(str(tiny_llama_dir), quantization="gguf")


def test_fp8_falls_back_to_int8_where_the_device_has_no_fp8_units(caplog):
    cpu = jax.devices("cpu")[0]
    with caplog.at_level("WARNING", logger="orca_jax.kernels.quantization"):
        assert quantization.resolve_method("fp8", cpu) == "int8"
    assert "no fp8 matrix units" in caplog.text
    assert quantization.resolve_method("int8", cpu) == "int8"
    assert quantization.resolve_method(None, cpu) is None


class _FakeGPU:
    platform = "gpu"
    device_kind = "NVIDIA H200"
    compute_capability = "9.0"


def test_fp8_is_kept_on_gpus_with_fp8_units():
    assert quantization.resolve_method("fp8", _FakeGPU()) == "fp8"
    old = _FakeGPU()
    old.compute_capability = "8.0"  # A100: no fp8
    assert quantization.resolve_method("fp8", old) == "int8"


def test_an_unknown_method_is_refused():
    from orca_jax.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="awq")
