"""JAX's persistent compilation cache: on by default, a second start compiles nothing (every
program is a cache hit, counted apart from real compiles), None leaves it off, and a
directory that cannot be written costs a warning, not the start."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from orca_jax.cache_dirs import CACHE_DIR_ENV
from orca_jax.worker.compilation_cache import active_cache_dir, enable_compilation_cache

# A fresh process (the cache is process-wide): start an engine, serve one request, and report
# every program built since orca_jax was imported.
_CHILD = """
import json, sys
from orca_jax import LLMEngine, SamplingParams
from orca_jax.worker.compilation_cache import active_cache_dir
from orca_jax.worker.compile_guard import compile_counts
kwargs = json.loads(sys.argv[1])
engine = LLMEngine(**kwargs)
after_warmup = compile_counts()
engine.add_request("r", "The quick brown fox", SamplingParams(max_tokens=4, temperature=0.0))
while engine.has_unfinished_requests():
    engine.step()
total = compile_counts()
print("RESULT " + json.dumps({"programs": total.programs, "cache_hits": total.cache_hits,
                              "serving_programs": (total - after_warmup).programs,
                              "cache_dir": active_cache_dir(), "timings": engine.startup_timings}))
"""


def _start_engine(model_dir: Path, cache_root: Path, **settings) -> dict:
    kwargs = dict(model=str(model_dir), max_num_seqs=2, max_num_batched_tokens=16, page_size=8, num_pages=16,
                  max_model_len=64, **settings)
    env = dict(os.environ, **{CACHE_DIR_ENV: str(cache_root)})
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(kwargs)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_second_start_loads_every_program_from_the_default_cache(tiny_llama_dir, tmp_path):
    first = _start_engine(tiny_llama_dir, tmp_path)
    assert first["cache_dir"] == str(tmp_path / "xla"), "on by default, under the cache root"
    assert first["programs"] >= 2 and first["cache_hits"] == 0  # buckets 8 and 16, and the cache's zeros
    assert first["timings"]["warmup_programs"] == 2
    assert any((tmp_path / "xla").iterdir())

    second = _start_engine(tiny_llama_dir, tmp_path)
    assert second["programs"] == first["programs"]
    assert second["cache_hits"] == second["programs"], "a second start compiles nothing"
    assert second["timings"]["warmup_cache_hits"] == 2
    assert first["serving_programs"] == second["serving_programs"] == 0


def test_none_leaves_jax_compiling_without_a_cache(tiny_llama_dir, tmp_path):
    result = _start_engine(tiny_llama_dir, tmp_path, compilation_cache_dir=None)
    assert result["cache_dir"] is None and result["cache_hits"] == 0 and result["programs"] >= 2
    assert not (tmp_path / "xla").exists()


@pytest.fixture
def restore_cache_dir():
    """These tests switch the process-wide cache; put back whatever the session had."""
    before = active_cache_dir()
    yield
    if before is not None:
        enable_compilation_cache(before)
    elif active_cache_dir() is not None:
        from jax.experimental.compilation_cache import compilation_cache as jax_cache

        jax.config.update("jax_compilation_cache_dir", None)
        jax_cache.reset_cache()


def test_enable_is_idempotent_and_switches_directories(tmp_path, restore_cache_dir):
    assert enable_compilation_cache(tmp_path / "a")
    assert enable_compilation_cache(tmp_path / "a")
    assert active_cache_dir() == str(tmp_path / "a")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0, "small programs are cached too"
    jax.jit(lambda x: x * 3 + 1).lower(jax.numpy.ones(5)).compile()
    assert any((tmp_path / "a").iterdir())
    assert enable_compilation_cache(tmp_path / "b")
    jax.jit(lambda x: x * 5 - 2).lower(jax.numpy.ones(7)).compile()
    assert any((tmp_path / "b").iterdir()), "the new directory is the one written"


def test_an_unusable_directory_is_a_warning_and_changes_nothing(tmp_path, caplog, restore_cache_dir):
    before = active_cache_dir()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="orca_jax.worker.compilation_cache"):
        assert not enable_compilation_cache(blocker / "xla")
    assert "is not usable" in caplog.text and str(blocker / "xla") in caplog.text
    assert active_cache_dir() == before


def test_the_process_keeps_the_first_engines_cache(tmp_path, caplog, restore_cache_dir):
    """JAX's cache is per process: an engine's setting applies only while none is active; a
    later engine asking for another directory, or for none, is told and changes nothing."""
    from orca_jax.worker.compilation_cache import configure_for_process

    jax.config.update("jax_compilation_cache_dir", None)
    assert configure_for_process(None) is None and active_cache_dir() is None
    assert configure_for_process(tmp_path / "first") == str(tmp_path / "first")
    with caplog.at_level(logging.WARNING, logger="orca_jax.worker.compilation_cache"):
        assert configure_for_process(tmp_path / "first") == str(tmp_path / "first")
        assert not caplog.records, "asking for the active directory is quiet"
        assert configure_for_process(tmp_path / "second") == str(tmp_path / "first")
        assert configure_for_process(None) == str(tmp_path / "first")
    assert len(caplog.records) == 2 and all("already uses" in r.getMessage() for r in caplog.records)
    assert active_cache_dir() == str(tmp_path / "first") and not (tmp_path / "second").exists()
