"""Checkpoint loading: HF safetensors directories (plain, sharded, corrupt), hub ids offline,
config validation, and GGUF files written here with `gguf.GGUFWriter` the way llama.cpp's
converter writes them (Q/K rows permuted for its interleaved RoPE)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from orca_jax.config import ModelConfig
from orca_jax.models import config_from_hf
from orca_jax.loading import loader
from orca_jax.loading.loader import (
    gguf_config,
    gguf_to_hf_name,
    hf_to_params,
    load_model,
    read_safetensors,
    unpermute_rope_rows,
)


# PyTorch is the reference here; run it single-threaded (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _hf_model(directory: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def _hf_reference_params(directory: Path) -> tuple[dict, ModelConfig]:
    """The expected Flax tree, built by hand from HF's own state dict (independent of
    `read_safetensors`)."""
    state = {k: v.detach().float().numpy() for k, v in _hf_model(directory).state_dict().items()}
    config = config_from_hf(json.loads((directory / "config.json").read_text()))
    return hf_to_params(state, config), config


# ---------------------------------------------------------------------------------------------
# HF directories
# ---------------------------------------------------------------------------------------------
def test_params_hold_the_hf_weights_in_flax_layout(tiny_llama_dir):
    """Spot-check the layout conversion against the torch tensors directly."""
    hf = _hf_model(tiny_llama_dir)
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    loaded = load_model(tiny_llama_dir)
    p, c = loaded.params["params"], loaded.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (4, 2, 16, 2)
    x = np.random.default_rng(0).standard_normal((3, c.hidden_size)).astype(np.float32)
    for i in range(c.num_layers):
        # y = x @ W.T in torch; the Flax kernels give the same per head.
        q = np.einsum("TD,DNH->TNH", x, p["layers"]["attn"]["q_proj"]["kernel"][i])
        np.testing.assert_allclose(q.reshape(3, -1), x @ sd[f"model.layers.{i}.self_attn.q_proj.weight"].T, rtol=1e-5, atol=1e-6)
        k = np.einsum("TD,DKH->TKH", x, p["layers"]["attn"]["k_proj"]["kernel"][i])
        np.testing.assert_allclose(k.reshape(3, -1), x @ sd[f"model.layers.{i}.self_attn.k_proj.weight"].T, rtol=1e-5, atol=1e-6)
        o_in = np.random.default_rng(i).standard_normal((3, c.num_heads, c.head_dim)).astype(np.float32)
        o = np.einsum("TNH,NHD->TD", o_in, p["layers"]["attn"]["o_proj"]["kernel"][i])
        np.testing.assert_allclose(o, o_in.reshape(3, -1) @ sd[f"model.layers.{i}.self_attn.o_proj.weight"].T, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(p["layers"]["mlp"]["down_proj"]["kernel"][i], sd[f"model.layers.{i}.mlp.down_proj.weight"].T)
        np.testing.assert_array_equal(p["layers"]["input_norm"]["scale"][i], sd[f"model.layers.{i}.input_layernorm.weight"])
    np.testing.assert_array_equal(p["embed"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(p["lm_head"], sd["lm_head.weight"].T)
    np.testing.assert_array_equal(p["final_norm"]["scale"], sd["model.norm.weight"])
    assert loaded.tokenizer.encode("Paris is the capital") == hf_tokenizer_encode(tiny_llama_dir, "Paris is the capital")


def hf_tokenizer_encode(directory: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory)).encode(text)


def test_sharded_checkpoint_loads_like_unsharded(tiny_llama_dir, tmp_path):
    sharded = tmp_path / "sharded"
    _hf_model(tiny_llama_dir).save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    for f in tiny_llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, sharded / f.name)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2, shards
    # A stray file that the index does not list is not part of the checkpoint (as in transformers).
    (sharded / "stray.safetensors").write_bytes(b"not part of this checkpoint")

    whole = load_model(tiny_llama_dir)
    split = load_model(sharded)
    assert split.config == whole.config
    _assert_trees_equal(split.params, whole.params)
    expected, _ = _hf_reference_params(tiny_llama_dir)
    _assert_trees_equal(split.params, expected)


def test_bfloat16_checkpoint_keeps_its_values(tiny_llama_dir, tmp_path):
    bf16 = tmp_path / "bf16"
    model = _hf_model(tiny_llama_dir).to(torch.bfloat16)
    model.save_pretrained(bf16, safe_serialization=True)
    shutil.copy(tiny_llama_dir / "tokenizer.json", bf16 / "tokenizer.json")
    shutil.copy(tiny_llama_dir / "tokenizer_config.json", bf16 / "tokenizer_config.json")
    tensors = read_safetensors(bf16)
    for name, value in model.state_dict().items():
        assert str(tensors[name].dtype) == "bfloat16", name
        np.testing.assert_array_equal(tensors[name].astype(np.float32), value.float().numpy(), err_msg=name)
    loaded = load_model(bf16)
    np.testing.assert_array_equal(
        np.asarray(loaded.params["params"]["embed"], np.float32),
        model.state_dict()["model.embed_tokens.weight"].float().numpy(),
    )


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_raises_value_error_naming_the_file(tiny_llama_dir, tmp_path, damage):
    broken = _copy_checkpoint(tiny_llama_dir, tmp_path / "broken")
    target = broken / "model.safetensors"
    data = target.read_bytes()
    target.write_bytes(b"\x00\x01 this is not a safetensors file" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors") as info:
        load_model(broken)
    assert str(target) in str(info.value)


def test_nonexistent_path_raises_file_not_found(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        load_model(str(missing))
    assert str(missing) in str(info.value)


def test_directory_without_config_or_weights_raises_file_not_found(tiny_llama_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(empty)
    no_weights = _copy_checkpoint(tiny_llama_dir, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(no_weights)


def test_hub_id_offline_raises_file_not_found(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)  # so the id is not a relative path that happens to exist
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    with pytest.raises(FileNotFoundError) as info:
        load_model("orca-jax-tests/no-such-model")
    message = str(info.value)
    assert "orca-jax-tests/no-such-model" in message
    assert "offline" in message and "local directory" in message


def test_unsupported_model_type_lists_supported_ones(tiny_llama_dir, tmp_path):
    other = _copy_checkpoint(tiny_llama_dir, tmp_path / "gpt-neox")
    cfg = json.loads((other / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gpt_neox") as info:
        load_model(other)
    assert "supported" in str(info.value) and "llama" in str(info.value)


def test_missing_tensor_raises_value_error(tiny_llama_dir):
    tensors = read_safetensors(tiny_llama_dir)
    config = config_from_hf(json.loads((tiny_llama_dir / "config.json").read_text()))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        hf_to_params(tensors, config)


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------
def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): rotate-half -> interleaved."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape,n_head", [((64, 8), 4), ((32, 5), 1), ((48, 3), 3), ((128,), 8), ((16, 2, 3), 2)])
def test_unpermute_rope_rows_inverts_llama_cpp_permutation(shape, n_head):
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    permuted = permute_rope_rows(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_head), w)
    np.testing.assert_array_equal(permute_rope_rows(unpermute_rope_rows(w, n_head), n_head), w)


def test_unpermute_rope_rows_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.random.default_rng(0).standard_normal((8 * 16, 24)).astype(np.float32)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 8, "num_key_value_heads": 2})
    np.testing.assert_array_equal(
        unpermute_rope_rows(w, 8), processor._reverse_permute_weights(w, 8, 8)
    )
    np.testing.assert_array_equal(
        unpermute_rope_rows(w[:32], 2), processor._reverse_permute_weights(w[:32], 8, 2)
    )


def test_gguf_to_hf_name():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.0.attn_q.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.11.attn_k.bias") == "model.layers.11.self_attn.k_proj.bias"
    assert gguf_to_hf_name("blk.3.attn_v.weight") == "model.layers.3.self_attn.v_proj.weight"
    assert gguf_to_hf_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.2.attn_norm.weight") == "model.layers.2.input_layernorm.weight"
    assert gguf_to_hf_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.2.ffn_gate.weight") == "model.layers.2.mlp.gate_proj.weight"
    assert gguf_to_hf_name("blk.2.ffn_up.weight") == "model.layers.2.mlp.up_proj.weight"
    assert gguf_to_hf_name("blk.2.ffn_down.weight") == "model.layers.2.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        gguf_to_hf_name("blk.0.ffn_gate_exps.weight")


def test_gguf_config_reads_llama_metadata():
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": 64, "llama.feed_forward_length": 128, "llama.block_count": 3,
        "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.attention.key_length": 32,
        "llama.attention.layer_norm_rms_epsilon": 1e-6, "llama.rope.freq_base": 5e5, "llama.context_length": 1024,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    c = gguf_config(meta)
    assert (c.hidden_size, c.intermediate_size, c.num_layers) == (64, 128, 3)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 32)
    assert c.rms_norm_eps == pytest.approx(1e-6) and c.rope_theta == 5e5 and c.max_position_embeddings == 1024
    assert c.eos_token_ids == (2,) and c.model_type == "llama" and c.hidden_act == "silu"
    assert c.tie_word_embeddings and not (c.qkv_bias or c.o_bias or c.mlp_bias)  # until tensors say otherwise
    # Without head_count_kv / key_length: MHA with head_dim = hidden / heads.
    minimal = {k: v for k, v in meta.items() if k not in ("llama.attention.head_count_kv", "llama.attention.key_length")}
    c = gguf_config(minimal)
    assert (c.num_kv_heads, c.head_dim) == (4, 16)
    with pytest.raises(ValueError, match="'bert'") as info:
        gguf_config({**meta, "general.architecture": "bert"})
    assert "llama" in str(info.value)


def _tokenizer_metadata(directory: Path):
    """Vocabulary, token types and merges of the tiny byte-level BPE, as llama.cpp stores them
    (`tokenizer.ggml.model = "gpt2"`), padded to the model's vocabulary like its converter does."""
    tok = json.loads((directory / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    specials = {a["id"] for a in tok["added_tokens"] if a["special"]}
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(512):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(3 if i in specials else 1)  # CONTROL / NORMAL
        else:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return tokens, types, merges


def write_llama_gguf(path: Path, hf_dir: Path, qtype: str = "F32", arch: str = "llama",
                     extra_tensors: dict | None = None) -> Path:
    """Write the HF checkpoint at `hf_dir` as a llama.cpp-style GGUF."""
    import gguf

    hf = _hf_model(hf_dir)
    cfg = hf.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0)
    tokens, types, merges = _tokenizer_metadata(hf_dir)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)

    to_gguf = {v: k for k, v in loader._GGUF_TO_HF.items()}
    block = {v: k for k, v in loader._GGUF_BLOCK_TO_HF.items()}
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the checkpoint (and so the GGUF) has no separate output matrix
        w = tensor.detach().float().numpy().copy()
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            w = permute_rope_rows(w, n_head)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            w = permute_rope_rows(w, n_kv)
        if name in to_gguf:
            gguf_name = to_gguf[name]
        else:
            _, _, layer, *module, kind = name.split(".")
            gguf_name = f"blk.{layer}.{block['.'.join(module)]}.{kind}"
        if qtype == "Q8_0" and w.ndim == 2 and "embed" not in name:
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, w)
    for gguf_name, w in (extra_tensors or {}).items():
        writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GGUF_CASES = {
    "gqa-untied-hd32": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_round_trip_gives_the_hf_params(tiny_llama_factory, tmp_path, case):
    hf_dir = tiny_llama_factory(seed=3, initializer_range=0.1, **GGUF_CASES[case])
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    path = write_llama_gguf(gguf_dir / "tiny.gguf", hf_dir)

    # The file is what llama.cpp would write: transformers reads it back to the same weights.
    from transformers import AutoModelForCausalLM

    hf = _hf_model(hf_dir)
    hf_from_gguf = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=path.name, dtype=torch.float32)
    ref_sd = hf.state_dict()
    for name, value in hf_from_gguf.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), ref_sd[name].numpy(), err_msg=name)

    loaded = load_model(path)
    expected, expected_config = _hf_reference_params(hf_dir)
    c = loaded.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(c, field) == getattr(expected_config, field), field
    assert c.rms_norm_eps == pytest.approx(expected_config.rms_norm_eps)
    assert c.eos_token_ids == (2,)
    _assert_trees_equal(loaded.params, expected)
    # Loading a directory that holds only the GGUF picks the file up.
    _assert_trees_equal(load_model(gguf_dir).params, expected)
    # The tokenizer is rebuilt from the GGUF metadata and tokenizes like the original.
    text = "Paris is the capital of France.\ndef add(a, b): return a + b"
    assert loaded.tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer_encode(hf_dir, text)


