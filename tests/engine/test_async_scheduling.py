"""Overlapped ("async") scheduling against one step at a time, on the tiny random Llama.

The same workload through an engine with `async_scheduling=True` and one with False must give
identical outputs (tokens, text, finish and stop reasons, log-probabilities), with preemption,
seeded sampling with penalties, stop strings and token ids, EOS, n > 1 and max_tokens; the
overlapped one really overlaps (step N+1 is dispatched before step N's result is read), throws
away the token a finished sequence computed one step late, returns every page and slot, and
survives failed steps at dispatch and at the result.
"""

from __future__ import annotations

import numpy as np
import pytest

from orca_jax import SamplingParams
from orca_jax.worker.compile_guard import compile_count, no_compiles

SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=32, page_size=8, num_pages=20, max_model_len=128,
                min_token_bucket=32)  # one step program: overlap does not depend on the bucket


@pytest.fixture(scope="module")
def engines(tiny_engine_factory):
    """{False: one step at a time, True: overlapped}, same settings otherwise (a pool small
    enough that the mixed workload preempts)."""
    return {mode: tiny_engine_factory(async_scheduling=mode, **SETTINGS) for mode in (False, True)}


def greedy(max_tokens=12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run(engine, requests, abort_at: dict[str, int] | None = None) -> dict:
    """Add `requests`, step until idle (aborting request r at step abort_at[r]); the final
    output per request, reduced to what must agree between the modes."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        for request_id, at in (abort_at or {}).items():
            if at == steps:
                engine.abort(request_id)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = [
                    (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs
                ] + [out.error]
        steps += 1
        assert steps < 5000
    assert_idle(engine)
    return final


def assert_same_outputs(a: dict, b: dict) -> None:
    """Tokens, text, finish and stop reasons and errors identical; log-probabilities to float32
    rounding. With prefix caching the two modes may find different cached prefixes (a page is
    published once its tokens are known on the host, a step later when overlapped), and a
    prefix's K/V computed in another step's program can differ in the last bits."""
    assert a.keys() == b.keys()
    for request_id in a:
        *samples_a, error_a = a[request_id]
        *samples_b, error_b = b[request_id]
        assert error_a == error_b and len(samples_a) == len(samples_b), request_id
        for sa, sb in zip(samples_a, samples_b):
            assert sa[:4] == sb[:4], request_id
            if sa[4] is None or sb[4] is None:
                assert sa[4] is sb[4] is None, request_id
                continue
            assert [sorted(d) for d in sa[4]] == [sorted(d) for d in sb[4]], request_id
            for da, db in zip(sa[4], sb[4]):
                assert da == pytest.approx(db, abs=1e-5), request_id


def assert_idle(engine) -> None:
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.allocator.num_free == engine.allocator.num_usable, "KV pages leaked"
    assert engine.scheduler.slots.num_free == engine.config.max_num_seqs, "batch slots leaked"
    assert not engine._in_flight, "a step left in flight on an idle engine"


def mixed_workload(seed: int) -> list:
    rng = np.random.default_rng(seed)
    lengths = [1, 3, 7, 9, 16, 17, 23, 31, 33, 41, 50, 64]
    variants = [
        greedy(10, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.7, top_k=20, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.3, seed=12, ignore_eos=True),
        greedy(9, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.9, n=2, seed=13, ignore_eos=True),
        greedy(20),  # may stop at EOS
    ]
    return [(f"m{i}", rng.integers(3, 434, size=n).tolist(), variants[i % len(variants)])
            for i, n in enumerate(lengths)]


def test_the_mixed_workload_gives_identical_outputs_with_preemption(engines):
    preemptions = {m: e.scheduler.num_preemptions for m, e in engines.items()}
    workload = mixed_workload(0)
    outputs = {mode: run(engine, workload) for mode, engine in engines.items()}
    assert_same_outputs(outputs[True], outputs[False])
    for mode, engine in engines.items():
        assert engine.scheduler.num_preemptions > preemptions[mode], f"async={mode}: the pool was meant to preempt"


def test_stop_strings_and_stop_token_ids_give_identical_outputs(engines):
    # The continuation of this prompt, run alone, tells which strings and ids occur in it.
    probe = run(engines[False], [("probe", "The quick brown fox", greedy(16, ignore_eos=True))])["probe"][0]
    tokens, text = probe[0], probe[1]
    middle = text[len(text) // 3: len(text) // 3 + 2]
    requests = [
        ("stop-str", "The quick brown fox", greedy(16, stop=[middle], ignore_eos=True)),
        ("stop-str-kept", "The quick brown fox", greedy(16, stop=[middle], include_stop_str_in_output=True,
                                                         ignore_eos=True)),
        ("stop-id", "The quick brown fox", greedy(16, stop_token_ids=[tokens[5]], ignore_eos=True)),
        ("length", "The quick brown fox", greedy(3, ignore_eos=True)),
    ]
    outputs = {mode: run(engine, requests) for mode, engine in engines.items()}
    assert_same_outputs(outputs[True], outputs[False])
    assert outputs[True]["stop-str"][0][2:4] == ("stop", middle)
    assert outputs[True]["stop-id"][0][2:4] == ("stop", tokens[5])
    assert len(outputs[True]["stop-id"][0][0]) <= 6


def test_a_sequence_that_stops_computes_one_discarded_token(engines):
    """Overlapped: when step N stops a sequence, step N+1 (already dispatched) computed one
    more token for it; that token is discarded, never emitted. One step at a time never
    computes one."""
    discarded = {m: e.scheduler.num_discarded_tokens for m, e in engines.items()}
    tokens = run(engines[False], [("probe", [5, 6, 7, 8], greedy(12, ignore_eos=True))])["probe"][0][0]
    requests = [("stops", [5, 6, 7, 8], greedy(12, stop_token_ids=[tokens[4]], ignore_eos=True)),
                ("goes-on", [9, 10, 11], greedy(12, ignore_eos=True))]
    outputs = {mode: run(engine, requests) for mode, engine in engines.items()}
    assert_same_outputs(outputs[True], outputs[False])
    assert outputs[True]["stops"][0][0] == tokens[:5]
    assert engines[False].scheduler.num_discarded_tokens == discarded[False]
    assert engines[True].scheduler.num_discarded_tokens == discarded[True] + 1


def test_length_limits_compute_no_extra_token(engines):
    """A pending token that takes a sequence to max_tokens is its last: nothing more is
    scheduled for it, so nothing is discarded."""
    discarded = engines[True].scheduler.num_discarded_tokens
    requests = [(f"len-{i}", [3 + i] * (4 + i), greedy(2 + i, ignore_eos=True)) for i in range(5)]
    outputs = {mode: run(engine, requests) for mode, engine in engines.items()}
    assert_same_outputs(outputs[True], outputs[False])
    assert engines[True].scheduler.num_discarded_tokens == discarded


def test_an_abort_mid_run_keeps_a_prefix_of_the_solo_tokens(engines):
    solo = run(engines[False], [("solo", [21] * 12, greedy(30, ignore_eos=True))])["solo"][0][0]
    for mode, engine in engines.items():
        out = run(engine, [("cut", [21] * 12, greedy(30, ignore_eos=True)),
                           ("other", [22] * 12, greedy(6, ignore_eos=True))], abort_at={"cut": 5})
        tokens, _, reason, *_ = out["cut"][0]
        assert reason == "abort" and 1 <= len(tokens) < 30 and tokens == solo[:len(tokens)], mode


def test_step_n_plus_one_is_dispatched_before_step_n_is_read(engines, monkeypatch):
    engine = engines[True]
    events = []
    real_dispatch = engine.runner.dispatch

    class Recorded:
        def __init__(self, pending, number):
            self.pending, self.number = pending, number
            self.output = pending.output

        def result(self):
            events.append(("result", self.number))
            return self.pending.result()

    def dispatch(scheduled):
        number = sum(1 for kind, _ in events if kind == "dispatch")
        events.append(("dispatch", number))
        return Recorded(real_dispatch(scheduled), number)

    monkeypatch.setattr(engine.runner, "dispatch", dispatch)
    run(engine, [("a", [5, 6, 7], greedy(6, ignore_eos=True))])
    assert events[:5] == [("dispatch", 0), ("dispatch", 1), ("result", 0), ("dispatch", 2), ("result", 1)]
    assert sorted(n for kind, n in events if kind == "result") == list(range(len(events) // 2))


def test_a_failed_dispatch_with_a_step_in_flight(engines, monkeypatch):
    """The step in flight ran on the state before the failing one: its tokens stand and are
    reported, the failing step's request fails alone, and the engine serves on."""
    engine = engines[True]
    expected = run(engines[False], [("b", [31] * 10, greedy(8, ignore_eos=True))])["b"]
    real_dispatch = engine.runner.dispatch
    calls = []

    def fail_third(scheduled):
        calls.append(1)
        if len(calls) == 3:
            engine.runner.kv_cache.delete()  # as if the failing call had consumed the donated cache
            raise RuntimeError("injected dispatch failure")
        return real_dispatch(scheduled)

    monkeypatch.setattr(engine.runner, "dispatch", fail_third)
    engine.add_request("a", [30] * 10, greedy(8, ignore_eos=True))
    engine.step()
    engine.step()
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finish_reason == "abort" and "injected dispatch failure" in outs["a"].error
    assert len(outs["a"].token_ids) == 2, "the step in flight was completed first"
    assert not engine.runner.kv_cache_lost
    assert run(engine, [("b", [31] * 10, greedy(8, ignore_eos=True))])["b"] == expected


def test_a_failed_result_drops_the_steps_after_it(engines, monkeypatch):
    """A step whose result raises may have left a broken state, and the step dispatched after
    it built on that state: it is dropped, the state rebuilt, and its requests recompute, to
    the same tokens."""
    engine = engines[True]
    requests = [("x", [40] * 9, greedy(8, ignore_eos=True)), ("y", [41] * 5, greedy(8, ignore_eos=True))]
    expected = run(engines[False], requests)
    real_dispatch = engine.runner.dispatch
    count = []

    class FailsAtResult:
        def __init__(self, pending):
            self.pending, self.output = pending, pending.output

        def result(self):
            self.pending.result()
            raise RuntimeError("injected result failure")

    def dispatch(scheduled):
        count.append(1)
        pending = real_dispatch(scheduled)
        # The first step holds only x's prefill; y joins the step after it.
        return FailsAtResult(pending) if len(count) == 1 else pending

    monkeypatch.setattr(engine.runner, "dispatch", dispatch)
    engine.add_request(*requests[0])
    engine.step()
    engine.add_request(*requests[1])
    final = run(engine, [])
    assert final["x"][0][2] == "abort" and "injected result failure" in final["x"][-1]
    assert final["y"] == expected["y"]


@pytest.mark.parametrize("mode", [False, True])
def test_no_compiles_after_warmup_in_either_mode(engines, mode):
    engine = engines[mode]
    compile_count()
    with no_compiles(f"serving with async_scheduling={mode}"):
        run(engine, mixed_workload(3)[:8])
