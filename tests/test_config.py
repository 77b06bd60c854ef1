"""EngineConfig validation, bucket derivation and ModelConfig parsing of HF config fields."""

import pytest

from orca_jax.config import EngineConfig, ModelConfig


def _model(**overrides) -> ModelConfig:
    cfg = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
               num_kv_heads=2, head_dim=8, max_position_embeddings=1024)
    cfg.update(overrides)
    return ModelConfig(**cfg)


def test_token_buckets_are_powers_of_two_ending_at_the_budget():
    cfg = EngineConfig(max_num_batched_tokens=96, max_num_seqs=8, min_token_bucket=8).resolve(_model())
    assert cfg.token_buckets == (8, 16, 32, 64, 96)
    assert [cfg.seq_bucket(t) for t in cfg.token_buckets] == [8, 8, 8, 8, 8]
    assert cfg.seq_bucket(4) == 4


def test_max_model_len_defaults_to_the_models_context():
    assert EngineConfig().resolve(_model(max_position_embeddings=1024)).max_model_len == 1024
    assert EngineConfig().resolve(_model(max_position_embeddings=131072)).max_model_len == 131072
    assert EngineConfig(max_model_len=512).resolve(_model()).max_model_len == 512
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=2048).resolve(_model(max_position_embeddings=1024))


def test_kv_pool_lowers_only_the_models_context():
    """One sequence of the model's length must fit the pool (page 0 holds no sequence);
    otherwise the context drops to whole pages that do. An explicit length stays."""
    model = _model(max_position_embeddings=1024)
    default = EngineConfig(page_size=16).resolve(model)
    assert default.fit_kv_pool(num_pages=65).max_model_len == 1024  # 64 pages: exactly one sequence
    lowered = default.fit_kv_pool(num_pages=40)
    assert lowered.max_model_len == 39 * 16 and lowered.max_pages_per_seq == 39
    assert lowered.fit_kv_pool(num_pages=40) == lowered, "fitting twice changes nothing"
    assert lowered.resolve(model).max_model_len_from_model, "resolving again keeps where the length came from"
    explicit = EngineConfig(page_size=16, max_model_len=1024).resolve(model)
    assert explicit.fit_kv_pool(num_pages=40).max_model_len == 1024


def test_max_pages_per_seq_rounds_up():
    cfg = EngineConfig(max_model_len=100, page_size=16).resolve(_model())
    assert cfg.max_pages_per_seq == 7


@pytest.mark.parametrize("kwargs, field", [
    (dict(dtype="float16"), "dtype"),
    (dict(scheduling="fifo"), "scheduling"),
    (dict(attention_impl="cuda"), "attention_impl"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(page_size=0), "page_size"),
    (dict(num_pages=1), "num_pages"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32), "max_num_batched_tokens"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
])
def test_invalid_engine_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_hf_config_fields():
    hf = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=128,
              num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
              rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
              eos_token_id=[5, 6], rope_parameters={"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192})
    c = ModelConfig.from_hf_dict(hf)
    assert (c.num_kv_heads, c.head_dim, c.rope_theta) == (2, 32, 5e5)
    assert c.tie_word_embeddings and c.attention_bias and c.mlp_bias
    assert c.eos_token_ids == (5, 6)
    assert c.rope_scaling_dict == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}


def test_hf_config_defaults_and_old_rope_layout():
    c = ModelConfig.from_hf_dict(dict(vocab_size=10, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4, rope_theta=1234.0))
    assert (c.num_kv_heads, c.head_dim, c.rope_theta, c.rope_scaling) == (4, 16, 1234.0, None)


def test_unsupported_rope_and_model_type_are_named():
    base = dict(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="bert.*supported: llama"):
        ModelConfig.from_hf_dict({**base, "model_type": "bert"})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_hf_dict({**base, "num_key_value_heads": 3})
