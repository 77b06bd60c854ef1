"""dtype="auto": the dtype each backend and checkpoint gets, what a model's files say about
their dtype, and the engine resolving it before the model loads."""

from __future__ import annotations

import json

import types

import numpy as np
import pytest

from orca_jax.kernels import gpu_info
from orca_jax.loading import dtype_policy
from orca_jax.loading.dtype_policy import (CPU_AUTO_DTYPE, checkpoint_dtype, cpu_bfloat16_capable, resolve_dtype,
                                   resolve_model_dtype)


@pytest.mark.parametrize("backend,checkpoint,expected", [
    ("gpu", "bfloat16", "bfloat16"), ("gpu", "float16", "bfloat16"), ("gpu", "float32", "float32"),
    ("gpu", None, "bfloat16"), ("tpu", "bfloat16", "bfloat16"), ("tpu", "float32", "float32"),
    ("cpu", "bfloat16", CPU_AUTO_DTYPE), ("cpu", "float32", CPU_AUTO_DTYPE), ("cpu", None, CPU_AUTO_DTYPE),
])
def test_auto_takes_the_checkpoint_dtype_on_accelerators(backend, checkpoint, expected):
    assert resolve_dtype("auto", backend, checkpoint) == expected


@pytest.mark.parametrize("requested", ["float32", "bfloat16"])
def test_an_explicit_dtype_is_kept_everywhere(requested):
    for backend in ("cpu", "gpu", "tpu"):
        assert resolve_dtype(requested, backend, "float16") == requested


@pytest.mark.parametrize("meta,expected", [
    ({"torch_dtype": "bfloat16"}, "bfloat16"), ({"dtype": "float16"}, "float16"),
    ({"torch_dtype": "float32"}, "float32"), ({}, None), ({"torch_dtype": "int8"}, None),
])
def test_hf_directory_dtype_comes_from_config_json(tmp_path, meta, expected):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **meta}))
    assert checkpoint_dtype(tmp_path) == expected


