"""ModelRunner: warm-up compiles the token buckets in parallel, each once, and nothing compiles
while serving; the KV pool decides max_model_len when it came from the model."""

from __future__ import annotations

import threading

import jax
import pytest

from orca_jax import SamplingParams
from orca_jax.worker import runner as runner_module
from orca_jax.worker.compile_guard import compile_counts, no_compiles

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=8, page_size=8, num_pages=64, max_model_len=128)


def test_warmup_compiles_buckets_concurrently_each_once_then_nothing_while_serving(tiny_engine_factory,
                                                                                     monkeypatch):
    engine = tiny_engine_factory(**SMALL, warmup=False)
    buckets = engine.config.token_buckets
    assert buckets == (8, 16, 32)
    # The first two compiles meet at a barrier: if they ran one after the other, it breaks.
    both_running = threading.Barrier(2, timeout=120)
    threads: list[str] = []
    compile_alone = jax.stages.Lowered.compile

    def compile_in_pool(lowered, *args, **kwargs):
        threads.append(threading.current_thread().name)
        if len(threads) <= 2:
            both_running.wait()
        return compile_alone(lowered, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_in_pool)
    monkeypatch.setattr(runner_module, "compile_workers", lambda n: max(1, min(n, 2)))

    report = engine.runner.warmup()
    assert report.buckets == buckets
    assert report.counts.programs == len(buckets), report.counts
    assert len(threads) == len(buckets) and all(t.startswith("compile") for t in threads)
    assert sorted(engine.runner._programs) == list(buckets)

    again = engine.runner.warmup()
    assert again.buckets == () and again.counts.programs == 0, "a bucket is built once"

    prompts = ["The quick brown fox", "Paris is the capital of France, and Berlin is", "def add(a, b):"]
    with no_compiles("serving"):
        for i, prompt in enumerate(prompts):  # prefill of all three: more than one bucket
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.allocator.num_used == 0


def test_warmup_of_chosen_buckets_and_lazy_buckets_compile_once(tiny_engine_factory):
    engine = tiny_engine_factory(**SMALL, warmup=False)
    before = compile_counts()
    report = engine.runner.warmup(buckets=[8, 32, 8])
    assert report.buckets == (8, 32) and (compile_counts() - before).programs == 2
    engine.add_request("r", "The quick brown fox", SamplingParams(max_tokens=3, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()  # prefill (bucket 8) and decode (bucket 8): already built
    assert (compile_counts() - before).programs == 2
    with pytest.raises(ValueError, match="not a compiled bucket"):
        engine.runner.warmup(buckets=[24])


def test_max_model_len_is_the_models_when_the_pool_holds_one_sequence(tiny_engine_factory, caplog):
    """The tiny model declares 512 positions: 64 pages of 8 (plus the padding page) hold one."""
    engine = tiny_engine_factory(**dict(SMALL, max_model_len=None, num_pages=65), warmup=False)
    assert engine.config.max_model_len == 512 == engine.model_config.max_position_embeddings
    with caplog.at_level("WARNING", logger="orca_jax.core.kv_cache"):
        small = tiny_engine_factory(**dict(SMALL, max_model_len=None, num_pages=24), warmup=False)
    assert small.config.max_model_len == 23 * 8
    assert small.scheduler.config.max_model_len == 23 * 8 and small.runner.config is small.config
    assert "max_model_len lowered from 512 (the model's context) to 184" in caplog.text
    # The lowered length is the one requests are checked against.
    small.add_request("fits", list(range(3, 3 + 183)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_model_len"):
        small.add_request("long", list(range(3, 3 + 184)), SamplingParams(max_tokens=1))
    small.abort("fits")
    small.step()


def test_an_explicit_max_model_len_longer_than_the_pool_is_kept_with_a_warning(tiny_engine_factory, caplog):
    with caplog.at_level("WARNING", logger="orca_jax.core.kv_cache"):
        engine = tiny_engine_factory(**dict(SMALL, max_model_len=256, num_pages=24), warmup=False)
    assert engine.config.max_model_len == 256
    assert "max_model_len 256 is longer than the KV pool (24 pages, 184 tokens)" in caplog.text
