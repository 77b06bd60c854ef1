"""gpt-oss GGUF files (architecture "gpt-oss", as llama.cpp's convert_hf_to_gguf.py writes them)
against the HF checkpoint they come from: the tiny model of test_gpt_oss.py, its metadata and
tensors written as the converter's `GptOssModel` does (gate_up_proj split into gate and up,
experts [E, out, in], biases and sinks as their own tensors; YaRN and the window as keys),
once in F32 and once with the experts in GGML's MXFP4 blocks (a scale byte, then 16 bytes whose
low nibbles are a block's first 16 codes). The F32 file loads to exactly the HF parameters and
HF's logits; the MXFP4 file keeps its experts 4-bit, with the values of the MXFP4 checkpoint
made from the same weights."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
import torch

from orca_jax.kernels import packed4
from orca_jax.loading.loader import load_model, read_safetensors

ATOL = 1e-4
TINY = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=8,
            max_position_embeddings=256, initializer_range=0.1)  # test_gpt_oss.py's, so the same directory
_BLOCK = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
          "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
          "mlp.router.bias": "ffn_gate_inp.bias",
          **{f"self_attn.{p}_proj.{kind}": f"attn_{g}.{kind}" for p, g in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                          ("o", "output")) for kind in ("weight", "bias")}}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_orca_jax_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gguf_families = _sibling("test_gguf_families")  # metadata, tokenizer, one-prefill logits


def _mxfp4_ggml_blocks(weights: np.ndarray) -> np.ndarray:
    """[..., K] float -> GGML MXFP4 bytes [..., K / 32 * 17], from packed4's own packing."""
    blocks, scales = packed4.pack_mxfp4(weights)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*scales.shape, 32)
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(*scales.shape[:-1], -1)


def write_gpt_oss_gguf(path: Path, hf_dir: Path, mxfp4: bool) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    gguf_families._write_metadata(writer, config, "gpt-oss", "F32")
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    gguf_families._write_tokenizer(writer, gguf_families.gpt2_style_tokenizer_metadata(hf_dir))
    for name, w in read_safetensors(hf_dir).items():
        w = np.asarray(w, np.float32)
        if name in _TOP:
            writer.add_tensor(_TOP[name], w)
            continue
        layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        if rest in _BLOCK:
            writer.add_tensor(f"blk.{layer}.{_BLOCK[rest]}", w)
            continue
        if rest == "mlp.experts.gate_up_proj":  # [E, D, 2F] -> gate, up as [E, F, D]
            outputs_first = w.transpose(0, 2, 1)
            projections = {"gate": outputs_first[:, 0::2], "up": outputs_first[:, 1::2]}
        elif rest == "mlp.experts.down_proj":  # [E, F, D] -> [E, D, F]
            projections = {"down": w.transpose(0, 2, 1)}
        elif rest == "mlp.experts.gate_up_proj_bias":
            for projection, bias in (("gate", w[:, 0::2]), ("up", w[:, 1::2])):
                writer.add_tensor(f"blk.{layer}.ffn_{projection}_exps.bias", np.ascontiguousarray(bias))
            continue
        elif rest == "mlp.experts.down_proj_bias":
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.bias", w)
            continue
        else:
            raise AssertionError(f"unmapped tensor {name}")
        for projection, weight in projections.items():
            weight = np.ascontiguousarray(weight)
            if mxfp4:
                writer.add_tensor(f"blk.{layer}.ffn_{projection}_exps.weight", _mxfp4_ggml_blocks(weight),
                                  raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            else:
                writer.add_tensor(f"blk.{layer}.ffn_{projection}_exps.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_model_factory):
    return tiny_hf_model_factory("GptOssConfig", seed=3, random_biases=True, **TINY)


@pytest.fixture(scope="module")
def files(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-gpt-oss")
    written = {}
    for kind in ("F32", "MXFP4"):
        written[kind] = out / f"tiny-gpt-oss-{kind}.gguf"
        write_gpt_oss_gguf(written[kind], hf_dir, mxfp4=kind == "MXFP4")
    return written


def test_f32_file_loads_to_the_hf_weights_and_config(hf_dir, files):
    got, want = load_model(files["F32"]), load_model(hf_dir)
    assert jax.tree.structure(got.params) == jax.tree.structure(want.params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    for field in ("model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "qkv_bias", "o_bias", "attention_sinks",
                  "moe_bias", "swiglu_limit", "layer_types", "sliding_window", "rope_scaling", "rope_theta",
                  "norm_topk_prob", "tie_word_embeddings"):
        assert getattr(got.config, field) == getattr(want.config, field), field


def test_f32_logits_match_transformers(hf_dir, files):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    loaded = load_model(files["F32"])
    rng = np.random.default_rng(21)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (5, 23)]  # 23: past the window of 8
    for prompt, ours in zip(prompts, gguf_families.model_logits_at_every_position(loaded, prompts)):
        with torch.no_grad():
            reference = hf(torch.tensor([prompt])).logits[0].numpy()
        assert np.abs(ours - reference).max() <= ATOL


def test_mxfp4_file_keeps_its_experts_packed_with_the_checkpoints_values(hf_dir, files, make_mxfp4_checkpoint,
                                                                        float64_mxfp4_dequantize, tmp_path):
    """The same weights packed by packed4 into GGML's blocks or into HF's: one set of values;
    and the model cache (orca_jax/loading/model_cache.py), which serves the file's next load,
    keeps them packed with their format in the config."""
    load_model(files["MXFP4"], cache_dir=tmp_path)  # converts and caches
    got = load_model(files["MXFP4"], cache_dir=tmp_path)  # from the cache
    if not isinstance(got.params, dict):
        got.params = got.params.restore_host()
    assert got.config.expert_format == "mxfp4"
    want = load_model(make_mxfp4_checkpoint(hf_dir)[0])
    moe_got, moe_want = got.params["params"]["layers"]["moe"], want.params["params"]["layers"]["moe"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert moe_got[f"{name}_blocks"].dtype == np.uint8
        np.testing.assert_array_equal(
            float64_mxfp4_dequantize(moe_got[f"{name}_blocks"], moe_got[f"{name}_scales"]),
            float64_mxfp4_dequantize(moe_want[f"{name}_blocks"], moe_want[f"{name}_scales"]))
    np.testing.assert_array_equal(moe_got["router"], moe_want["router"])

