"""run_step / dispatch_step + complete_step: one iteration through any StepRunner (no model here:
the runners are fakes that look at the batch the schedule makes), and the engine stepping a
runner it was handed (`make_runner`)."""

from __future__ import annotations

import numpy as np
import pytest

from orca_jax import SamplingParams
from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.core.kv_cache import PageAllocator
from orca_jax.worker.batch import build_batch
from orca_jax.worker.runner import ModelRunner
from orca_jax.worker.sampling import SampleOutput
from orca_jax.core.scheduler import Scheduler
from orca_jax.core.sequence import Sequence, SequenceStatus
from orca_jax.engine.step import Ready, StepFailed, complete_step, dispatch_step, recompute_running, run_step

MODEL = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_position_embeddings=256)


def make_scheduler(**settings) -> Scheduler:
    """The prompts below overlap (range(3, ...)): prefix caching is off, so each step computes
    what the cases say (the scheduler's own tests cover caching)."""
    config = EngineConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 16, "page_size": 4, "num_pages": 32,
                             "max_model_len": 64, "enable_prefix_caching": False, **settings}).resolve(MODEL)
    return Scheduler(config, PageAllocator(config.num_pages, config.page_size))


def add(scheduler: Scheduler, seq_id: int, prompt_len: int, max_tokens: int) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens), 0)
    scheduler.add(seq)
    return seq


class EchoPositionRunner:
    """Samples, for each row, the position of the row's last scheduled token (so a test can
    tell which row a token came from), and keeps every batch it ran (as build_batch lays it
    out)."""

    def __init__(self, config):
        self.config = config
        self.batches = []

    def dispatch(self, scheduled):
        batch = build_batch(self.config, scheduled)
        self.batches.append(batch)
        S = batch.logits_indices.shape[0]
        tokens = batch.metadata.positions[batch.logits_indices].astype(np.int32)
        return Ready(SampleOutput(tokens=tokens, logprobs=np.zeros(S, np.float32),
                                  top_ids=np.zeros((S, 0), np.int32), top_logprobs=np.zeros((S, 0), np.float32)))


def test_one_step_schedules_runs_and_postprocesses():
    scheduler = make_scheduler()
    runner = EchoPositionRunner(scheduler.config)
    short, long = add(scheduler, 0, 5, max_tokens=1), add(scheduler, 1, 20, max_tokens=4)
    result = run_step(scheduler, runner)
    assert [(s.seq_id, n) for s, n in result.scheduled] == [(0, 5), (1, 11)]  # the 16-token budget
    assert len(runner.batches) == 1 and runner.batches[0].input_ids.shape == (16,)
    assert result.advanced == [(0, short)] and short.output_token_ids == [4], "row 0's token, position 4"
    assert result.finished == [short] and short.finish_reason == "length", "max_tokens=1: done after one"
    assert long.output_token_ids == [] and long.num_computed_tokens == 11, "a prefill chunk gets no token"
    result = run_step(scheduler, runner)
    assert result.advanced == [(0, long)] and long.output_token_ids == [19]


def test_nothing_to_schedule_is_no_step():
    scheduler = make_scheduler()
    runner = EchoPositionRunner(scheduler.config)
    assert run_step(scheduler, runner) is None and runner.batches == []


def test_a_failing_runner_leaves_the_step_unprocessed():
    scheduler = make_scheduler()
    seq = add(scheduler, 0, 6, max_tokens=3)

    class Broken:
        def dispatch(self, scheduled):
            raise RuntimeError("device lost")

    with pytest.raises(StepFailed, match="RuntimeError: device lost") as failure:
        run_step(scheduler, Broken())
    assert failure.value.scheduled == [(seq, 6)] and isinstance(failure.value.cause, RuntimeError)
    assert seq.num_computed_tokens == 0 and seq.output_token_ids == [], "postprocess did not run"
    recompute_running(scheduler)
    assert seq.status is SequenceStatus.WAITING and seq.page_ids == [] and scheduler.allocator.num_used == 0


def test_the_stop_rule_is_applied_in_the_step():
    scheduler = make_scheduler()
    seq = add(scheduler, 0, 6, max_tokens=8)
    result = run_step(scheduler, EchoPositionRunner(scheduler.config),
                      stop_rule=lambda seqs, tokens: [("stop", t) if t == 5 else None for t in tokens])
    assert result.finished == [seq] and (seq.finish_reason, seq.stop_reason) == ("stop", 5)


def test_a_step_can_be_dispatched_before_the_last_one_completes():
    """Overlapped steps: step 2 is scheduled while step 1's token is pending; its decode row
    starts after the pending token, and completing both appends both tokens in order."""
    scheduler = make_scheduler()
    runner = EchoPositionRunner(scheduler.config)
    seq = add(scheduler, 0, 6, max_tokens=8)
    first = dispatch_step(scheduler, runner)
    assert seq.num_computed_tokens == 6 and seq.num_pending == 1, "counted when scheduled"
    second = dispatch_step(scheduler, runner)
    assert second.scheduled.starts == [6] and second.scheduled.num_new == [1] and seq.num_pending == 2
    complete_step(scheduler, first)
    complete_step(scheduler, second)
    assert seq.output_token_ids == [5, 6] and seq.num_pending == 0 and seq.num_computed_tokens == 7


def test_a_failed_dispatch_takes_back_what_schedule_counted():
    scheduler = make_scheduler()
    seq = add(scheduler, 0, 6, max_tokens=8)
    run_step(scheduler, EchoPositionRunner(scheduler.config))

    class Broken:
        def dispatch(self, scheduled):
            raise RuntimeError("no device")

    with pytest.raises(StepFailed):
        dispatch_step(scheduler, Broken())
    assert (seq.num_computed_tokens, seq.num_pending, seq.output_token_ids) == (6, 0, [5])


def test_engine_steps_the_runner_it_is_given(tiny_llama_dir):
    """The seam: `make_runner` builds the engine's runner; here the real one, wrapped to count
    the batches, and keeping logits, whose argmax is what greedy sampling returned."""
    from orca_jax.engine.engine import LLMEngine

    built = []

    def make_runner(*args, **kwargs):
        built.append(ModelRunner(*args, keep_logits=True, **kwargs))
        return built[-1]

    engine = LLMEngine(model=str(tiny_llama_dir), warmup=False, max_num_seqs=2, max_num_batched_tokens=16,
                       min_token_bucket=16, page_size=8, num_pages=16, max_model_len=64, make_runner=make_runner,
                       async_scheduling=False)
    assert built == [engine.runner]
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished_requests():
        engine.step()
        step = engine.last_step
        tokens.append(int(np.argmax(step.output.logits[0])))
        assert step.advanced[0][1].output_token_ids[-1] == tokens[-1]
    assert len(tokens) == 3 and engine.allocator.num_used == 0


def test_serving_runner_returns_no_logits(tiny_engine_factory):
    engine = tiny_engine_factory(max_num_seqs=2, max_num_batched_tokens=16, min_token_bucket=16, page_size=8,
                                 num_pages=16, max_model_len=64)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=1))
    while engine.last_step is None:  # async scheduling completes the step on the next call
        engine.step()
    assert engine.last_step.output.logits is None

