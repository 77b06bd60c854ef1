"""Shared fixtures: tiny random Llama checkpoints saved with transformers, and engines on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TINY_VOCAB = 512
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Iteration-level scheduling lets finished requests leave after every step.",
    "Selective batching flattens all tokens of all requests into one axis.",
    "def add(a, b):\n    return a + b\n",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; :",
] * 20


def make_tokenizer(directory: Path) -> None:
    """A small byte-level BPE tokenizer (vocab TINY_VOCAB) saved in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(directory)


def make_tiny_llama(directory: Path, seed: int = 0, **overrides) -> Path:
    """Save a random LlamaForCausalLM (float32) with `save_pretrained`, plus a tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).to(torch.float32).eval()
    # Random init has tiny weights; scale the norms so the logits are not all near zero.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    make_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def torch_single_thread():
    """PyTorch is only the reference in tests. On a small shared CPU its OpenMP threads spin-wait
    against JAX's and the other test processes (a 135M forward is ~6x slower with 2 threads
    than with 1), so run it single-threaded and restore the setting afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_factory(tmp_path_factory):
    """make(**LlamaConfig overrides) -> directory of a saved random model (cached per settings)."""
    cache: dict[str, Path] = {}

    def make(seed: int = 0, **overrides) -> Path:
        key = json.dumps({"seed": seed, **overrides}, sort_keys=True)
        if key not in cache:
            cache[key] = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """GQA (4 query heads over 2 KV heads), untied head, head_dim 16."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_llama_dir):
    """Build LLMEngines on the tiny model with small buckets; compile-heavy, so reuse them."""
    from orca_jax.engine import LLMEngine

    def build(**overrides):
        settings = dict(model=str(tiny_llama_dir), max_num_seqs=8, max_num_batched_tokens=32,
                        page_size=8, num_pages=64, max_model_len=256)
        settings.update(overrides)
        return LLMEngine(**settings)

    return build


def read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())
