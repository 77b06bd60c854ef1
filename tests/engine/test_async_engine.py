"""AsyncLLMEngine: the engine on a background thread, requests as asyncio streams.

One LLMEngine serves the module; each test wraps it in a fresh AsyncLLMEngine on its own event
loop (asyncio.run) and checks that the engine is left idle with every KV page back in the pool.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from orca_jax import SamplingParams
from orca_jax.engine.async_engine import AsyncLLMEngine, EngineStoppedError, QueueFullError, RequestFailedError
from orca_jax.errors import RequestError

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(max_num_seqs=8, max_num_batched_tokens=32, page_size=8, num_pages=64,
                               max_model_len=256)


@pytest.fixture(autouse=True)
def engine_left_idle(engine):
    yield
    assert not engine.has_unfinished_requests(), f"requests left behind: {list(engine.requests)}"
    assert engine.allocator.num_used == 0, "KV pages leaked"


def run(engine, scenario, **kwargs):
    """Run `scenario(async_engine)` on a fresh event loop with a started AsyncLLMEngine."""
    async def main():
        async_engine = AsyncLLMEngine(engine, **kwargs)
        async_engine.start()
        try:
            return await scenario(async_engine)
        finally:
            await asyncio.to_thread(async_engine.shutdown)
    return asyncio.run(main())


def greedy(max_tokens=12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


async def collect(stream):
    outputs = [out async for out in stream]
    return outputs


def offline_text(engine, prompt, params) -> str:
    """The same request run directly on the engine, with no thread in between."""
    engine.add_request("offline", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    return final.outputs[0].text


def test_stream_deltas_assemble_to_the_offline_text(engine):
    expected = offline_text(engine, PROMPT, greedy(16))

    async def scenario(ae):
        outputs = await collect(await ae.add_request("r1", PROMPT, greedy(16)))
        return outputs

    outputs = run(engine, scenario)
    assert len(outputs) > 1, "one output per step, not one at the end"
    assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
    assert "".join(o.outputs[0].delta_text for o in outputs) == expected == outputs[-1].outputs[0].text
    assert sum(len(o.outputs[0].delta_token_ids) for o in outputs) == 16


def test_concurrent_requests_each_get_their_own_tokens(engine):
    prompts = [f"{PROMPT} {i}" for i in range(12)]  # more than max_num_seqs: some wait
    expected = [offline_text(engine, p, greedy(8)) for p in prompts]

    async def scenario(ae):
        streams = [await ae.add_request(f"r{i}", p, greedy(8)) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        return [r[-1].outputs[0].text for r in results]

    assert run(engine, scenario) == expected


def test_bad_request_is_rejected_alone(engine):
    async def scenario(ae):
        good = await ae.add_request("good", PROMPT, greedy(4))
        with pytest.raises(ValueError, match="max_model_len"):
            await ae.add_request("too-long", list(range(10, 300)), greedy(4))
        with pytest.raises(TypeError):
            await ae.add_request("bad-type", 3.5, greedy(4))
        with pytest.raises(ValueError, match="already in use"):
            await ae.add_request("good", PROMPT, greedy(4))
        return await collect(good)

    outputs = run(engine, scenario)
    assert outputs[-1].finish_reason == "length"


def test_abort_from_another_thread_frees_pages_at_the_next_step(engine):
    async def scenario(ae):
        stream = await ae.add_request("long", PROMPT, SamplingParams(max_tokens=200, ignore_eos=True, temperature=0))
        first = await stream.__anext__()
        assert ae.stats().kv_pages_used > 0
        aborter = threading.Thread(target=ae.abort, args=("long",))
        aborter.start()
        aborter.join()
        rest = await collect(stream)
        return first, rest, ae.stats()

    first, rest, stats = run(engine, scenario)
    assert rest[-1].finish_reason == "abort" and rest[-1].finished
    assert len(first.outputs[0].token_ids) + sum(len(o.outputs[0].delta_token_ids) for o in rest) < 200
    assert stats.kv_pages_used == 0 and stats.num_running == 0


def test_cancelled_reader_aborts_its_request(engine):
    async def scenario(ae):
        stream = await ae.add_request("c", PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
        reader = asyncio.create_task(collect(stream))
        await asyncio.sleep(0.02)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        stream.abort()  # what a server does in its `finally` when the client goes away
        for _ in range(200):
            if ae.stats().kv_pages_used == 0 and ae.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
        return ae.stats()

    stats = run(engine, scenario)
    assert stats.kv_pages_used == 0 and stats.num_running == 0


def test_engine_thread_sleeps_while_idle(engine):
    async def scenario(ae):
        await collect(await ae.add_request("r", PROMPT, greedy(4)))
        await asyncio.sleep(0.05)  # let the thread go back to sleep
        wakeups, steps = ae.num_wakeups, ae.stats().num_steps
        await asyncio.sleep(0.5)
        idle = (ae.num_wakeups - wakeups, ae.stats().num_steps - steps)
        # ...and it wakes up for new work.
        await collect(await ae.add_request("r2", PROMPT, greedy(4)))
        return idle, ae.num_wakeups - wakeups

    (idle_wakeups, idle_steps), later = run(engine, scenario)
    assert idle_wakeups == 0 and idle_steps == 0, "the engine thread polled while idle"
    assert later > 0


def gate_engine_steps(monkeypatch, engine) -> threading.Event:
    """Make each engine step wait for the returned event (requests stay queued meanwhile)."""
    gate = threading.Event()
    real_step = engine.step

    def gated_step():
        assert gate.wait(10), "test gate never opened"
        return real_step()

    monkeypatch.setattr(engine, "step", gated_step)
    return gate


def test_full_waiting_queue_rejects_then_recovers(engine, monkeypatch):
    gate = gate_engine_steps(monkeypatch, engine)

    async def scenario(ae):
        first = await ae.add_request("a", PROMPT, greedy(4))  # admitted; its first step is held
        second = asyncio.create_task(ae.add_request("b", PROMPT, greedy(4)))
        await asyncio.sleep(0)  # b is now in the inbox: 2 requests queued
        with pytest.raises(QueueFullError):
            await ae.add_request("c", PROMPT, greedy(4))
        gate.set()
        second = await second
        done = [(await collect(s))[-1].finish_reason for s in (first, second)]
        third = await collect(await ae.add_request("d", PROMPT, greedy(4)))  # room again
        return done, third[-1].finish_reason

    done, third = run(engine, scenario, max_waiting_requests=2)
    assert done == ["length", "length"] and third == "length"


def test_failed_step_fails_its_requests_and_the_engine_recovers(engine, monkeypatch):
    real_execute = engine.runner.dispatch
    calls = {"n": 0}

    def fail_once(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device fault")
        return real_execute(batch)

    monkeypatch.setattr(engine.runner, "dispatch", fail_once)

    async def scenario(ae):
        doomed = await ae.add_request("doomed", PROMPT, greedy(4))
        with pytest.raises(RequestFailedError, match="injected device fault"):
            await collect(doomed)
        return await collect(await ae.add_request("after", PROMPT, greedy(4)))

    outputs = run(engine, scenario)
    assert outputs[-1].finish_reason == "length" and not outputs[-1].error


def test_shutdown_ends_live_streams_and_refuses_new_requests(engine):
    async def scenario(ae):
        stream = await ae.add_request("live", PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        started = time.monotonic()
        await asyncio.to_thread(ae.shutdown)
        rest = [item async for item in stream]
        with pytest.raises(EngineStoppedError):
            await ae.add_request("late", PROMPT, greedy(4))
        return rest, time.monotonic() - started, ae.is_running

    rest, elapsed, running = run(engine, scenario)
    assert rest[-1].finish_reason == "abort"
    assert not running and elapsed < 5


def test_a_group_is_admitted_before_the_next_step(engine):
    """Many requests in one add_requests: one inbox operation, all admitted at once (not one
    per engine step, which made a 1,100-prompt request take 54 s to admit)."""
    prompts = [[3 + i, 4, 5] for i in range(40)]
    expected = [offline_text(engine, p, greedy(3)) for p in prompts]

    async def scenario(ae):
        steps_before = ae.stats().num_steps
        streams = await ae.add_requests([(f"g{i}", p, greedy(3)) for i, p in enumerate(prompts)])
        steps_to_admit = ae.stats().num_steps - steps_before
        results = await asyncio.gather(*(collect(s) for s in streams))
        return steps_to_admit, [r[-1].outputs[0].text for r in results]

    steps_to_admit, texts = run(engine, scenario)
    assert steps_to_admit <= 1  # at most the step that was running when the group arrived
    assert texts == expected


def test_a_group_with_one_bad_request_queues_none(engine):
    async def scenario(ae):
        group = [("ok-0", PROMPT, greedy(4)), ("ok-1", PROMPT, greedy(4)), ("bad", [3, 10**6], greedy(4))]
        with pytest.raises(RequestError, match="out of range") as info:
            await ae.add_requests(group)
        assert info.value.param == "prompt"
        with pytest.raises(RequestError, match="already in use"):
            await ae.add_requests([("twice", PROMPT, greedy(4)), ("twice", PROMPT, greedy(4))])
        await asyncio.sleep(0.05)
        # The ids are free again: nothing of the rejected groups was kept.
        streams = await ae.add_requests([("ok-0", PROMPT, greedy(4)), ("twice", PROMPT, greedy(4))])
        return [(await collect(s))[-1].finish_reason for s in streams]

    assert run(engine, scenario) == ["length", "length"]  # (the autouse fixture checks no pages are left)


def test_queue_limit_counts_every_request_of_a_group(engine, monkeypatch):
    gate = gate_engine_steps(monkeypatch, engine)

    async def scenario(ae):
        with pytest.raises(RequestError, match="at most 3") as info:  # larger than the queue itself
            await ae.add_requests([(f"big-{i}", PROMPT, greedy(4)) for i in range(4)])
        assert info.value.param == "prompt" and info.value.code == "too_many_prompts"
        first = await ae.add_requests([("a", PROMPT, greedy(4)), ("b", PROMPT, greedy(4))])  # step held
        with pytest.raises(QueueFullError):  # 2 waiting + 2 arriving > 3
            await ae.add_requests([("c", PROMPT, greedy(4)), ("d", PROMPT, greedy(4))])
        gate.set()
        return [(await collect(s))[-1].finish_reason for s in first]

    assert run(engine, scenario, max_waiting_requests=3) == ["length", "length"]


# ---- the per-request output collector ------------------------------------------------------
def _delta_output(index_texts: dict[int, tuple[str, list[int]]], finished=False, first_token_time=None):
    from orca_jax.engine.outputs import CompletionOutput, RequestOutput

    completions = [CompletionOutput(index=i, text=text, token_ids=list(ids), logprobs=[{t: -1.0} for t in ids],
                                    delta_text=text, delta_token_ids=list(ids),
                                    finish_reason="length" if finished else None)
                   for i, (text, ids) in index_texts.items()]
    return RequestOutput("r", None, [1, 2], completions, finished=finished, first_token_time=first_token_time,
                         finish_time=5.0 if finished else None)


def test_a_lagging_reader_gets_the_delta_outputs_merged_into_one():
    from orca_jax.engine.async_engine import RequestStream

    async def scenario():
        stream = RequestStream("r", lambda _: None, "delta")
        stream._put(_delta_output({0: ("Hel", [5]), 1: ("A", [9])}, first_token_time=1.5))
        first = await stream.__anext__()  # read at once: as it was put
        stream._put(_delta_output({0: ("lo", [6]), 1: ("", [])}, first_token_time=1.5))
        stream._put(_delta_output({0: (" wor", [7, 8]), 1: ("B", [10])}, first_token_time=1.5))
        stream._put(_delta_output({0: ("ld", [11]), 1: ("C", [12])}, finished=True, first_token_time=1.5))
        rest = [out async for out in stream]
        return first, rest

    first, rest = asyncio.run(scenario())
    assert first.outputs[0].text == "Hel" and first.outputs[0].token_ids == [5]
    [merged] = rest  # three outputs that arrived while the reader was away: one read
    a, b = merged.outputs
    assert (a.text, a.token_ids, a.delta_text, a.delta_token_ids) == ("lo world", [6, 7, 8, 11], "lo world",
                                                                      [6, 7, 8, 11])
    assert [list(lp) for lp in a.logprobs] == [[6], [7], [8], [11]]
    assert (b.text, b.token_ids) == ("BC", [10, 12])
    assert merged.finished and merged.finish_time == 5.0 and merged.first_token_time == 1.5
    assert a.finish_reason == b.finish_reason == "length"


def test_cumulative_outputs_replace_the_unread_one_keeping_its_deltas():
    from orca_jax.engine.async_engine import RequestStream
    from orca_jax.engine.outputs import CompletionOutput, RequestOutput

    def cumulative(text, ids, new_text, new_ids, finished=False):
        c = CompletionOutput(index=0, text=text, token_ids=list(ids), delta_text=new_text,
                             delta_token_ids=list(new_ids), finish_reason="stop" if finished else None)
        return RequestOutput("r", None, [1], [c], finished=finished)

    async def scenario():
        stream = RequestStream("r", lambda _: None)  # the default kind
        stream._put(cumulative("Hel", [5], "Hel", [5]))
        stream._put(cumulative("Hello", [5, 6], "lo", [6]))
        stream._put(cumulative("Hello!", [5, 6, 7], "!", [7], finished=True))
        return [out async for out in stream]

    [out] = asyncio.run(scenario())
    c = out.outputs[0]
    assert (c.text, c.token_ids, c.delta_text, c.delta_token_ids) == ("Hello!", [5, 6, 7], "Hello!", [5, 6, 7])
    assert out.finished and c.finish_reason == "stop"


def test_an_error_is_raised_after_the_outputs_before_it():
    from orca_jax.engine.async_engine import RequestStream

    async def scenario():
        stream = RequestStream("r", lambda _: None, "delta")
        stream._put(_delta_output({0: ("a", [5])}))
        stream._put(RequestFailedError("engine gone"))
        first = await stream.__anext__()
        with pytest.raises(RequestFailedError, match="engine gone"):
            await stream.__anext__()
        return first, [out async for out in stream]

    first, after = asyncio.run(scenario())
    assert first.outputs[0].text == "a" and after == []


def test_merged_outputs_from_make_output_add_up_in_every_kind(engine):
    """Outputs of a real request (make_output on the engine's tokenizer), put while nobody
    reads, reach a late reader as one output that equals the unmerged history."""
    from orca_jax.engine.async_engine import RequestStream
    from orca_jax.engine.detokenizer import IncrementalDetokenizer, detokenize_step
    from orca_jax.engine.request import Request, make_output
    from orca_jax.core.sequence import Sequence, SequenceStatus

    tok = engine.tokenizer
    ids = tok.encode(" The quick brown fox jumps", add_special_tokens=False)
    results = {}
    for kind in ("cumulative", "delta", "final_only"):
        params = SamplingParams(logprobs=1, output_kind=kind)
        seq = Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=[5, 6], params=params, seed=0)
        request = Request("r", None, [5, 6], params, [seq], [IncrementalDetokenizer(tok, [5, 6])])

        async def scenario():
            stream = RequestStream("r", lambda _: None, kind)
            for step, token in enumerate(ids):
                detokenize_step(request.detokenizers, [token])
                seq.output_token_ids.append(token)
                seq.output_logprobs.append({token: -float(step)})
                if step == len(ids) - 1:
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
                    request.detokenizers[0].flush()
                out = make_output(request)
                if out is not None:
                    stream._put(out)
                if step == 1 and kind != "final_only":  # the reader takes one early output, then lags
                    early = await stream.__anext__()
            return early if kind != "final_only" else None, [o async for o in stream]

        results[kind] = asyncio.run(scenario())
    text = tok.decode(ids)
    for kind, (early, [late]) in results.items():
        c = late.outputs[0]
        assert late.finished and c.finish_reason == "length", kind
        if kind == "delta":
            assert early.outputs[0].text + c.text == text
            assert early.outputs[0].token_ids + c.token_ids == ids
            assert len(early.outputs[0].logprobs) + len(c.logprobs) == len(ids)
        else:
            assert (c.text, c.token_ids, len(c.logprobs)) == (text, ids, len(ids)), kind
        if early is not None:  # deltas add up across the merge
            assert early.outputs[0].delta_token_ids + c.delta_token_ids == ids
            assert early.outputs[0].delta_text + c.delta_text == text
        else:
            assert c.delta_token_ids == ids and c.delta_text == text


def test_a_reader_that_comes_late_gets_one_output_with_everything(engine):
    """The engine thread runs a whole request before the reader looks: the reader takes one
    output (not one per step), and its deltas are the whole reply."""
    expected = offline_text(engine, PROMPT, greedy(16))

    async def scenario(ae):
        stream = await ae.add_request("late", PROMPT, greedy(16))
        for _ in range(1000):  # until the finished output has been put (and nothing read)
            if stream._unread is not None and stream._unread.finished:
                break
            await asyncio.sleep(0.01)
        return [out async for out in stream]

    [out] = run(engine, scenario)
    c = out.outputs[0]
    assert out.finished and c.text == c.delta_text == expected and len(c.delta_token_ids) == 16


def test_stats_count_requests_without_walking_the_queues(engine, monkeypatch):
    """The snapshot counts requests (a request of n=2 is one), from the scheduler's counters:
    it matches the queues, and never iterates them."""
    ae = AsyncLLMEngine(engine)  # not started: the test steps the engine itself
    engine.add_requests([("w0", PROMPT, greedy(3, n=2)), ("w1", PROMPT, greedy(3)), ("w2", PROMPT, greedy(3))])

    def by_walking():
        scheduler = engine.scheduler
        return (len({s.request_id for s in scheduler.running}), len({s.request_id for s in scheduler.waiting}))

    class NotIterable(list):
        def __iter__(self):
            raise AssertionError("the snapshot walked a queue")

    seen = []
    while engine.has_unfinished_requests():
        expected = by_walking()
        for name in ("running", "waiting"):
            monkeypatch.setattr(engine.scheduler, name, NotIterable(getattr(engine.scheduler, name)))
        snapshot = ae._snapshot()
        monkeypatch.undo()
        assert (snapshot.num_running, snapshot.num_waiting) == expected
        seen.append(expected)
        engine.step()
    assert seen[0] == (0, 3) and any(running > 0 for running, _ in seen)


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_each_output_kind_through_the_engine_thread(engine, kind):
    """Streams of every output kind, read at once and read late, give the offline text."""
    expected = offline_text(engine, PROMPT, greedy(16))

    async def scenario(ae):
        prompt_stream = await ae.add_request("now", PROMPT, greedy(16, output_kind=kind))
        now = await collect(prompt_stream)
        late_stream = await ae.add_request("late", PROMPT, greedy(16, output_kind=kind))
        for _ in range(1000):  # until the finished output has been put (and nothing read)
            if late_stream._unread is not None and late_stream._unread.finished:
                break
            await asyncio.sleep(0.01)
        return now, await collect(late_stream)

    now, late = run(engine, scenario)
    for outputs in (now, late):
        texts = [o.outputs[0].text for o in outputs]
        tokens = [t for o in outputs for t in o.outputs[0].token_ids]
        if kind == "delta":
            assert "".join(texts) == expected and len(tokens) == 16
        else:
            assert texts[-1] == expected and len(outputs[-1].outputs[0].token_ids) == 16
        assert "".join(o.outputs[0].delta_text for o in outputs) == expected
    assert len(late) == 1  # the late reader: one merged output
    if kind == "final_only":
        assert len(now) == 1 and now[0].finished
    else:
        assert len(now) > 1
