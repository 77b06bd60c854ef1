"""Random Llama checkpoints for benchmarks that measure the engine, not the model.

`write_random_checkpoint` writes an HF-format directory (config.json, model.safetensors and a
tokenizer) with random weights of a given Llama config, in numpy and safetensors only (no
torch), so the real loader runs on it: `LLMEngine(model=directory)`. The GPU scripts in
benchmarks/ use it for Llama-3.2-1B shapes (the device machine has no network).

`write_host_model` writes the models of `bench host`: a Llama with the embedded default
model's tokenizer saved next to it (`save_pretrained`), so the vocabulary (49,152 for SmolLM2)
and detokenization are the real ones and only the layers are small. `HOST_MODELS` holds their
sizes; bench host's module docstring says why each is what it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# Shared by the host models: Llama blocks with GQA, an untied head, a context of 8192 (the
# largest max_model_len bench host runs at). The vocabulary is the tokenizer's unless a model
# names a smaller vocab_size.
_HOST_BASE = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=8192,
                  tie_word_embeddings=False)
HOST_MODELS: dict[str, dict[str, Any]] = {
    # The host parts at their real cost: the whole vocabulary, layers as small as they go.
    "tiny": dict(_HOST_BASE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    # The same layers over the first 8,192 ids: its device step is 2-4x today's host work on
    # a 2-core CPU (orca_jax/bench/host.py says how that was measured).
    "balanced": dict(_HOST_BASE, vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}


def write_random_checkpoint(directory: Path, config: dict, dtype: str, seed: int = 0, tokenizer=None) -> Path:
    """config.json + model.safetensors with random weights of the right shapes + a tokenizer:
    `tokenizer` saved with `save_pretrained`, or (None) a byte-level one that can detokenize
    any id below 259."""
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    D, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    N, K, H = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32

    def w(*shape, scale=0.02):
        return (rng.standard_normal(shape, np.float32) * scale).astype(np_dtype)

    tensors = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": np.ones(D, np_dtype)}
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = w(V, D)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(N * H, D), p + "self_attn.k_proj.weight": w(K * H, D),
            p + "self_attn.v_proj.weight": w(K * H, D), p + "self_attn.o_proj.weight": w(D, N * H),
            p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D),
            p + "mlp.down_proj.weight": w(D, F),
            p + "input_layernorm.weight": np.ones(D, np_dtype), p + "post_attention_layernorm.weight": np.ones(D, np_dtype),
        }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    if tokenizer is None:
        write_byte_tokenizer(directory)
    else:
        tokenizer.save_pretrained(directory)
    return directory


def write_byte_tokenizer(directory: Path) -> None:
    """A byte-level BPE with no merges: enough to detokenize whatever ids the model emits."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>"] + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(directory)


def default_model_tokenizer():
    """The tokenizer the embedded default model loads (built from its GGUF metadata, no torch)."""
    import gguf

    from orca_jax.loading.gguf_tokenizer import tokenizer_from_gguf
    from orca_jax.loading.loader import default_model_path

    return tokenizer_from_gguf(gguf.GGUFReader(str(default_model_path())))


def host_model_config(name: str, tokenizer) -> dict[str, Any]:
    """The config.json of host model `name`, with the tokenizer's vocabulary and special ids."""
    if name not in HOST_MODELS:
        raise ValueError(f"unknown host model {name!r}; choose from {sorted(HOST_MODELS)}")
    config = dict(HOST_MODELS[name], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    # A model may use only the first ids of the vocabulary (they are real tokens, so its text
    # is still real), never more ids than the tokenizer has.
    config.setdefault("vocab_size", len(tokenizer))
    if not 0 < config["vocab_size"] <= len(tokenizer):
        raise ValueError(f"host model {name!r}: vocab_size {config['vocab_size']} is not in [1, {len(tokenizer)}]")
    return config


def write_host_model(directory: Path, name: str, tokenizer=None, seed: int = 0) -> Path:
    """A random float32 host model `name` (see HOST_MODELS) in `directory`, with `tokenizer`
    (default: the embedded default model's) saved beside it."""
    tokenizer = tokenizer if tokenizer is not None else default_model_tokenizer()
    return write_random_checkpoint(Path(directory), host_model_config(name, tokenizer), "float32", seed, tokenizer)
