"""Exported step programs (`orca_jax.worker.step_export`): a runner that reads its steps back from the
files traces nothing, compiles nothing after warm-up, updates the KV cache in place, and gives
exactly the tokens and logits of the plain traced step; anything that determines the program
changes the file's name, and a damaged file is exported again."""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np
import pytest

from orca_jax import SamplingParams
from orca_jax.worker import step_export
from orca_jax.worker import runner as runner_module
from orca_jax.worker.compile_guard import no_compiles
from orca_jax.engine.engine import LLMEngine
from orca_jax.worker.runner import ModelRunner

SETTINGS = dict(max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=8, page_size=8, num_pages=32,
                max_model_len=64, async_scheduling=False)
PROMPTS = ["The quick brown fox", "Paris is the capital of France, and Berlin is the", "def add(a, b):"]


@pytest.fixture
def exports_dir(tmp_path, monkeypatch):
    """Runners built in the test keep their exports under tmp_path (None: exports off)."""
    state = {"dir": str(tmp_path)}
    monkeypatch.setattr(runner_module, "active_cache_dir", lambda: state["dir"])
    return state


@pytest.fixture
def traces(monkeypatch):
    """Counts traces of the model's step (each is a call of model_step under jit)."""
    calls = []
    real = runner_module.model_step

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_module, "model_step", counting)
    return calls


def _run(tiny_llama_dir) -> tuple[list, list]:
    """Greedy tokens and every step's logits of three requests (prefill and decode, both buckets)."""
    engine = LLMEngine(model=str(tiny_llama_dir), make_runner=functools.partial(ModelRunner, keep_logits=True),
                       warmup=True, **SETTINGS)
    logits = []
    with no_compiles("serving"):
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = out.outputs[0].token_ids
            logits.append(np.asarray(engine.last_step.output.logits))
    return [tokens[f"r{i}"] for i in range(len(PROMPTS))], logits, engine


def test_read_back_programs_trace_nothing_and_give_the_traced_steps_tokens(tiny_llama_dir, exports_dir, traces):
    directory = exports_dir["dir"]
    exports_dir["dir"] = None
    plain_tokens, plain_logits, plain = _run(tiny_llama_dir)
    assert plain.runner._exports is None and len(traces) == 2  # buckets 8 and 16, traced

    exports_dir["dir"] = directory
    first_tokens, first_logits, first = _run(tiny_llama_dir)
    assert len(traces) == 4 and first.runner._exports.loaded == []  # exported now
    files = sorted(first.runner._exports.directory.glob("*" + step_export.SUFFIX))
    assert len(files) == 2

    again_tokens, again_logits, again = _run(tiny_llama_dir)
    assert len(traces) == 4, "read back: the model is not traced"
    assert sorted(again.runner._exports.loaded) == sorted(f.name for f in files)
    assert plain_tokens == first_tokens == again_tokens
    for a, b, c in zip(plain_logits, first_logits, again_logits, strict=True):
        assert np.array_equal(a, b) and np.array_equal(a, c)


def test_the_kv_cache_is_still_updated_in_place(tiny_llama_dir, exports_dir):
    # The programs of the test above (keep_logits), so nothing new compiles.
    engine = LLMEngine(model=str(tiny_llama_dir), make_runner=functools.partial(ModelRunner, keep_logits=True),
                       warmup=False, **SETTINGS)
    assert engine.runner._exports is not None
    engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()
    pointer = engine.runner.kv_cache.unsafe_buffer_pointer()
    while engine.has_unfinished_requests():
        engine.step()
        assert engine.runner.kv_cache.unsafe_buffer_pointer() == pointer, "donated: no copy of the cache"


def test_a_damaged_file_is_exported_again(tiny_llama_dir, exports_dir, traces, caplog):
    expected, _, first = _run(tiny_llama_dir)
    files = list((first.runner._exports.directory).glob("*" + step_export.SUFFIX))
    for f in files:
        f.write_bytes(f.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="orca_jax.worker.step_export"):
        tokens, _, again = _run(tiny_llama_dir)
    assert "cannot be used" in caplog.text and again.runner._exports.loaded == []
    assert tokens == expected and len(traces) == 4
    _, _, third = _run(tiny_llama_dir)
    assert len(third.runner._exports.loaded) == 2 and len(traces) == 4, "rewritten, then read back"


def test_the_key_changes_with_everything_that_fixes_the_program(monkeypatch):
    args = ({"w": jax.numpy.zeros((2, 3))}, np.zeros(4, np.int32))
    key = step_export.program_key({"config": "a"}, args)
    assert step_export.program_key({"config": "a"}, args) == key
    assert step_export.program_key({"config": "b"}, args) != key
    assert step_export.program_key({"config": "a"}, ({"w": jax.numpy.zeros((2, 4))}, args[1])) != key
    assert step_export.program_key({"config": "a"}, (args[0], np.zeros(4, np.float16))) != key
    # int64 is int32 to jax without x64: the same program, the same key.
    assert step_export.program_key({"config": "a"}, (args[0], np.zeros(4, np.int64))) == key
    assert step_export.program_key({"config": "a"}, ({"v": args[0]["w"]}, args[1])) != key
    for patch in (lambda: monkeypatch.setattr(step_export, "sources_digest", lambda: "other code"),
                  lambda: monkeypatch.setattr(step_export, "_version", lambda name: "0.0.0"),
                  lambda: jax.config.update("jax_default_matmul_precision", "highest")):
        step_export._environment.cache_clear()
        patch()
        assert step_export.program_key({"config": "a"}, args) != key
        monkeypatch.undo()
        jax.config.update("jax_default_matmul_precision", None)
    step_export._environment.cache_clear()
    assert step_export.program_key({"config": "a"}, args) == key


def test_the_runners_key_holds_its_static_parts(tiny_llama_dir, exports_dir):
    engine = LLMEngine(model=str(tiny_llama_dir), warmup=False, **SETTINGS)
    key = engine.runner._program_key("reference", keep_logits=False)
    assert key["model_config"] == repr(engine.runner.model_config)
    assert key["engine_config"] == repr(engine.runner.config) and "max_model_len=64" in key["engine_config"]
    assert key != engine.runner._program_key("reference", keep_logits=True)


def test_no_compilation_cache_means_no_exports(tiny_llama_dir, exports_dir):
    exports_dir["dir"] = None
    assert step_export.exports_for(None, {}, (1, 2)) is None
    engine = LLMEngine(model=str(tiny_llama_dir), warmup=False, **SETTINGS)
    assert engine.runner._exports is None


def test_a_step_jax_export_refuses_is_lowered_as_traced(tiny_llama_dir, exports_dir, monkeypatch, caplog):
    """(GPU kernels' custom calls may not be exportable.) The runner then traces its step at
    every start, and serves as before."""
    def refuse(*args, **kwargs):
        raise ValueError("custom call not guaranteed stable")

    monkeypatch.setattr(jax.export, "export", refuse)
    with caplog.at_level(logging.WARNING, logger="orca_jax.worker.step_export"):
        tokens, _, engine = _run(tiny_llama_dir)
    assert "refused" in caplog.text and engine.runner._exports.refused.startswith("ValueError")
    assert len(tokens) == len(PROMPTS) and all(len(t) == 5 for t in tokens)
