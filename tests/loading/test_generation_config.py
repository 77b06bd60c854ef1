"""--generation-config: the model's generation_config.json sampling values as request defaults,
and a request's own values winning over them."""

from __future__ import annotations

import json
import logging

import pytest

from orca_jax.entrypoints.protocol import CompletionRequest
from orca_jax.loading.generation_config import sampling_defaults

FILE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "max_new_tokens": 99, "eos_token_id": 2}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(FILE))
    return tmp_path


def test_auto_reads_the_sampling_values_and_logs_them(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="orca_jax.loading.generation_config"):
        assert sampling_defaults("auto", model_dir) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert "temperature=0.6" in caplog.text and "--generation-config vllm" in caplog.text


def test_vllm_none_and_a_file_model_none(model_dir, tmp_path):
    assert sampling_defaults("vllm", model_dir) == {}
    assert sampling_defaults("auto", model_dir / "model.gguf") == {} and sampling_defaults("auto", None) == {}


def test_a_directory_is_read_and_one_without_the_file_refused(model_dir, tmp_path_factory):
    assert sampling_defaults(str(model_dir), None)["top_k"] == 20
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(str(tmp_path_factory.mktemp("empty")), None)


def test_a_requests_own_fields_win_and_missing_ones_take_the_defaults():
    defaults = {"temperature": 0.6, "top_k": 20}
    missing = CompletionRequest(model="m", prompt="hi").sampling_params(8, None, defaults=defaults)
    assert (missing.temperature, missing.top_k, missing.top_p) == (0.6, 20, 1.0)
    given = CompletionRequest(model="m", prompt="hi", temperature=0.0, top_k=-1).sampling_params(8, None,
                                                                                                defaults=defaults)
    assert (given.temperature, given.top_k) == (0.0, 0)


def test_the_engine_and_llm_take_the_models_defaults(tiny_llama_dir, tmp_path, tiny_engine_factory):
    import shutil

    from orca_jax.entrypoints.llm import LLM

    for path in tiny_llama_dir.iterdir():
        shutil.copy(path, tmp_path / path.name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "repetition_penalty": 1.3}))
    engine = tiny_engine_factory(model=str(tmp_path))
    assert engine.sampling_defaults == {"temperature": 0.0, "repetition_penalty": 1.3}
    params = engine.default_sampling_params()
    assert params.temperature == 0.0 and params.repetition_penalty == 1.3
    llm = LLM.__new__(LLM)
    llm.engine = engine
    assert llm.get_default_sampling_params() == params
