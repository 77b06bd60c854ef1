"""The open-loop driver on a fake engine and a fake clock: requests join only once their
arrival time has passed, an idle engine sleeps exactly until the next arrival (no busy-wait),
and the recorded times are those of the steps that produced the tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orca_jax.bench.driver import BenchmarkError, run_open_loop
from orca_jax.bench.trace import Trace

STEP_S = 0.1


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class FakeEngine:
    """Every live request gets one token per step; a step takes STEP_S on the fake clock."""

    def __init__(self, clock: FakeClock, short_by: int = 0):
        self.clock, self.live, self.added, self.short_by = clock, {}, [], short_by

    def add_request(self, request_id, prompt, params):
        self.added.append((request_id, self.clock.now))
        self.live[request_id] = (params.max_tokens - self.short_by, [])

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        self.clock.now += STEP_S
        outputs = []
        for request_id, (want, tokens) in list(self.live.items()):
            tokens.append(7)
            done = len(tokens) >= want
            if done:
                del self.live[request_id]
            completion = SimpleNamespace(token_ids=list(tokens))
            outputs.append(SimpleNamespace(request_id=request_id, error=None, outputs=[completion], finished=done,
                                           finish_reason="length" if done else None))
        return outputs


def _trace(arrivals, output_lens):
    n = len(arrivals)
    return Trace([4] * n, list(output_lens), (4, 4), (1, 9), list(arrivals), [[5, 6, 7, 8]] * n, rate=1.0)


def test_open_loop_waits_for_arrivals_and_records_step_times():
    clock = FakeClock()
    engine = FakeEngine(clock)
    timings = run_open_loop(engine, _trace([0.0, 0.05, 1.0], [3, 1, 2]), clock=clock, sleep=clock.sleep)
    # r0 at t=0; r1 arrives during the first step and joins at t=0.1; then the engine is idle
    # from t=0.3 until r2 arrives at t=1.0: one sleep of exactly 0.7 s.
    assert [(rid, round(t, 6)) for rid, t in engine.added] == [("0", 0.0), ("1", 0.1), ("2", 1.0)]
    assert clock.sleeps == [pytest.approx(0.7)]
    t0, t1, t2 = timings
    assert (t0.arrival, t0.first_token, t0.finish) == pytest.approx((0.0, 0.1, 0.3))
    # Latency counts from the scheduled arrival (0.05), not from when the host added it (0.1).
    assert (t1.arrival, t1.first_token, t1.finish) == pytest.approx((0.05, 0.2, 0.2))
    assert (t2.arrival, t2.first_token, t2.finish) == pytest.approx((1.0, 1.1, 1.2))
    assert [t.num_output_tokens for t in timings] == [3, 1, 2]


def test_a_request_that_stops_short_is_an_error():
    clock = FakeClock()
    with pytest.raises(BenchmarkError, match="expected 3"):
        run_open_loop(FakeEngine(clock, short_by=1), _trace([0.0], [3]), clock=clock, sleep=clock.sleep)


class FakeStaticEngine(FakeEngine):
    """Request-level batching: a batch is admitted only when none is running, and runs until
    its last member finishes."""

    def __init__(self, clock: FakeClock):
        super().__init__(clock)
        self.waiting: dict = {}
        self.scheduler = SimpleNamespace(running=self.live)

    def add_request(self, request_id, prompt, params):
        self.added.append((request_id, self.clock.now))
        self.waiting[request_id] = (params.max_tokens, [])

    def has_unfinished_requests(self):
        return bool(self.live or self.waiting)

    def step(self):
        if not self.live:
            self.live.update(self.waiting)
            self.waiting.clear()
        return super().step()


@pytest.mark.parametrize("hold", [True, False])
def test_static_batch_results_return_together_when_held(hold):
    """r0 (3 tokens) and r1 (1 token) share a static batch; r2 arrives mid-batch and waits for
    the next one. Held (FasterTransformer): r1 returns with r0 at the end of the batch."""
    clock = FakeClock()
    engine = FakeStaticEngine(clock)
    timings = run_open_loop(engine, _trace([0.0, 0.0, 0.15], [3, 1, 2]), hold_until_batch_ends=hold,
                            clock=clock, sleep=clock.sleep)
    t0, t1, t2 = timings
    assert t0.finish == pytest.approx(0.3)
    assert t1.first_token == pytest.approx(0.1)  # the stream still has its token at once
    assert t1.finish == pytest.approx(0.3 if hold else 0.1)
    assert (t2.first_token, t2.finish) == pytest.approx((0.4, 0.5))  # joined only after the batch