def test_a_corrupt_config_json_says_nothing(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert checkpoint_dtype(tmp_path) is None


def _write_gguf(path, matrix_type):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    matrix = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    if matrix_type == "F16":
        writer.add_tensor("token_embd.weight", matrix.astype(np.float16))
    elif matrix_type == "Q8_0":
        quantized = gguf.quants.quantize(matrix, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor("token_embd.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        writer.add_tensor("token_embd.weight", matrix)
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))  # 1-D: F32 in every file
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("matrix_type,expected", [("F32", "float32"), ("F16", "float16"), ("Q8_0", "bfloat16")])
def test_gguf_dtype_comes_from_its_weight_matrices(tmp_path, matrix_type, expected):
    path = _write_gguf(tmp_path / "model.gguf", matrix_type)
    assert checkpoint_dtype(path) == expected
    assert checkpoint_dtype(tmp_path) == expected  # a directory holding only the .gguf


def test_the_embedded_default_model_is_half_precision():
    from orca_jax.loading.loader import default_model_path

    assert checkpoint_dtype(default_model_path()) == "bfloat16"  # Q4_1 weights


def test_model_files_are_read_only_where_the_answer_depends_on_them(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert resolve_model_dtype("auto", "gpu", tmp_path) == "float32"

    def unreadable(path):
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(dtype_policy, "checkpoint_dtype", unreadable)
    assert resolve_model_dtype("auto", "cpu", tmp_path) == CPU_AUTO_DTYPE
    assert resolve_model_dtype("bfloat16", "gpu", tmp_path) == "bfloat16"
    with pytest.raises(AssertionError, match="was read"):
        resolve_model_dtype("auto", "tpu", tmp_path)


@pytest.mark.parametrize("checkpoint,model_type,expected", [
    ("bfloat16", "llama", "float16"), ("float16", "qwen3", "float16"), (None, None, "float16"),
    ("float32", "llama", "float32"),  # a float32 checkpoint stays float32, as on every GPU
    ("bfloat16", "gemma2", "float32"), ("bfloat16", "gemma3_text", "float32"),  # float16 would overflow
])
@pytest.mark.parametrize("capability", [75, 70])
def test_auto_is_float16_below_sm80(capability, checkpoint, model_type, expected):
    assert resolve_dtype("auto", "gpu", checkpoint, capability=capability, model_type=model_type) == expected
    assert resolve_dtype("auto", "gpu", checkpoint, capability=80, model_type=model_type) == (
        "float32" if checkpoint == "float32" else "bfloat16")
    reason = dtype_policy.auto_dtype_reason(expected, "gpu", capability)
    assert f"compute capability {capability // 10}.{capability % 10}" in reason and "no bfloat16" in reason


def test_bfloat16_is_refused_below_sm80_naming_half():
    with pytest.raises(ValueError, match=r"compute capability >= 8.0; this one is 7.5: use --dtype half"):
        resolve_dtype("bfloat16", "gpu", None, capability=75)
    assert resolve_dtype("bfloat16", "gpu", None, capability=86) == "bfloat16"
    assert resolve_dtype("bfloat16", "gpu", None, capability=None) == "bfloat16"  # unknown: not refused
    assert resolve_dtype("float16", "gpu", None, capability=75) == "float16"


@pytest.mark.parametrize("model_type", sorted(dtype_policy.FLOAT16_UNSTABLE))
def test_float16_is_refused_for_models_that_overflow_it(model_type):
    with pytest.raises(ValueError, match=f"float16 is not supported for {model_type}"):
        dtype_policy.check_dtype_supported("float16", "cpu", model_type=model_type)
    dtype_policy.check_dtype_supported("float16", "cpu", model_type="llama")


def test_auto_below_sm80_reads_the_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2", "torch_dtype": "bfloat16"}))
    assert dtype_policy.checkpoint_model_type(tmp_path) == "gemma2"
    assert resolve_model_dtype("auto", "gpu", tmp_path, capability=75) == "float32"
    assert resolve_model_dtype("auto", "gpu", tmp_path, capability=90) == "bfloat16"


def test_gguf_model_type_is_its_architecture(tmp_path):
    assert dtype_policy.checkpoint_model_type(_write_gguf(tmp_path / "m.gguf", "F16")) == "llama"


@pytest.mark.parametrize("device,expected", [
    (types.SimpleNamespace(platform="gpu", compute_capability="7.5"), 75),
    (types.SimpleNamespace(platform="gpu", compute_capability="9.0"), 90),
    (types.SimpleNamespace(platform="gpu"), None), (types.SimpleNamespace(platform="cpu"), None),
])
def test_compute_capability_of_a_device(device, expected):
    assert gpu_info.compute_capability(device) == expected


def test_bfloat16_capability_reads_the_cpu_flags():
    assert cpu_bfloat16_capable("flags : fpu sse avx512f avx512_bf16 amx_tile")
    assert cpu_bfloat16_capable("flags : fpu avx2 amx_bf16")
    assert not cpu_bfloat16_capable("flags : fpu sse avx2 avx512f avx512bw")


def test_engine_resolves_auto_before_loading(tiny_engine_factory):
    engine = tiny_engine_factory(dtype="auto")
    assert engine.config.dtype == CPU_AUTO_DTYPE  # the tests run on the CPU backend
    assert engine.runner.dtype == np.dtype(CPU_AUTO_DTYPE)
    assert engine.runner.kv_dtype == np.dtype("float32")


def test_half_is_float16_end_to_end_with_float32s_tokens(tiny_engine_factory, run_engine):
    """vLLM's --dtype half: weights and activations in float16 (the KV cache stays float32 on CPU,
    as for bfloat16); greedy tokens as float32 gives and log-probabilities within 1e-2."""
    from orca_jax import SamplingParams
    from orca_jax.config import EngineConfig

    assert EngineConfig(dtype="half").dtype == "float16" and EngineConfig(kv_cache_dtype="half").kv_cache_dtype == "float16"
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    outs = {}
    for dtype in ("float32", "half"):
        engine = tiny_engine_factory(dtype=dtype)
        assert engine.config.dtype == ("float16" if dtype == "half" else dtype)
        outs[dtype] = run_engine(engine, [("r", "The quick brown fox", params)])["r"].outputs[0]
    assert outs["half"].token_ids == outs["float32"].token_ids
    for half, full in zip(outs["half"].logprobs, outs["float32"].logprobs):
        token = next(iter(full))
        assert abs(half[token] - full[token]) < 1e-2


def test_the_engine_refuses_float16_for_a_model_that_overflows_it(tiny_hf_model_factory):
    from orca_jax.engine.engine import LLMEngine

    directory = tiny_hf_model_factory("Gemma2Config", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="float16 is not supported for gemma2"):
        LLMEngine(model=str(directory), dtype="float16", warmup=False, max_model_len=64, num_pages=16)