def test_gguf_q8_0_dequantizes_like_transformers(tiny_llama_factory, tmp_path):
    """Quantized blocks: rows are permuted before quantizing (a row permutation commutes with
    llama.cpp's per-row blocks), so dequantize-then-unpermute gives transformers' weights."""
    from transformers import AutoModelForCausalLM

    hf_dir = tiny_llama_factory(seed=3, initializer_range=0.1, **GGUF_CASES["gqa-untied-hd32"])
    path = write_llama_gguf(tmp_path / "tiny-q8.gguf", hf_dir, qtype="Q8_0")
    loaded = load_model(path)
    hf_q8 = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    sd = {k: v.detach().float().numpy() for k, v in hf_q8.state_dict().items()}
    expected = hf_to_params(sd, loaded.config)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), loaded.params, expected)
    # ... and they are close to, but not equal to, the float weights.
    exact, _ = _hf_reference_params(hf_dir)
    q = loaded.params["params"]["layers"]["attn"]["q_proj"]["kernel"]
    q_exact = exact["params"]["layers"]["attn"]["q_proj"]["kernel"]
    assert not np.array_equal(q, q_exact)
    np.testing.assert_allclose(q, q_exact, atol=np.abs(q_exact).max() / 100)


def test_gguf_attention_biases_are_loaded_and_unpermuted(tiny_llama_factory, tmp_path):
    """A llama GGUF converted from a checkpoint with attention/MLP biases (llama.cpp's converter
    permutes q/k biases like the weights) must load with those biases, not drop them."""
    hf_dir = tiny_llama_factory(seed=4, attention_bias=True, mlp_bias=True, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16)
    biased = tmp_path / "biased"
    hf = _hf_model(hf_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
    hf.save_pretrained(biased, safe_serialization=True)
    for f in hf_dir.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, biased / f.name)
    path = write_llama_gguf(tmp_path / "biased.gguf", biased)
    loaded = load_model(path)
    expected, _ = _hf_reference_params(biased)
    assert loaded.config.qkv_bias and loaded.config.o_bias and loaded.config.mlp_bias
    _assert_trees_equal(loaded.params, expected)


# Unknown GGUF architectures: tests/models/test_gguf_families.py.


def test_corrupt_gguf_raises_value_error_naming_the_file(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ValueError, match="broken.gguf"):
        load_model(path)
