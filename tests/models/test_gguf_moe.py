"""GGUF files of the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) against the HF
checkpoints they were converted from.

The tiny random models are test_model_families.py's MoE ones (8 experts, top-2; Qwen2-MoE with
its shared expert). Each is written to GGUF the way llama.cpp's convert_hf_to_gguf.py writes it, with
test_gguf_families.py's helpers for what the dense families share (metadata, tokenizer, the Q/K
row permutation of the "llama" architecture): from the checkpoint's safetensors, each layer's
per-expert matrices stacked into one [experts, out, in] tensor per projection (the converter's
`modify_tensors`), named by gguf-py's `TensorNameMap`, with the expert counts and widths its
`set_gguf_parameters` writes. Mixtral is written as "llama" (Q/K permuted), the Qwens as
"qwen2moe" / "qwen3moe". The F32 files must load to exactly the parameters of the HF directory
and give HF's logits in one prefill; the Q8_0 file to the parameters of its dequantized weights.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import sys
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
import torch

from orca_jax.loading.loader import gguf_config, gguf_to_hf_name, hf_to_params, load_model, read_safetensors


def _sibling(name: str):
    """A test module of this directory by path (pytest imports tests in importlib mode),
    registered under its own name."""
    spec = importlib.util.spec_from_file_location(f"_orca_jax_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gguf_families = _sibling("test_gguf_families")  # writing GGUF as llama.cpp does, one-prefill logits
families = _sibling("test_model_families")  # the tiny MoE models (MOE_FAMILIES)

ATOL = 1e-4
ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
# The converter's names of the stacked experts: Mixtral's w1/w3/w2 are gate/up/down.
_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
                "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
PROMPT_LENGTHS = (5, 23)

pytestmark = pytest.mark.usefixtures("torch_single_thread")


# ---------------------------------------------------------------------------------------------
# Writing MoE files as llama.cpp's converter does
# ---------------------------------------------------------------------------------------------
def _hf_config(hf_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(hf_dir)


def _write_moe_metadata(writer, config, arch: str, qtype: str) -> None:
    """test_gguf_families' keys, then the experts': `TextModel.set_gguf_parameters` writes the
    counts for every family, `Qwen2MoeModel` (and Qwen3MoeModel, its subclass) the widths."""
    if arch == "llama" and config.head_dim is None:
        # LlamaModel writes rope.dimension_count = hidden / heads when the config names no head_dim.
        config = copy.copy(config)
        config.head_dim = config.hidden_size // config.num_attention_heads
    gguf_families._write_metadata(writer, config, arch, qtype)
    writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch != "llama":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None) is not None:
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _converter_tensors(hf_dir: Path, stacked: bool = True):
    """(HF name, weight) as the converter hands them to its name map: the checkpoint's tensors
    with each layer's experts stacked per projection under `{prefix}.experts.{projection}.weight`
    ([E, out, in]); `stacked=False` keeps them one per expert, as converters before April 2024
    wrote them."""
    tensors = read_safetensors(hf_dir)
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name in list(tensors):
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if match and stacked:
            prefix, expert, projection = match.groups()
            experts.setdefault(f"{prefix}.{projection}.weight", {})[int(expert)] = tensors.pop(name)
    yield from tensors.items()
    for name, by_expert in experts.items():
        yield name, np.stack([by_expert[e] for e in range(len(by_expert))])


def write_moe_gguf(path: Path, hf_dir: Path, arch: str, qtype: str = "F32", stacked: bool = True):
    """Write the checkpoint of `hf_dir` as llama.cpp would for `arch`. Returns the weights as the
    file holds them, dequantized, in HF layout, under the names the loader gives them (stacked
    experts as `{prefix}.experts.{gate,up,down}_proj`)."""
    config = _hf_config(hf_dir)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{config.model_type}")
    _write_moe_metadata(writer, config, arch, qtype)
    gguf_families._write_tokenizer(writer, gguf_families.gpt2_style_tokenizer_metadata(hf_dir))
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config.num_hidden_layers)
    stored = {}
    for name, w in _converter_tensors(hf_dir, stacked):
        w = np.asarray(w, np.float32)
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(name.split(".")[-2])
        permuted = arch == "llama" and heads is not None
        if permuted:
            w = gguf_families.permute_rope_rows(w, heads)
        expert = re.fullmatch(r"model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight", name)
        if expert:  # the old per-expert form: blk.N.ffn_gate.E.weight
            layer, _, e, projection = expert.groups()
            gguf_name = f"blk.{layer}.ffn_{_PROJECTIONS[projection].removesuffix('_proj')}.{e}.weight"
        else:
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if qtype == "Q8_0" and w.ndim >= 2:  # llama.cpp's q8_0: every matrix; norms, biases F32
            quantized = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            w = gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, w)
        stacked_name = re.fullmatch(r"(.*\.experts)\.(\w+)\.weight", name)
        if stacked_name:
            name = f"{stacked_name.group(1)}.{_PROJECTIONS[stacked_name.group(2)]}"
        stored[name] = gguf_families.inverse_permute_rope_rows(w, heads) if permuted else w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dirs(tiny_hf_model_factory):
    return {name: families._model_dir(tiny_hf_model_factory, name) for name in families.MOE_FAMILIES}


@pytest.fixture(scope="module")
def gguf_files(hf_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-moe")
    files = {}
    for name, hf_dir in hf_dirs.items():
        files[name] = out / f"{name}-F32.gguf"
        write_moe_gguf(files[name], hf_dir, ARCH[name])
    return files


@pytest.fixture(scope="module")
def loaded(gguf_files):
    return {name: load_model(path) for name, path in gguf_files.items()}


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(families.MOE_FAMILIES))
def test_f32_file_loads_to_the_hf_weights(hf_dirs, loaded, name):
    """Exact: routers, stacked experts (and Qwen2-MoE's shared expert) where the HF directory
    puts them, Mixtral's Q/K rows unpermuted, the Qwens' left as they are."""
    got, want = loaded[name], load_model(hf_dirs[name])
    assert jax.tree.structure(got.params) == jax.tree.structure(want.params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    for field in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
                  "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "sliding_window", "hidden_act", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "norm_topk_prob", "router_scoring"):
        assert getattr(got.config, field) == getattr(want.config, field), field
    assert got.config.rms_norm_eps == pytest.approx(want.config.rms_norm_eps)


def test_q8_0_experts_load_as_their_dequantized_weights(hf_dirs, tmp_path):
    """Quantized 3-D expert tensors dequantize block by block like the 2-D ones (Qwen2-MoE: the
    routed experts, the shared expert and its gate all quantized)."""
    path = tmp_path / "qwen2_moe-Q8_0.gguf"
    stored = write_moe_gguf(path, hf_dirs["qwen2_moe"], "qwen2moe", qtype="Q8_0")
    exact = read_safetensors(hf_dirs["qwen2_moe"])["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert not np.array_equal(stored["model.layers.0.mlp.experts.up_proj"][3], exact)  # it did quantize
    got = load_model(path)
    want = hf_to_params(stored, got.config)
    for (key, a), b in zip(jax.tree_util.tree_leaves_with_path(got.params), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(key))


# ---------------------------------------------------------------------------------------------
# Logits
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(families.MOE_FAMILIES))
def test_f32_logits_match_transformers(hf_dirs, loaded, name):
    rng = np.random.default_rng(20)
    prompts = [rng.integers(3, loaded[name].config.vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]
    hf = families._hf_model(hf_dirs[name])
    diff = 0.0
    for prompt, ours in zip(prompts, gguf_families.model_logits_at_every_position(loaded[name], prompts)):
        with torch.no_grad():
            reference = hf(torch.tensor([prompt])).logits[0].numpy()
        diff = max(diff, float(np.abs(ours - reference).max()))
    print(f"{name} F32: max |logit diff| = {diff:.3e} over {sum(PROMPT_LENGTHS)} positions")
    assert diff <= ATOL, f"{name}: max abs logit difference {diff:.3e} > {ATOL}"


# ---------------------------------------------------------------------------------------------
# Metadata, and what is refused
# ---------------------------------------------------------------------------------------------
def _meta(arch: str, **extra) -> dict:
    sizes = {"embedding_length": 64, "feed_forward_length": 128, "block_count": 2, "attention.head_count": 4,
             "attention.head_count_kv": 2, "expert_count": 8, "expert_used_count": 2}
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in {**sizes, **extra}.items()}}


def test_moe_metadata_gives_the_family_and_its_router():
    mixtral = gguf_config(_meta("llama"))  # llama.cpp writes Mixtral as "llama" with experts
    assert (mixtral.model_type, mixtral.num_experts, mixtral.num_experts_per_tok) == ("mixtral", 8, 2)
    assert (mixtral.moe_intermediate_size, mixtral.norm_topk_prob, mixtral.sliding_window) == (128, True, None)
    assert gguf_config(_meta("llama", **{"attention.sliding_window": 4096})).model_type == "mixtral"
    assert gguf_config(_meta("llama", expert_count=0)).model_type == "llama"
    qwen2 = gguf_config(_meta("qwen2moe", expert_feed_forward_length=32, expert_shared_feed_forward_length=96))
    assert (qwen2.model_type, qwen2.moe_intermediate_size, qwen2.shared_expert_intermediate_size) == (
        "qwen2_moe", 32, 96)
    assert not qwen2.norm_topk_prob and qwen2.qkv_bias  # llama.cpp keeps Qwen2-MoE's top-k as they are
    qwen3 = gguf_config(_meta("qwen3moe", expert_feed_forward_length=32))
    assert (qwen3.model_type, qwen3.shared_expert_intermediate_size, qwen3.norm_topk_prob, qwen3.qk_norm) == (
        "qwen3_moe", 0, True, True)  # ... and renormalises Qwen3-MoE's


def test_incomplete_expert_metadata_is_refused():
    with pytest.raises(ValueError, match="expert_used_count is missing"):
        gguf_config(_meta("qwen3moe", expert_used_count=None))
    with pytest.raises(ValueError, match="no expert count"):
        gguf_config(_meta("qwen2moe", expert_count=None))


def test_per_expert_tensors_are_refused(hf_dirs, tmp_path):
    """Files from converters before April 2024 (blk.N.ffn_gate.E.weight): refused, saying why."""
    path = tmp_path / "mixtral-old.gguf"
    write_moe_gguf(path, hf_dirs["mixtral"], "llama", stacked=False)
    with pytest.raises(ValueError, match=r"'blk\.\d+\.ffn_\w+\.\d+\.weight' holds a single expert.*reconvert"):
        load_model(path)


def test_expert_tensors_are_named_for_moe_families_only():
    names = {
        ("blk.1.ffn_gate_exps.weight", "mixtral"): "model.layers.1.block_sparse_moe.experts.gate_proj",
        ("blk.1.ffn_gate_inp.weight", "mixtral"): "model.layers.1.block_sparse_moe.gate.weight",
        ("blk.1.ffn_down_exps.weight", "qwen3_moe"): "model.layers.1.mlp.experts.down_proj",
        ("blk.0.ffn_gate_inp_shexp.weight", "qwen2_moe"): "model.layers.0.mlp.shared_expert_gate.weight",
        ("blk.0.ffn_up_shexp.weight", "qwen2_moe"): "model.layers.0.mlp.shared_expert.up_proj.weight",
    }
    for (name, model_type), hf_name in names.items():
        assert gguf_to_hf_name(name, model_type) == hf_name
    for model_type in (None, "llama", "qwen3"):
        with pytest.raises(ValueError, match="unexpected tensor 'blk.0.ffn_up_exps.weight'"):
            gguf_to_hf_name("blk.0.ffn_up_exps.weight", model_type)


@pytest.mark.parametrize("method", ["gguf", "int8"])
def test_weight_quantization_of_a_moe_file_is_refused(gguf_files, method):
    """The experts run as grouped matmuls over float weights: a MoE file loads dequantized, and
    asking for quantized weights says so instead of failing somewhere inside."""
    with pytest.raises(ValueError, match="mixture-of-experts"):
        load_model(gguf_files["qwen3_moe"], quantization=method)

