"""SpeculativeConfig: vLLM's keys from a dict, JSON text or the dataclass; bad values named."""

from __future__ import annotations

import pytest

from orca_jax.config import EngineConfig
from orca_jax.config.speculative import SpeculativeConfig


def test_a_dict_and_its_json_give_the_same_config():
    value = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    from_dict = EngineConfig(speculative_config=value).speculative_config
    from_json = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 5, '
                                                '"prompt_lookup_max": 4, "prompt_lookup_min": 1}').speculative_config
    assert from_dict == from_json == SpeculativeConfig("ngram", 5, 4, 1)
    assert EngineConfig(speculative_config=from_dict).speculative_config is from_dict
    assert EngineConfig().speculative_config is None and EngineConfig().num_speculative_tokens == 0


def test_one_lookup_bound_given_keeps_the_pair_ordered():
    assert SpeculativeConfig.from_value({"prompt_lookup_max": 1}).prompt_lookup_min == 1
    assert SpeculativeConfig.from_value({"prompt_lookup_min": 7}).prompt_lookup_max == 7


@pytest.mark.parametrize("value, named", [
    ({"method": "eagle"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_min"),
    ({"backoff_steps": 0}, "backoff_steps"),
    ({"model": 3}, "model"),
    ({"draft_tensor_parallel_size": 1}, "unknown key"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a dict"),
])
def test_bad_values_are_refused_naming_the_key(value, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(speculative_config=value)


def test_logits_rows_cover_one_position_per_token_at_most():
    plain = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64)
    spec = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, speculative_config={"num_speculative_tokens": 3})
    assert [plain.logits_rows(t) for t in (8, 16, 64)] == [8, 8, 8]
    # Rows of 1 + 3 positions, never more positions than the bucket has tokens.
    assert [spec.logits_rows(t) for t in (8, 16, 64)] == [8, 16, 32]


def test_disable_by_batch_size_is_a_positive_integer_or_none():
    assert SpeculativeConfig.from_value({"disable_by_batch_size": 8}).disable_by_batch_size == 8
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig.from_value({"disable_by_batch_size": 0})
