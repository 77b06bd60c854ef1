"""The engine in-process under an open-loop arrival process.

Before each `engine.step()` the driver adds every request whose arrival time has passed; when
the engine is idle it sleeps until the next arrival (no busy-waiting). Open loop means arrivals
never wait for the engine: a request that arrives during a step is queued at the next one and
its latency counts from its *scheduled* arrival, as a client's would.

Times are read once per step, right after it returns, so a token's time is when the host could
have sent it.

Request-level batching as Orca measured it (FasterTransformer) returns a static batch's
responses together, when its last member finishes: an early finisher waits for the longest
member of its batch (Orca, section 2.2). `hold_until_batch_ends=True` reproduces that: a
finished request's end time is the end of its batch. TTFT and TPOT still come from the token
stream. Both static-batching policies ("request", "request_padded") return so under
`request_returns="batch"` (`holds_until_batch_ends`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from orca_jax.bench.latency import RequestTiming
from orca_jax.bench.trace import Trace


# The policies whose batches are static (FasterTransformer's): their responses can be held
# until their batch ends.
STATIC_BATCH_POLICIES = ("request", "request_padded")


def holds_until_batch_ends(policy: str, request_returns: str) -> bool:
    """Whether a run of `policy` holds each response until its static batch ends: a
    static-batching policy under `request_returns="batch"` (FasterTransformer's returns)."""
    return policy in STATIC_BATCH_POLICIES and request_returns == "batch"


class BenchmarkError(RuntimeError):
    """A run did not do what was asked (a request failed, a length is off, pages leaked...)."""


def greedy_no_eos(max_tokens: int):
    """Orca's requests: exactly `max_tokens` tokens (EOS ignored); greedy, so runs repeat."""
    from orca_jax.core.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def warm_up(engine, trace: Trace) -> None:
    """One short request through the whole host path (scheduler, batch building, detokenizer)
    before timing; the engine compiled every token bucket when it was built."""
    engine.add_request("warmup", trace.prompts[0][:8], greedy_no_eos(2))
    while engine.has_unfinished_requests():
        engine.step()


def run_open_loop(engine, trace: Trace, *, hold_until_batch_ends: bool = False,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> list[RequestTiming]:
    """Replay `trace` (prompts and arrival times) against `engine`; every request must finish
    with exactly its drawn number of tokens. Returns one timing per request, in trace order.
    `hold_until_batch_ends`: results of a static batch return together (see the module doc)."""
    if trace.prompts is None:
        raise ValueError("the trace has no prompts (make it with vocab_size=...)")
    n = trace.num_requests
    start = clock()
    arrival = [start + t for t in trace.arrival_times]
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    held = BatchReturns(hold_until_batch_ends)
    next_request = 0
    while next_request < n or engine.has_unfinished_requests():
        while next_request < n and arrival[next_request] <= clock():
            engine.add_request(str(next_request), trace.prompts[next_request],
                               greedy_no_eos(trace.output_lens[next_request]))
            next_request += 1
        if not engine.has_unfinished_requests():
            sleep(max(0.0, arrival[next_request] - clock()))  # idle until the next arrival
            continue
        outputs = engine.step()
        now = clock()
        for out in outputs:
            _record(out, now, trace, first, finish)
        if held.enabled:
            held.after_step([int(o.request_id) for o in outputs if o.finished],
                            batch_running=bool(engine.scheduler.running), now=now, finish=finish)
    return [RequestTiming(arrival[i], first[i], finish[i], trace.output_lens[i]) for i in range(n)]


class BatchReturns:
    """Holds finished requests until their static batch ends, then stamps them all with that
    time (a no-op unless `enabled`). Shared by the in-process driver and the simulation."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.waiting: list[int] = []

    def after_step(self, finished: list[int], *, batch_running: bool, now: float, finish: dict[int, float]) -> None:
        if not self.enabled:
            return
        self.waiting += finished
        if not batch_running:  # the static batch is over: its responses go out together
            for i in self.waiting:
                finish[i] = now
            self.waiting.clear()


def _record(out, now: float, trace: Trace, first: dict[int, float], finish: dict[int, float]) -> None:
    i = int(out.request_id)
    if out.error is not None:
        raise BenchmarkError(f"request {i} failed: {out.error}")
    if i not in first and out.outputs[0].token_ids:
        first[i] = now
    if out.finished:
        got, want = len(out.outputs[0].token_ids), trace.output_lens[i]
        if got != want or out.finish_reason != "length":
            raise BenchmarkError(f"request {i} produced {got} tokens ({out.finish_reason!r}), expected {want}")
        finish[i] = now


def check_pages_returned(engine) -> None:
    if engine.allocator.num_used:
        raise BenchmarkError(f"{engine.allocator.num_used} KV pages still in use after the run")


def decode_step_times(engine, trace: Trace, batch_sizes: tuple[int, ...], context: int = 32,
                      steps: int = 8, clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Median seconds of a decode-only step at each batch size (prompts of `context` tokens
    from the trace). This is the economics behind the two policies: where a step costs about
    the same for 1 and 16 sequences (a large model on a GPU), every idle batch slot of
    request-level batching is lost capacity; where it grows with the batch, much less is lost."""
    result = {}
    context = max(1, min(context, engine.config.max_model_len - steps - 3))  # prompt + output must fit
    for k in batch_sizes:
        for i in range(k):
            prompt = (trace.prompts[i % trace.num_requests] * context)[:context]
            engine.add_request(f"probe-{k}-{i}", prompt, greedy_no_eos(steps + 2))
        times = []
        while engine.has_unfinished_requests():
            decoding = all(s.is_decoding for s in engine.scheduler.running) and len(engine.scheduler.running) == k
            start = clock()
            engine.step()
            if decoding:
                times.append(clock() - start)
        result[k] = sorted(times)[len(times) // 2] if times else float("nan")
    check_pages_returned(engine)
    return result

