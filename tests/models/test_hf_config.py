"""HF config.json -> ModelConfig: the keys families share (orca_jax/models/hf_config.py), the
pick of the family's own parser by the registry (`orca_jax.models.config_from_hf`), and the
checks of what the registries support. Each family's own fields: test_model_families.py."""

from __future__ import annotations

import inspect

import pytest

from orca_jax.models import ARCHITECTURES, SUPPORTED_ACTIVATIONS, config_from_hf, hf_config
from orca_jax.models.layers import ACTIVATIONS

_LLAMA_BASE = dict(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)


def test_llama_config_fields():
    hf = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=128,
              num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
              rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
              eos_token_id=[5, 6], rope_parameters={"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192})
    c = config_from_hf(hf)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta) == (3, 8, 2, 32, 5e5)
    assert c.tie_word_embeddings and c.qkv_bias and c.o_bias and c.mlp_bias  # attention_bias: all four
    assert c.eos_token_ids == (5, 6)
    assert c.rope_scaling_dict == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_llama_defaults_and_old_rope_layout():
    c = config_from_hf({**_LLAMA_BASE, "rope_theta": 1234.0})
    assert (c.model_type, c.num_kv_heads, c.head_dim, c.rope_theta, c.rope_scaling) == ("llama", 4, 16, 1234.0, None)
    assert (c.qkv_bias, c.o_bias, c.mlp_bias, c.hidden_act, c.eos_token_ids) == (False, False, False, "silu", ())


def test_legacy_and_new_rope_config_layouts_agree():
    base = dict(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    new = config_from_hf({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    old = config_from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
    older = config_from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}})
    assert new == old == older
    assert new.rope_theta == 5e5 and new.rope_scaling_dict == {"rope_type": "llama3", **scaling}
    plain = config_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4
    with pytest.raises(ValueError, match="unsupported rope scaling 'chunked'"):
        config_from_hf({**base, "rope_parameters": {"rope_type": "chunked", "rope_theta": 1e4, "factor": 4.0}})


@pytest.mark.parametrize("value, ids", [(7, (7,)), ([5, 6], (5, 6)), (None, ())])
def test_eos_token_id_as_one_id_a_list_or_none(value, ids):
    assert hf_config.eos_token_ids({"eos_token_id": value}) == ids
    assert config_from_hf({**_LLAMA_BASE, "eos_token_id": value}).eos_token_ids == ids


def test_unsupported_rope_model_type_and_head_counts_are_named():
    with pytest.raises(ValueError, match="unsupported rope scaling 'proportional'; supported: .*yarn"):
        config_from_hf({**_LLAMA_BASE, "rope_scaling": {"rope_type": "proportional", "factor": 2.0}})
    with pytest.raises(ValueError, match="unsupported model_type 'bert'; supported: llama, mistral, qwen2, qwen3, gpt2"):
        config_from_hf({**_LLAMA_BASE, "model_type": "bert"})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        config_from_hf({**_LLAMA_BASE, "num_key_value_heads": 3})


def test_supported_activations_are_the_layers_and_each_parses():
    assert SUPPORTED_ACTIVATIONS == tuple(ACTIVATIONS)
    for act in SUPPORTED_ACTIVATIONS:
        assert config_from_hf({**_LLAMA_BASE, "hidden_act": act}).hidden_act == act
    with pytest.raises(ValueError, match="unsupported hidden_act 'relu'; supported: " + ", ".join(ACTIVATIONS)):
        config_from_hf({**_LLAMA_BASE, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="hidden_act 'gelu_fast'"):  # GPT-2 spells it activation_function
        config_from_hf(dict(model_type="gpt2", vocab_size=10, n_embd=64, n_layer=1, n_head=4,
                            activation_function="gelu_fast"))


def test_each_family_owns_its_parser():
    """The registry takes each family's parser and converter from one file: its model's, or
    (Phi-3, which runs the Llama model) a file of its own that imports the model's."""
    for model_type, arch in ARCHITECTURES.items():
        home = inspect.getmodule(arch.config_from_hf)
        assert inspect.getmodule(arch.hf_to_params) is home, model_type
        model_home = inspect.getmodule(arch.model_class)
        assert model_home is home or model_home in vars(home).values(), model_type
        assert config_from_hf({"architectures": [arch.hf_class_name], **_fields_of(model_type)}).model_type == model_type


def _fields_of(model_type: str) -> dict:
    if model_type == "gpt2":
        return dict(vocab_size=10, n_embd=64, n_layer=1, n_head=4)
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe"):
        return dict(_LLAMA_BASE, num_local_experts=4, num_experts_per_tok=2)
    if model_type == "gpt_oss":  # its defaults are the 120b's: 8 KV heads, 128 experts
        return dict(_LLAMA_BASE, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2)
    return dict(_LLAMA_BASE)
