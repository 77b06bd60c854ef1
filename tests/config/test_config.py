"""EngineConfig validation and bucket derivation, ModelConfig's own checks. (Reading HF
config.json into a ModelConfig is the model families' job: tests/models/test_hf_config.py.)"""

import pytest

from orca_jax import kernels
from orca_jax.config import ATTENTION_IMPLS, EngineConfig, ModelConfig


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
    (dict(dtype="float8"), "dtype"),
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


def test_attention_impls_are_the_kernel_registrys_plus_auto():
    assert ATTENTION_IMPLS == ("auto", *kernels.available_impls())
    assert {"reference", "pallas_gpu", "pallas_tpu"} <= set(ATTENTION_IMPLS)
    for impl in ATTENTION_IMPLS:
        assert EngineConfig(attention_impl=impl).attention_impl == impl


def test_model_config_checks_its_head_counts():
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        _model(num_kv_heads=3)


@pytest.mark.parametrize("name,storage", [("int8", "int8"), ("fp8_e4m3", "float8_e4m3fn"), ("fp8", "float8_e4m3fn"),
                                          ("bfloat16", "bfloat16"), ("auto", "float32")])
def test_kv_cache_dtype_names_resolve_to_their_storage_dtype(name, storage):
    assert EngineConfig(kv_cache_dtype=name, dtype="float32").resolved_kv_cache_dtype("cpu") == storage


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="int4")
