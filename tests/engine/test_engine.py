"""LLMEngine on the tiny random Llama: batch invariance under chunked prefill and preemption,
zero compiles after warm-up, bad input, failing steps, and the request-facing behaviour
(abort, n, stop strings / token ids, length, ignore_eos, logprobs, streaming)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from orca_jax import SamplingParams
from orca_jax.worker.compile_guard import compile_count, no_compiles
from orca_jax.engine.engine import LLMEngine
from orca_jax.core.sequence import SequenceStatus

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    """One engine for the module (three token buckets: 8, 16, 32). The pool is small
    (23 usable pages of 8 tokens) so that batches of long prompts preempt."""
    return tiny_engine_factory(max_num_seqs=8, max_num_batched_tokens=32, min_token_bucket=8, page_size=8,
                               num_pages=24, max_model_len=128)


@pytest.fixture(autouse=True)
def leave_engine_clean(request):
    """A failing test must not leave requests behind in the shared engine. (Set up before, so
    torn down after, monkeypatch: the cleanup runs with the real runner and scheduler.)"""
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        for request_id in list(engine.requests):
            engine.abort(request_id)
        while engine.has_unfinished_requests():
            engine.step()


def greedy(max_tokens=12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert not engine.requests, f"requests left behind: {list(engine.requests)}"
    assert engine.num_free_pages == engine.allocator.num_usable, "KV pages leaked"


def drain(engine: LLMEngine, max_steps: int = 5000) -> tuple[dict, dict]:
    """Step until idle. Returns (final output per request, list of outputs per request)."""
    final, history = {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            history.setdefault(out.request_id, []).append(out)
            assert out.request_id not in final, "output after the request finished"
            if out.finished:
                final[out.request_id] = out
    else:
        raise AssertionError("engine did not finish")
    return final, history


def run_batch(engine, requests) -> dict:
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    final, _ = drain(engine)
    assert set(final) == {r[0] for r in requests}
    assert_idle(engine)
    return final


_solo_counter = iter(range(10**9))


def run_alone(engine, prompt, params):
    request_id = f"solo-{next(_solo_counter)}"
    return run_batch(engine, [(request_id, prompt, params)])[request_id]


@pytest.fixture(scope="module")
def reference(engine):
    """The greedy continuation of PROMPT, run alone."""
    out = run_alone(engine, PROMPT, greedy(16, ignore_eos=True))
    assert len(out.token_ids) == 16 and out.finish_reason == "length"
    return out


def assert_serves_normally(engine, reference):
    assert_idle(engine)
    out = run_alone(engine, PROMPT, greedy(16, ignore_eos=True))
    assert out.token_ids == reference.token_ids and out.text == reference.text
    assert_idle(engine)


# ---------------------------------------------------------------------------------------------
# Batch invariance
# ---------------------------------------------------------------------------------------------
LENGTHS = [1, 2, 3, 5, 7, 8, 9, 12, 15, 16, 17, 20, 23, 31, 32, 33, 38, 41, 47, 50, 55, 60, 64, 70]


def mixed_prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 434, size=n).tolist() for n in LENGTHS]
    rng.shuffle(prompts)
    return prompts


class StepRecorder:
    """Wraps scheduler.schedule to record what each step contained."""

    def __init__(self, scheduler):
        self.real = scheduler.schedule
        self.steps = []

    def __call__(self):
        scheduled = self.real()
        # Per row: tokens cached before it, its new tokens, the sequence's tokens before it
        # (pending ones included, this row's sample not).
        self.steps.append([(start, n, s.num_tokens + s.num_pending - samples) for s, n, start, samples
                           in zip(scheduled.seqs, scheduled.num_new, scheduled.starts, scheduled.samples)])
        return scheduled


def test_batched_greedy_equals_solo(engine, monkeypatch):
    assert len(LENGTHS) == 24
    prompts = mixed_prompts(0)
    params = greedy(10, ignore_eos=True)
    solo = [run_alone(engine, p, params) for p in prompts]

    recorder = StepRecorder(engine.scheduler)
    monkeypatch.setattr(engine.scheduler, "schedule", recorder)
    preemptions = engine.scheduler.num_preemptions
    batched = run_batch(engine, [(f"b{i}", p, params) for i, p in enumerate(prompts)])

    assert engine.scheduler.num_preemptions > preemptions, "the pool was meant to force preemption"
    steps = recorder.steps
    assert any(c + n < t - 1 for step in steps for c, n, t in step), "no chunked prefill happened"
    assert any(any(t - c == 1 for c, n, t in step) and any(t - c > 1 for c, n, t in step) for step in steps), \
        "no step mixed decodes with prefills"
    assert max(len(step) for step in steps) == engine.config.max_num_seqs
    for i, (prompt, alone) in enumerate(zip(prompts, solo)):
        out = batched[f"b{i}"]
        assert out.prompt_token_ids == prompt
        assert out.token_ids == alone.token_ids, f"request {i} (prompt of {len(prompt)} tokens) differs"
        assert out.text == alone.text and out.finish_reason == alone.finish_reason == "length"


def test_batched_seeded_sampling_equals_solo(engine):
    prompts = mixed_prompts(1)[:16]
    variants = [dict(), dict(top_k=20), dict(top_p=0.9), dict(min_p=0.05), dict(top_k=50, top_p=0.8),
                dict(repetition_penalty=1.2), dict(presence_penalty=0.5, frequency_penalty=0.3)]
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=1000 + i, ignore_eos=True,
                             **variants[i % len(variants)]) for i in range(len(prompts))]
    solo = [run_alone(engine, p, sp) for p, sp in zip(prompts, params)]
    preemptions = engine.scheduler.num_preemptions
    batched = run_batch(engine, [(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    assert engine.scheduler.num_preemptions > preemptions
    for i, alone in enumerate(solo):
        assert batched[f"s{i}"].token_ids == alone.token_ids, f"seeded request {i} differs when batched"
    # The draws are really random: different seeds give different streams.
    again = run_alone(engine, prompts[0], SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True))
    assert again.token_ids != solo[0].token_ids


def use_request_level_policy(engine, monkeypatch):
    """Switch the module engine's scheduler to Orca's request-level baseline (same programs)."""
    monkeypatch.setattr(engine.scheduler, "config", dataclasses.replace(engine.config, scheduling="request"))


def test_request_level_policy_gives_the_same_tokens(engine, monkeypatch):
    prompts = mixed_prompts(2)[:10]
    params = greedy(8, ignore_eos=True)
    solo = [run_alone(engine, p, params).token_ids for p in prompts]
    use_request_level_policy(engine, monkeypatch)
    preemptions = engine.scheduler.num_preemptions
    batched = run_batch(engine, [(f"req-{i}", p, params) for i, p in enumerate(prompts)])
    assert [batched[f"req-{i}"].token_ids for i in range(len(prompts))] == solo
    assert engine.scheduler.num_preemptions == preemptions


# ---------------------------------------------------------------------------------------------
# Zero compiles after warm-up
# ---------------------------------------------------------------------------------------------
def test_no_compiles_after_warmup(tiny_engine_factory):
    eng = tiny_engine_factory(max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=8, page_size=8,
                              num_pages=40, max_model_len=128)
    assert eng.config.token_buckets == (8, 16)
    compile_count()  # the listener is registered before the workload
    rng = np.random.default_rng(7)
    workload = [
        ("greedy-short", "Paris is", greedy(6)),
        ("greedy-long", rng.integers(3, 434, size=37).tolist(), greedy(5, ignore_eos=True)),
        ("sampled", PROMPT, SamplingParams(max_tokens=7, temperature=0.9, seed=1)),
        ("topk", "def add(a, b):", SamplingParams(max_tokens=6, temperature=0.7, top_k=5)),
        ("topp-minp", "0123456789", SamplingParams(max_tokens=6, temperature=1.2, top_p=0.8, min_p=0.1)),
        ("penalties", "Selective batching", SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3,
                                                            presence_penalty=0.4, frequency_penalty=0.6)),
        ("logprobs", "Iteration-level", SamplingParams(max_tokens=5, temperature=0.5, logprobs=3)),
        ("n2", "The lazy dog", SamplingParams(max_tokens=6, temperature=0.8, n=2, seed=3)),
        ("stop", PROMPT, greedy(12, stop=["Se", "is"], ignore_eos=True)),
        ("stop-ids", "Berlin", greedy(12, stop_token_ids=[72, 263])),
        ("to-abort", rng.integers(3, 434, size=20).tolist(), greedy(40, ignore_eos=True)),
    ]
    with no_compiles("the mixed workload"):
        for request_id, prompt, params in workload:
            eng.add_request(request_id, prompt, params)
        final = {}
        for step in range(2000):
            if not eng.has_unfinished_requests():
                break
            if step == 4:
                assert eng.abort("to-abort")
            for out in eng.step():
                if out.finished:
                    final[out.request_id] = out
    assert set(final) == {w[0] for w in workload}
    assert final["to-abort"].finish_reason == "abort"
    assert len(final["n2"].outputs) == 2
    assert all(lp for lp in final["logprobs"].outputs[0].logprobs)
    assert_idle(eng)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([5] * 128, "max_model_len"),
    ([5] * 300, "max_model_len"),
    ([3, 512, 4], "out of range"),
    ([3, -1], "out of range"),
])
def test_bad_prompt_is_rejected(engine, reference, prompt, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, greedy(4))
    assert "bad" not in engine.requests
    assert_serves_normally(engine, reference)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(n=0), "n must be"),
    (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params_are_rejected(engine, reference, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    assert_serves_normally(engine, reference)


def test_prompt_at_the_limit_is_accepted(engine):
    out = run_alone(engine, [5] * 127, greedy(10, ignore_eos=True))
    assert len(out.token_ids) == 1 and out.finish_reason == "length", "max_model_len caps the output"


def test_samples_that_fit_only_one_at_a_time_still_complete(engine, reference):
    # 23 usable pages of 8 tokens: 3 samples of 110 tokens cannot be cached at once, but each
    # fits alone, so the scheduler runs them by turns (preempting or waiting).
    out = run_alone(engine, [5] * 100, SamplingParams(max_tokens=10, n=3, ignore_eos=True, temperature=0.7, seed=1))
    assert [len(c.token_ids) for c in out.outputs] == [10, 10, 10]
    assert_serves_normally(engine, reference)


def test_sequence_larger_than_the_whole_cache_is_rejected(tiny_engine_factory):
    small = tiny_engine_factory(num_pages=8, page_size=8, max_model_len=128, warmup=False)  # 56 tokens
    with pytest.raises(ValueError, match="needs 13 KV pages.*has 7"):
        small.add_request("too-big", [5] * 90, SamplingParams(max_tokens=10))
    assert not small.has_unfinished_requests()


def test_bad_types_are_rejected(engine, reference):
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request("bad-params", PROMPT, {"max_tokens": 3})
    with pytest.raises(TypeError, match="prompt must be"):
        engine.add_request("bad-prompt", 42, greedy(3))
    assert_serves_normally(engine, reference)


def test_duplicate_request_id(engine, reference):
    engine.add_request("dup", PROMPT, greedy(16, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "Something else", greedy(3))
    final, _ = drain(engine)
    assert final["dup"].token_ids == reference.token_ids, "the first request was disturbed"
    assert_serves_normally(engine, reference)
    # Once finished, the id may be used again.
    again = run_batch(engine, [("dup", PROMPT, greedy(16, ignore_eos=True))])["dup"]
    assert again.token_ids == reference.token_ids


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="nonexistent"):
        LLMEngine(model="/nonexistent")


def test_failing_step_aborts_its_requests_only(engine, reference, monkeypatch):
    later = [("later-a", "Paris is the capital", greedy(8, ignore_eos=True)),
             ("later-b", [7] * 25, greedy(8, ignore_eos=True))]
    expected = {rid: run_alone(engine, p, sp).token_ids for rid, p, sp in later}

    real = engine.runner.dispatch
    calls = []

    def fail_once(scheduled):
        calls.append(len(scheduled))
        if len(calls) == 1:
            raise RuntimeError("injected device failure")
        return real(scheduled)

    monkeypatch.setattr(engine.runner, "dispatch", fail_once)
    # 10 + 10 + 12 tokens: the whole 32-token budget, so `later` stays waiting in that step.
    in_step = [(f"fail-{i}", [9 + i] * n, greedy(8)) for i, n in enumerate((10, 10, 12))]
    for rid, prompt, params in in_step + later:
        engine.add_request(rid, prompt, params)
    outs = {o.request_id: o for o in engine.step()}
    assert calls == [3]
    assert set(outs) == {rid for rid, _, _ in in_step}
    for out in outs.values():
        assert out.finished and out.finish_reason == "abort"
        assert out.error and "injected device failure" in out.error
    final, _ = drain(engine)
    assert set(final) == {"later-a", "later-b"}
    for rid, tokens in expected.items():
        assert final[rid].token_ids == tokens and final[rid].error is None
    assert_serves_normally(engine, reference)


def test_failing_step_after_the_cache_was_donated(engine, reference, monkeypatch):
    """If the failed call consumed the donated cache, the engine rebuilds it and carries on."""
    queued_prompt = [13] * 20
    expected = run_alone(engine, queued_prompt, greedy(6, ignore_eos=True)).token_ids
    real = engine.runner.dispatch
    calls = []

    def fail_after_donation(scheduled):
        calls.append(1)
        if len(calls) == 2:
            engine.runner.kv_cache.delete()
            raise RuntimeError("lost the cache")
        return real(scheduled)

    monkeypatch.setattr(engine.runner, "dispatch", fail_after_donation)
    engine.add_request("victim", PROMPT, greedy(8, ignore_eos=True))
    engine.step()
    engine.add_request("chunked", [11] * 40, greedy(4, ignore_eos=True))
    engine.add_request("queued", queued_prompt, greedy(6, ignore_eos=True))
    # victim's decode (1) + the first 31 tokens of chunked fill the budget; queued waits.
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == {"victim", "chunked"}
    for out in outs.values():
        assert out.finish_reason == "abort" and "lost the cache" in out.error
    assert not engine.runner.kv_cache.is_deleted()
    final, _ = drain(engine)
    assert final["queued"].token_ids == expected and final["queued"].error is None
    assert_serves_normally(engine, reference)


def test_failed_step_requeues_survivors_in_arrival_order(engine, monkeypatch):
    """Request-level batches can hold running sequences that a step did not schedule (their
    prefill waits for budget). When a failed step lost the donated cache, those survivors are
    recomputed: they must go back to the queue in arrival order (FCFS), then finish correctly."""
    prompts = {name: [30 + i] * 20 for i, name in enumerate("ABCD")}
    expected = {name: run_alone(engine, p, greedy(4, ignore_eos=True)).token_ids for name, p in prompts.items()}
    use_request_level_policy(engine, monkeypatch)
    real = engine.runner.dispatch
    calls = []

    def fail_first(scheduled):
        calls.append(1)
        if len(calls) == 1:
            engine.runner.kv_cache.delete()
            raise RuntimeError("lost the cache")
        return real(scheduled)

    monkeypatch.setattr(engine.runner, "dispatch", fail_first)
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, greedy(4, ignore_eos=True))
    outs = {o.request_id: o for o in engine.step()}  # A (20 tokens) and 12 of B fill the budget
    assert set(outs) == {"A", "B"} and all(o.finish_reason == "abort" for o in outs.values())
    assert [s.request_id for s in engine.scheduler.waiting] == ["C", "D"], "survivors requeued out of order"
    final, _ = drain(engine)
    assert {k: final[k].token_ids for k in "CD"} == {k: expected[k] for k in "CD"}
    assert_idle(engine)


def test_logprobs_above_max_logprobs_are_rejected(engine, reference):
    """Asking for more top log-probs than the engine computes (max_logprobs) must fail loudly,
    not return fewer than asked."""
    too_many = engine.config.max_logprobs + 5
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("many-logprobs", PROMPT, greedy(2, logprobs=too_many))
    assert_serves_normally(engine, reference)


# ---------------------------------------------------------------------------------------------
# Request behaviour
# ---------------------------------------------------------------------------------------------
def test_abort_waiting_and_running(engine):
    for i in range(12):
        engine.add_request(f"ab-{i}", [20 + i] * 12, greedy(30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    running = next(s for s in engine.scheduler.running if s.page_ids)
    waiting = next(s for s in engine.scheduler.waiting)
    assert waiting.status is SequenceStatus.WAITING and running.status is SequenceStatus.RUNNING
    free = engine.num_free_pages
    held = len(running.page_ids)
    assert engine.abort(running.request_id)
    assert engine.num_free_pages == free + held, "an aborted running request keeps its pages"
    assert engine.abort(waiting.request_id)
    assert engine.num_free_pages == free + held
    assert not engine.abort(waiting.request_id), "aborting twice"
    assert not engine.abort("no-such-request")
    outs = {o.request_id: o for o in engine.step()}
    for seq in (running, waiting):
        out = outs[seq.request_id]
        assert out.finished and out.finish_reason == "abort" and out.error is None
    assert len(outs[running.request_id].token_ids) >= 1
    final, _ = drain(engine)
    assert len(final) == 10 and all(o.finish_reason == "length" for o in final.values())
    assert_idle(engine)


def test_abort_before_any_step(engine):
    engine.add_request("early", PROMPT, greedy(4))
    assert engine.abort("early")
    final, _ = drain(engine)
    assert final["early"].finish_reason == "abort" and final["early"].token_ids == []
    assert_idle(engine)


def test_n2_gives_two_completions(engine, reference):
    out = run_alone(engine, PROMPT, greedy(16, ignore_eos=True, n=2))
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == reference.token_ids
    sampled = run_alone(engine, PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=2, ignore_eos=True))
    assert len(sampled.outputs) == 2
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in sampled.outputs)
    assert sampled.outputs[0].token_ids != sampled.outputs[1].token_ids, "the two samples share one stream"
    again = run_alone(engine, PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=2, ignore_eos=True))
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in sampled.outputs], "seeded n=2 repeats"


def token_pieces(engine, token_ids) -> list[str]:
    return [engine.tokenizer.decode([t]) for t in token_ids]


def find_spanning_stop(engine, out):
    """A two-character stop string made of the last character of one token and the first of
    the next, whose first occurrence in the text is at that boundary (not at position 0)."""
    pieces = token_pieces(engine, out.token_ids)
    assert "".join(pieces) == out.text
    offset = 0
    for k in range(1, len(pieces)):
        offset += len(pieces[k - 1])
        if not pieces[k - 1] or not pieces[k]:
            continue
        stop = pieces[k - 1][-1] + pieces[k][0]
        at = offset - 1
        if at >= 2 and out.text.find(stop) == at and stop.strip():
            return stop, at, k
    return None


def test_stop_string_spanning_tokens(engine):
    for prompt in (PROMPT, "Paris is the capital of", "def add(a, b):", "Berlin is", "0123"):
        ref = run_alone(engine, prompt, greedy(16, ignore_eos=True))
        found = find_spanning_stop(engine, ref)
        if found:
            break
    else:
        pytest.fail("no usable greedy continuation for a spanning stop string")
    stop, at, k = found
    engine.add_request("stop", prompt, greedy(16, ignore_eos=True, stop=[stop]))
    final, history = drain(engine)
    out = final["stop"]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == ref.text[:at]
    assert out.token_ids == ref.token_ids[: k + 1], "generation ends at the token completing the stop"
    # Streamed text never ran past the final text, and adds up to it.
    streamed = ""
    for o in history["stop"]:
        streamed += o.outputs[0].delta_text
        assert out.text.startswith(streamed)
    assert streamed == out.text
    incl = run_alone(engine, prompt, greedy(16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))
    assert incl.text == ref.text[: at + len(stop)] and incl.finish_reason == "stop"


def test_stop_token_ids(engine, reference):
    k = next(i for i in range(2, len(reference.token_ids)) if reference.token_ids[i] not in reference.token_ids[:i])
    stop_token = reference.token_ids[k]
    out = run_alone(engine, PROMPT, greedy(16, ignore_eos=True, stop_token_ids=[stop_token]))
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_token
    assert out.token_ids == reference.token_ids[: k + 1]
    before = run_alone(engine, PROMPT, greedy(k, ignore_eos=True))
    assert out.text == before.text, "the stop token's text is not part of the output"


def test_max_tokens_gives_length(engine, reference):
    for n in (1, 5):
        out = run_alone(engine, PROMPT, greedy(n, ignore_eos=True))
        assert out.finish_reason == "length" and out.outputs[0].stop_reason is None
        assert out.token_ids == reference.token_ids[:n]


def test_eos_and_ignore_eos(engine, reference, monkeypatch):
    k = next(i for i in range(2, len(reference.token_ids)) if reference.token_ids[i] not in reference.token_ids[:i])
    eos = reference.token_ids[k]
    monkeypatch.setattr(engine, "eos_token_ids", {eos})
    stopped = run_alone(engine, PROMPT, greedy(16))
    assert stopped.finish_reason == "stop" and stopped.outputs[0].stop_reason is None
    assert stopped.token_ids == reference.token_ids[: k + 1]
    ignored = run_alone(engine, PROMPT, greedy(16, ignore_eos=True))
    assert ignored.finish_reason == "length" and ignored.token_ids == reference.token_ids


def test_logprobs(engine, reference):
    out = run_alone(engine, PROMPT, greedy(8, ignore_eos=True, logprobs=3))
    lps = out.outputs[0].logprobs
    assert out.token_ids == reference.token_ids[:8]
    assert len(lps) == 8
    for token, top in zip(out.token_ids, lps):
        assert token in top and 3 <= len(top) <= 4
        assert all(v <= 0.0 for v in top.values())
        assert top[token] == pytest.approx(max(top.values())), "greedy picks the most likely token"
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-5
    sampled = run_alone(engine, PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=2, logprobs=0,
                                                       ignore_eos=True))
    for token, top in zip(sampled.token_ids, sampled.outputs[0].logprobs):
        assert list(top) == [token] and top[token] <= 0.0
    assert run_alone(engine, PROMPT, greedy(4)).outputs[0].logprobs is None


@pytest.mark.parametrize("params", [
    greedy(16, ignore_eos=True),
    greedy(16, ignore_eos=True, stop=["zzz-never", "xq"]),
    SamplingParams(max_tokens=12, temperature=1.0, seed=4, n=2, ignore_eos=True),
])
def test_streamed_deltas_add_up(engine, params):
    engine.add_request("stream", PROMPT, params)
    final, history = drain(engine)
    out = final["stream"]
    assert history["stream"][-1] is out
    for i, completion in enumerate(out.outputs):
        text = "".join(o.outputs[i].delta_text for o in history["stream"])
        tokens = [t for o in history["stream"] for t in o.outputs[i].delta_token_ids]
        assert text == completion.text
        assert tokens == completion.token_ids
    assert len(history["stream"]) > 1, "tokens were streamed step by step"
    assert_idle(engine)


def test_bad_requests_hold_no_pages_and_leave_others_alone(engine, reference):
    from orca_jax.errors import RequestError

    engine.add_request("good", PROMPT, greedy(16, ignore_eos=True))
    engine.step()
    engine.step()  # the good request is running and holds pages
    pages_in_use = engine.allocator.num_used
    assert pages_in_use > 0
    bad = [
        ([3, -1], greedy(4), "prompt"),
        ([4294967296], greedy(4), "prompt"),
        ([10**30], greedy(4), "prompt"),
        ("Hi \ud800", greedy(4), "prompt"),
        ([5] * 128, greedy(4), "prompt"),
        ([5] * 100, greedy(4, logprobs=10**12), "logprobs"),
    ]
    for i, (prompt, params, param) in enumerate(bad):
        with pytest.raises(RequestError) as info:
            engine.add_request(f"bad-{i}", prompt, params)
        assert info.value.param == param
    # A group with one bad request queues none of them.
    with pytest.raises(RequestError, match="out of range") as info:
        engine.add_requests([("g0", [3, 4], greedy(4)), ("g1", [3, 4], greedy(4)), ("g2", [3, 10**6], greedy(4))])
    assert info.value.param == "prompt"
    with pytest.raises(RequestError, match="already in use"):
        engine.add_requests([("g0", [3, 4], greedy(4)), ("g0", [3, 4], greedy(4))])
    assert set(engine.requests) == {"good"}
    assert engine.allocator.num_used == pages_in_use, "a rejected request took KV pages"
    final, _ = drain(engine)
    assert final["good"].token_ids == reference.token_ids
    assert_idle(engine)


def test_extreme_valid_params_share_a_step_without_harm(engine, reference):
    extremes = [
        SamplingParams(max_tokens=6, temperature=1.0, top_k=10**12, seed=1),
        SamplingParams(max_tokens=6, temperature=1.0, seed=10**30),
        SamplingParams(max_tokens=6, temperature=1.0, seed=-(10**20)),
        SamplingParams(max_tokens=6, temperature=1e-300, seed=2),
        SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-300, min_p=1e-300, seed=3),
        SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[10**30]),
        SamplingParams(max_tokens=6, temperature=1.0, repetition_penalty=100.0, frequency_penalty=2.0, seed=4),
        SamplingParams(max_tokens=6, temperature=2.0, repetition_penalty=0.01, presence_penalty=-2.0, seed=5),
    ]
    requests = [("reference", PROMPT, greedy(16, ignore_eos=True))]
    requests += [(f"x{i}", PROMPT, dataclasses.replace(p, ignore_eos=True)) for i, p in enumerate(extremes)]
    final = run_batch(engine, requests)
    assert final["reference"].token_ids == reference.token_ids, "an extreme request disturbed its batch"
    vocab = engine.model_config.vocab_size
    for i in range(len(extremes)):
        out = final[f"x{i}"]
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == 6 and all(0 <= t < vocab for t in out.outputs[0].token_ids)
    # A top_k past the vocabulary keeps all of it: the same draw as no top_k.
    no_top_k = run_alone(engine, PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True))
    assert final["x0"].outputs[0].token_ids == no_top_k.outputs[0].token_ids
    # The smallest nucleus keeps only the most likely token: greedy.
    assert final["x4"].outputs[0].token_ids == reference.token_ids[:6]
