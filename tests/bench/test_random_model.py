"""Random checkpoints for the benchmarks load through the real loader, with the tokenizer they
were given: the default model's for bench host (its real vocabulary), a byte-level one else."""

from __future__ import annotations

import json

import numpy as np
import pytest

from orca_jax.bench.random_model import (HOST_MODELS, default_model_tokenizer, host_model_config,
                                         write_host_model, write_random_checkpoint)
from orca_jax.loading.loader import load_model


@pytest.fixture(scope="module")
def default_tokenizer():
    return default_model_tokenizer()


@pytest.mark.parametrize("name", sorted(HOST_MODELS))
def test_host_model_loads_with_the_default_tokenizer(name, default_tokenizer, tmp_path):
    directory = write_host_model(tmp_path / name, name, default_tokenizer)
    loaded = load_model(str(directory))
    spec = HOST_MODELS[name]
    assert loaded.config.vocab_size == spec.get("vocab_size", len(default_tokenizer))
    assert loaded.config.hidden_size == spec["hidden_size"] and loaded.config.num_layers == spec["num_hidden_layers"]
    assert loaded.config.max_position_embeddings == 8192
    assert default_tokenizer.eos_token_id in loaded.config.eos_token_ids
    # The saved tokenizer is the default model's: same vocabulary, same text for the same ids.
    assert len(loaded.tokenizer) == len(default_tokenizer)
    ids = list(range(100, loaded.config.vocab_size, max(1, loaded.config.vocab_size // 50)))
    assert loaded.tokenizer.decode(ids) == default_tokenizer.decode(ids)
    embed = loaded.params["params"]
    assert any(np.asarray(leaf).shape[0] == loaded.config.vocab_size for leaf in _leaves(embed))


def test_tiny_uses_the_whole_vocabulary_and_balanced_a_prefix(default_tokenizer):
    assert host_model_config("tiny", default_tokenizer)["vocab_size"] == len(default_tokenizer) == 49152
    assert host_model_config("balanced", default_tokenizer)["vocab_size"] == 8192


def test_host_model_config_refuses_unknown_names_and_oversized_vocabularies(default_tokenizer, monkeypatch):
    with pytest.raises(ValueError, match="unknown host model 'huge'"):
        host_model_config("huge", default_tokenizer)
    monkeypatch.setitem(HOST_MODELS, "wide", dict(HOST_MODELS["tiny"], vocab_size=len(default_tokenizer) + 1))
    with pytest.raises(ValueError, match="vocab_size"):
        host_model_config("wide", default_tokenizer)


def test_random_checkpoint_without_a_tokenizer_gets_a_byte_level_one(tmp_path):
    config = dict(HOST_MODELS["tiny"], vocab_size=300, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    directory = write_random_checkpoint(tmp_path / "bytes", config, "bfloat16", seed=3)
    assert json.loads((directory / "config.json").read_text()) == config
    loaded = load_model(str(directory))
    assert loaded.config.vocab_size == 300 and loaded.config.tie_word_embeddings
    text = "héllo, wörld"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(text)) == text


def _leaves(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    else:
        yield tree
