"""The persistent batch (orca_jax/worker/batch_state.py): BatchState.build on the host and expand on
the device must give, step after step, the Batch that build_batch (the numpy reference) builds
from the same schedule, while the per-slot device state (page tables, last tokens, penalty
counts) is carried from step to step as the runner carries it.

The schedules come from a real Scheduler stepped with a fake model (the k-th output token of
a sequence is a fixed function of the sequence and k), synchronous or overlapped (step k+1
scheduled and expanded before step k is postprocessed, the engine's async mode).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_jax.worker.batch import build_batch
from orca_jax.worker.batch_state import (OPTIONAL_FIELDS, PENDING_TOKEN, ROW_BIASED, ROW_JOINS, ROW_LOGPROBS,
                                  ROW_SAMPLES, BatchState, StepInputs, create_device_state, create_token_counts,
                                  empty_step_inputs, expand, page_write_capacity, record_sampled, unsent_fields)
from orca_jax.core.sampling_params import MAX_LOGIT_BIAS
from orca_jax.config import MAX_CACHED_PAGES_PER_STEP, EngineConfig, ModelConfig
from orca_jax.core.kv_cache import PADDING_PAGE, PageAllocator
from orca_jax.worker.runner_base import PendingStep
from orca_jax.worker.sampling import SampleOutput
from orca_jax.core.sampling_params import SamplingParams
from orca_jax.core.scheduler import ScheduledBatch, Scheduler, SlotAllocator
from orca_jax.core.sequence import Sequence

V = 64
MODEL = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=16, max_position_embeddings=8192)

# A few fixed shapes, so that the jitted expand is built once per (shape, bucket) and reused by
# every example; num_pages and the policy change no shape.
SHAPES = {
    "ps4": dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=40, min_token_bucket=4),
    "ps1": dict(page_size=1, max_num_seqs=3, max_num_batched_tokens=8, max_model_len=24, min_token_bucket=4),
    "ps8": dict(page_size=8, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=48, min_token_bucket=8),
}

expand_jit = jax.jit(expand, static_argnames=("page_size",))
record_jit = jax.jit(record_sampled)


def make_config(shape: str, num_pages: int, policy: str = "iteration") -> EngineConfig:
    return EngineConfig(scheduling=policy, num_pages=num_pages, **SHAPES[shape]).resolve(MODEL)


# ---- the fake model -----------------------------------------------------------------------
def fake_token(seq_id, index):
    """The index-th output token of sequence seq_id (numpy-vectorised)."""
    return (np.asarray(seq_id) * 37 + np.asarray(index) * 11 + 5) % V


def is_stop(token: int) -> bool:
    return token % 13 == 0


def stop_rule(seqs, tokens):
    return [("stop", t) if is_stop(t) else None for t in tokens]


def token_stream(seq: Sequence, length: int) -> list[int]:
    """The first `length` tokens of a sequence: its prompt, then the fake model's outputs
    (whether or not they have reached the host yet)."""
    n_out = max(0, length - seq.num_prompt_tokens)
    return (seq.prompt_token_ids + fake_token(seq.seq_id, np.arange(n_out)).tolist())[:length]


def host(tree):
    return jax.tree.map(np.asarray, tree)


@dataclasses.dataclass
class DeviceStep:
    inputs: StepInputs
    batch: object  # the expanded Batch, as numpy
    state: object  # the DeviceState after expand (before the sampled tokens are kept), numpy
    unresolved: int
    tokens: np.ndarray  # i32[S], what the fake model sampled


class DeviceRun:
    """The runner's side of the persistent batch, without a model: build, expand, sample
    (fake), keep the sampled tokens; the DeviceState is carried from step to step."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.state = create_device_state(config, create_token_counts(config, V))
        self.batch_state = BatchState(config)

    def step(self, scheduled: ScheduledBatch) -> DeviceStep:
        inputs = self.batch_state.build(scheduled)
        state, batch, counts, unresolved = expand_jit(self.state, inputs, page_size=self.config.page_size)
        assert counts.row_slot is not None
        batch = host(batch)
        # The fake model samples from what the device sees: the row's sequence and the output
        # index it draws (sample_index), so a wrong index shows as a wrong token.
        seq_ids = np.zeros(batch.logits_indices.shape[0], np.int64)
        seq_ids[:len(scheduled)] = [s.seq_id for s in scheduled.seqs]
        tokens = fake_token(seq_ids, batch.sampling.sample_index).astype(np.int32)
        self.state = record_jit(state, inputs, jnp.asarray(tokens))
        return DeviceStep(inputs, batch, host(state), int(unresolved), tokens)


# ---- checks -------------------------------------------------------------------------------
def assert_matches_build_batch(config: EngineConfig, scheduled: ScheduledBatch, got) -> None:
    """expand's Batch == build_batch's, field by field; the page table on the columns the
    row's cached tokens use (build_batch also lists pages reserved further ahead)."""
    expected = build_batch(config, scheduled)
    for name in ("input_ids", "logits_indices"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=name)
    for field in dataclasses.fields(expected.metadata):
        if field.name == "page_table":
            continue
        np.testing.assert_array_equal(getattr(got.metadata, field.name), getattr(expected.metadata, field.name),
                                      err_msg=field.name)
    for field in dataclasses.fields(expected.sampling):
        a, b = getattr(got.sampling, field.name), getattr(expected.sampling, field.name)
        assert a.dtype == b.dtype, field.name
        np.testing.assert_array_equal(a, b, err_msg=field.name)
    ps = config.page_size
    for row, kv_len in enumerate(expected.metadata.kv_lens.tolist()):
        used = -(-kv_len // ps)
        np.testing.assert_array_equal(got.metadata.page_table[row, :used], expected.metadata.page_table[row, :used],
                                      err_msg=f"page table row {row}")
        if row >= len(scheduled):
            assert np.all(got.metadata.page_table[row] == PADDING_PAGE), "a padding row reads a real page"


def assert_device_state(config: EngineConfig, scheduled: ScheduledBatch, step: DeviceStep,
                        join_starts: dict[int, int] | None = None) -> None:
    """After expand, each scheduled slot holds exactly its sequence's first start + n tokens:
    page-table entries for them (and nothing further), the output-token counts and the
    prompt-token set of the tokens fed since the sequence joined the slot (all of them, but a
    cached prefix it joined after: never for a sequence with penalties, which reads them);
    the fed tokens are the sequence's own. `join_starts`: seq_id -> its joining row's start
    (None: every sequence joined at 0)."""
    ps, sink = config.page_size, config.max_num_seqs
    state, batch = step.state, step.batch
    offset = 0
    for seq, n, start in zip(scheduled.seqs, scheduled.num_new, scheduled.starts):
        stream = token_stream(seq, start + n)
        np.testing.assert_array_equal(batch.input_ids[offset:offset + n], stream[start:], err_msg="fed tokens")
        offset += n
        need = -(-(start + n) // ps)
        np.testing.assert_array_equal(state.page_table[seq.slot, :need], seq.page_ids[:need])
        assert np.all(state.page_table[seq.slot, need:] == PADDING_PAGE), "page-table entries past the step"
        fed_from = join_starts[seq.seq_id] if join_starts is not None else 0
        assert fed_from == 0 or not seq.params.uses_penalties, "a sequence with penalties took a cached prefix"
        split = max(seq.num_prompt_tokens, fed_from)
        prompt, outputs = stream[fed_from:seq.num_prompt_tokens], stream[split:]
        np.testing.assert_array_equal(state.output_counts[seq.slot], np.bincount(outputs, minlength=V),
                                      err_msg=f"output counts of slot {seq.slot}")
        np.testing.assert_array_equal(state.prompt_seen[seq.slot], np.isin(np.arange(V), prompt),
                                      err_msg=f"prompt tokens of slot {seq.slot}")
    assert np.all(state.page_table[sink] == PADDING_PAGE), "the sink's page-table row was written"
    assert step.unresolved == 0, "a PENDING token found no token on the device"


def assert_page_writes(config: EngineConfig, step: DeviceStep) -> int:
    """Page writes fit the fixed per-bucket capacity; padding entries write the sink's column 0
    with the padding page. Returns the number of real writes."""
    writes = step.inputs.page_writes
    capacity = page_write_capacity(config, step.inputs.num_tokens)
    assert writes.shape == (capacity, 2)
    sink_entry = (config.max_num_seqs * config.max_pages_per_seq, PADDING_PAGE)
    real = ~np.all(writes == sink_entry, axis=1)
    count = int(real.sum())
    assert np.all(writes[real, 1] != PADDING_PAGE) and count <= capacity
    assert real[:count].all(), "real writes come first, padding after"
    return count


# ---- the driver -------------------------------------------------------------------------------
@dataclasses.dataclass
class Req:
    arrival: int
    prompt: list[int]
    max_tokens: int
    abort_at: int | None
    params: dict


@dataclasses.dataclass
class Events:
    preemptions: int = 0
    joins: int = 0
    chunks: int = 0  # prefill rows that do not sample
    slot_owners: Counter = dataclasses.field(default_factory=Counter)  # slot -> sequences that held it
    page_writes: int = 0
    discarded: int = 0
    aborted: int = 0
    cached_prefixes: int = 0  # joins after a cached prefix


def drive(config: EngineConfig, reqs: list[Req], overlapped: bool) -> tuple[dict[int, Sequence], Events]:
    sched = Scheduler(config, PageAllocator(config.num_pages, config.page_size))
    run = DeviceRun(config)
    seqs: dict[int, Sequence] = {}
    events, owners = Events(), set()
    join_starts: dict[int, int] = {}
    in_flight = None
    step = 0
    while step <= 12 or sched.has_unfinished() or in_flight:
        assert step < 2000, "no progress"
        for i, req in enumerate(reqs):
            if req.arrival == step:
                seqs[i] = Sequence(i, f"r{i}", 0, list(req.prompt),
                                   SamplingParams(max_tokens=req.max_tokens, **req.params), seed=1000 + i)
                sched.add(seqs[i])
            if req.abort_at == step and i in seqs and not seqs[i].is_finished:
                sched.finish(seqs[i], "abort")
                events.aborted += 1
        scheduled = sched.schedule()
        dispatched = None
        if scheduled:
            events.joins += sum(s.slot_joined for s in scheduled.seqs)
            for seq, start in zip(scheduled.seqs, scheduled.starts):
                if seq.slot_joined:
                    join_starts[seq.seq_id] = start
                    events.cached_prefixes += start > 0
            device_step = run.step(scheduled)
            if not overlapped:  # build_batch needs every token on the host
                assert_matches_build_batch(config, scheduled, device_step.batch)
            assert_device_state(config, scheduled, device_step, join_starts)
            events.page_writes += assert_page_writes(config, device_step)
            events.chunks += scheduled.samples.count(False)
            for seq in scheduled.seqs:
                if (seq.slot, seq.seq_id) not in owners:
                    owners.add((seq.slot, seq.seq_id))
                    events.slot_owners[seq.slot] += 1
            dispatched = (scheduled, device_step.tokens[:len(scheduled)])
        done, in_flight = (in_flight, dispatched) if overlapped else (dispatched, None)
        if done is not None:
            sched.postprocess(*done, stop_rule)
        step += 1
    events.preemptions = sched.num_preemptions
    events.discarded = sched.num_discarded_tokens
    assert sched.allocator.num_free == sched.allocator.num_usable and sched.slots.num_free == config.max_num_seqs
    for seq in seqs.values():  # every token appended is the fake model's next one
        assert seq.output_token_ids == fake_token(seq.seq_id, np.arange(len(seq.output_token_ids))).tolist()
    return seqs, events


PARAMS = [
    dict(temperature=0),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=0.7, top_k=5, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2),
    dict(temperature=0, logprobs=2),
]


@st.composite
def workloads(draw):
    shape = draw(st.sampled_from(sorted(SHAPES)))
    ps, max_len = SHAPES[shape]["page_size"], SHAPES[shape]["max_model_len"]
    reqs = []
    for _ in range(draw(st.integers(1, 9))):
        arrival = draw(st.integers(0, 10))
        prompt = draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=max_len - 1))
        if reqs and draw(st.booleans()):  # often a prefix of an earlier prompt, then its own tokens
            earlier = draw(st.sampled_from(reqs)).prompt
            prompt = (earlier[:draw(st.integers(1, len(earlier)))] + prompt)[:max_len - 1]
        abort_at = draw(st.one_of(st.none(), st.none(), st.integers(arrival, arrival + 20)))
        reqs.append(Req(arrival, prompt, draw(st.integers(1, 12)), abort_at, draw(st.sampled_from(PARAMS))))
    full = max(-(-min(len(r.prompt) + r.max_tokens, max_len) // ps) for r in reqs)
    num_pages = 1 + full + draw(st.one_of(st.integers(0, 2), st.integers(0, 3 * full)))
    return shape, num_pages, reqs


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from(["iteration", "request"]), st.booleans())
def test_expand_equals_build_batch_on_scheduled_runs(case, policy, overlapped):
    """Random arrivals, prompts, sampling parameters, aborts and tight pools (so chunked
    prefills, joins, preemptions, slot reuse and finished sequences mix), both policies,
    synchronous and overlapped. Every step: expand == build_batch (synchronous; overlapped
    tokens are still in flight, so there the fed tokens are checked against the sequence's
    own), the device's per-slot state is exactly that of the slot's sequence, page writes fit
    their capacity, and no PENDING token goes unresolved."""
    shape, num_pages, reqs = case
    drive(make_config(shape, num_pages, policy), reqs, overlapped)


def test_a_fixed_run_covers_preemption_chunks_joins_and_slot_reuse():
    """One tight workload where every event the property test relies on does happen, in both
    modes, and the outputs of requests not aborted agree between the modes."""
    # Requests i, i + 3 and i + 6 share a prompt prefix.
    reqs = [Req(arrival=i // 2, prompt=[(7 * (i % 3) + j) % V for j in range(4 + (5 * i) % 13)], max_tokens=10,
                abort_at=3 if i == 3 else None, params=PARAMS[i % len(PARAMS)]) for i in range(9)]
    config = make_config("ps4", num_pages=1 + 8)
    outputs = {}
    for overlapped in (False, True):
        seqs, events = drive(config, reqs, overlapped)
        assert events.preemptions > 0 and events.chunks > 0 and events.aborted == 1
        assert events.cached_prefixes > 0, "no sequence joined after a cached prefix"
        assert events.joins > len(reqs), "a preempted sequence rejoins a slot"
        assert max(events.slot_owners.values()) > 1, "no slot was reused"
        assert (events.discarded > 0) == overlapped
        outputs[overlapped] = {i: (s.finish_reason, s.output_token_ids) for i, s in seqs.items() if i != 3}
    assert outputs[False] == outputs[True]


# ---- PENDING tokens ---------------------------------------------------------------------------
def one_sequence_run(prompt_len=5):
    config = make_config("ps4", num_pages=16)
    sched = Scheduler(config, PageAllocator(config.num_pages, config.page_size))
    seq = Sequence(0, "r0", 0, list(range(1, 1 + prompt_len)), SamplingParams(temperature=0, max_tokens=8), 0)
    sched.add(seq)
    return config, sched, seq, DeviceRun(config)


def test_pending_token_comes_from_last_token_and_is_read_once():
    config, sched, seq, run = one_sequence_run()
    prefill = sched.schedule()
    first = run.step(prefill)
    assert first.inputs.row_flags[0] == ROW_SAMPLES | ROW_JOINS and PENDING_TOKEN not in first.inputs.input_ids
    sampled = int(first.tokens[0])
    assert int(np.asarray(run.state.last_token)[seq.slot]) == sampled, "the sampled token is kept in the slot"
    sched.postprocess(prefill, first.tokens[:1])
    decode = sched.schedule()
    second = run.step(decode)
    assert second.inputs.input_ids[0] == PENDING_TOKEN, "a decode token is not sent by the host"
    assert second.batch.input_ids[0] == sampled and second.unresolved == 0
    assert second.state.last_token[seq.slot] == PENDING_TOKEN, "a fed token is consumed"
    # The same inputs again without a new sample in between: the slot has no token to give.
    consumed = jax.tree.map(jnp.asarray, second.state)  # right after the decode's expand
    _, _, _, unresolved = expand_jit(consumed, second.inputs, page_size=config.page_size)
    assert int(unresolved) == 1
    # And the runner refuses such a step's result.
    out = SampleOutput(tokens=jnp.zeros(4, jnp.int32), logprobs=jnp.zeros(4), top_ids=jnp.zeros((4, 1), jnp.int32),
                       top_logprobs=jnp.zeros((4, 1)), unresolved_tokens=unresolved)
    with pytest.raises(RuntimeError, match="not on the device"):
        PendingStep(out).result()


def test_only_sampling_rows_leave_a_token_in_their_slot():
    """A prefill chunk short of the prompt's end samples nothing: its slot keeps no token (a
    PENDING read of it would be reported), and nor does the padding sink."""
    config, sched, seq, run = one_sequence_run(prompt_len=20)  # budget 16: two chunks
    chunk = sched.schedule()
    step = run.step(chunk)
    assert chunk.samples == [False] and step.inputs.row_flags[0] == ROW_JOINS
    last = np.asarray(run.state.last_token)
    assert last[seq.slot] == PENDING_TOKEN and last[config.max_num_seqs] == PENDING_TOKEN
    sched.postprocess(chunk, step.tokens[:1])
    rest = sched.schedule()
    step = run.step(rest)
    assert rest.samples == [True] and np.asarray(run.state.last_token)[seq.slot] == step.tokens[0]
    assert np.asarray(run.state.last_token)[config.max_num_seqs] == PENDING_TOKEN


def test_overlapped_decode_reads_the_token_still_in_flight():
    """Step k+1 is built and expanded before the host has step k's token: its input is
    PENDING, resolved on the device from step k's sample; its seeded draw index counts the
    pending token."""
    config, sched, seq, run = one_sequence_run()
    first_sched = sched.schedule()
    first = run.step(first_sched)
    second_sched = sched.schedule()  # the first token is still in flight
    assert seq.num_pending == 2 and seq.output_token_ids == []
    second = run.step(second_sched)
    assert second.inputs.input_ids[0] == PENDING_TOKEN and second.batch.input_ids[0] == first.tokens[0]
    assert second.inputs.sample_index[0] == 1 and first.inputs.sample_index[0] == 0
    assert second.unresolved == 0
    sched.postprocess(first_sched, first.tokens[:1])
    sched.postprocess(second_sched, second.tokens[:1])
    assert seq.output_token_ids == fake_token(0, np.arange(2)).tolist()


def test_a_reused_slot_starts_empty():
    """A slot given to a new sequence drops its previous owner's pages and penalty counts, and
    its first row is fed by the host (no stale last token is read)."""
    config = make_config("ps4", num_pages=16)
    config = dataclasses.replace(config, max_num_seqs=1)
    sched = Scheduler(config, PageAllocator(config.num_pages, config.page_size))
    run = DeviceRun(config)
    old = Sequence(0, "old", 0, [3, 4, 5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3), 0)
    new = Sequence(1, "new", 0, [9, 10], SamplingParams(temperature=0, max_tokens=2), 0)
    sched.add(old)
    sched.add(new)
    while not old.is_finished:
        scheduled = sched.schedule()
        sched.postprocess(scheduled, run.step(scheduled).tokens[:len(scheduled)])
    scheduled = sched.schedule()
    assert scheduled == [(new, 2)] and new.slot == 0
    step = run.step(scheduled)
    assert step.inputs.row_flags[0] & ROW_JOINS and PENDING_TOKEN not in step.inputs.input_ids
    assert_device_state(config, scheduled, step)
    assert np.all(step.state.page_table[0, 1:] == PADDING_PAGE)
    assert step.state.output_counts[0].sum() == 0 and step.state.prompt_seen[0].sum() == 2


# ---- page writes ------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["iteration", "request"])
def test_page_writes_send_only_the_pages_a_step_needs(policy):
    """A full step of prefills at page size 1 (the worst case: a write per token) fits the
    capacity; under the request-level policy, the pages reserved up to max_len are sent only
    as the sequence reaches them."""
    config = make_config("ps1", num_pages=1 + 3 * 24, policy=policy)  # budget 8, 3 sequences
    sched = Scheduler(config, PageAllocator(config.num_pages, config.page_size))
    run = DeviceRun(config)
    # Prompts with nothing in common: no cached prefix takes page writes away.
    seqs = [Sequence(i, f"r{i}", 0, [1 + i] * (2 + i), SamplingParams(temperature=0, max_tokens=20), 0)
            for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    scheduled = sched.schedule()
    assert scheduled.num_tokens == 2 + 3 + 3  # the budget, cut in the third prompt
    step = run.step(scheduled)
    assert assert_page_writes(config, step) == 8 <= page_write_capacity(config, step.inputs.num_tokens)
    if policy == "request":
        assert all(len(s.page_ids) == sched.max_len(s) for s in seqs), "request level reserves ahead"
    for _ in range(3):
        sched.postprocess(scheduled, step.tokens[:len(scheduled)])
        scheduled = sched.schedule()
        step = run.step(scheduled)
        assert assert_page_writes(config, step) == len(scheduled), "one new page per decode at page size 1"
        assert_device_state(config, scheduled, step)


# ---- what crosses per step ----------------------------------------------------------------------
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-caching", "prefix-caching"])
def test_step_inputs_bytes_are_bounded_whatever_the_context(prefix_caching):
    """StepInputs: 8T + 60S + 8C + 4 bytes (the token ids and the prompt_logprobs targets are T
    each), C = S + T/ps + 1 page writes plus, with prefix caching, room for one cached prefix's
    pages, at most MAX_CACHED_PAGES_PER_STEP. At T = S = 256 and page size 16: 19,596 bytes at
    any max_model_len without caching; with it, 23,692 at 8,192 tokens of context (the cap) and
    the same at 32,768; all far below 64 KB. The optional fields (the token bitmask, S x
    ceil(V / 32) words, and the logit bias, S x MAX_LOGIT_BIAS pairs) are part of StepInputs but
    cross only in steps with a row that needs them (the runner keeps their neutral values on
    the device), so they are counted apart."""
    T = 256
    sizes = {}
    for max_model_len in (2048, 8192, 32768):
        config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=T, page_size=16, num_pages=4096,
                              max_model_len=max_model_len, enable_prefix_caching=prefix_caching,
                              ).resolve(dataclasses.replace(MODEL, max_position_embeddings=32768))
        inputs = empty_step_inputs(config, T)
        cached = min(max_model_len // 16, MAX_CACHED_PAGES_PER_STEP) if prefix_caching else 0
        S, C = config.seq_bucket(T), page_write_capacity(config, T)
        assert (S, C) == (256, 273 + cached) and inputs.num_tokens == T
        assert inputs.token_bitmask.shape == (S, -(-MODEL.vocab_size // 32))
        assert inputs.bias_ids.shape == inputs.bias_values.shape == (S, MAX_LOGIT_BIAS)
        assert unsent_fields(inputs) == tuple(OPTIONAL_FIELDS)
        sizes[max_model_len] = inputs.nbytes - sum(getattr(inputs, name).nbytes for name in OPTIONAL_FIELDS)
        # A real step of 256 decodes is the same size (fixed shapes per bucket).
        sched = Scheduler(config, PageAllocator(config.num_pages, config.page_size))
        batch_state = BatchState(config)
        for i in range(256):
            sched.add(Sequence(i, f"r{i}", 0, [1], SamplingParams(max_tokens=4), 0))
        assert batch_state.build(sched.schedule()).nbytes == inputs.nbytes
    if prefix_caching:
        assert sizes[8192] == sizes[32768] == 8 * T + 60 * 256 + 8 * (273 + 512) + 4 == 23_692 < 64 * 1024
    else:
        assert sizes[2048] == sizes[8192] == sizes[32768] == 8 * T + 60 * 256 + 8 * 273 + 4 == 19_596


def test_step_inputs_flags_and_parameters_per_row():
    config = make_config("ps4", num_pages=16)
    sched = Scheduler(config, PageAllocator(config.num_pages, config.page_size))
    a = Sequence(0, "a", 0, [1, 2, 3], SamplingParams(temperature=0.5, top_k=7, logprobs=1, max_tokens=4), 2**32 + 9)
    b = Sequence(1, "b", 0, list(range(20)), SamplingParams(repetition_penalty=1.5, max_tokens=4), 4)
    sched.add(a)
    sched.add(b)
    inputs = BatchState(config).build(sched.schedule())
    assert inputs.row_flags[:2].tolist() == [ROW_SAMPLES | ROW_JOINS | ROW_LOGPROBS, ROW_JOINS]
    assert inputs.row_len[:2].tolist() == [3, 13] and inputs.row_prompt_len[:2].tolist() == [3, 20]
    assert inputs.top_k[:2].tolist() == [7, 0] and inputs.seeds[:2].tolist() == [9, 4]
    np.testing.assert_allclose(inputs.sampling[:2, [0, 5]], [[0.5, 1.0], [1.0, 1.5]])
    S = config.seq_bucket(inputs.num_tokens)
    assert inputs.row_slot[2:].tolist() == [config.max_num_seqs] * (S - 2), "padding rows use the sink"
    assert inputs.row_len[2:].sum() == 0 and inputs.row_flags[2:].sum() == 0


def test_a_rows_logit_bias_follows_its_slot_and_is_sent_only_with_a_biased_row():
    config = make_config("ps4", num_pages=32)
    sched = Scheduler(config, PageAllocator(config.num_pages, config.page_size))
    state = BatchState(config)
    biased = Sequence(0, "a", 0, [1, 2, 3], SamplingParams(max_tokens=1, logit_bias={5: 2.0, 9: -100.0}), 0)
    free = Sequence(1, "b", 0, [4, 5], SamplingParams(max_tokens=4), 0)
    sched.add(biased)
    sched.add(free)
    inputs = state.build(sched.schedule())
    flags = inputs.row_flags[:2]
    assert ((flags & ROW_BIASED) != 0).tolist() == [True, False] and unsent_fields(inputs) == ("token_bitmask",)
    assert inputs.bias_ids[0, :3].tolist() == [5, 9, 0] and inputs.bias_values[0, :3].tolist() == [2.0, -100.0, 0.0]
    assert not inputs.bias_ids[1:].any() and not inputs.bias_values[1:].any()
    # The slot's next sequence starts from no bias.
    successor = Sequence(3, "d", 0, [7], SamplingParams(max_tokens=4), 0)
    successor.slot = biased.slot
    state._join(successor)
    assert not state.has_bias[biased.slot] and not state.bias_values[biased.slot].any()
    # A step of free rows only carries the neutral (all-zero) table and says so.
    alone = BatchState(config)
    sched2 = Scheduler(config, PageAllocator(config.num_pages, config.page_size))
    sched2.add(Sequence(2, "c", 0, [4, 5], SamplingParams(max_tokens=4), 0))
    plain = alone.build(sched2.schedule())
    assert set(unsent_fields(plain)) == set(OPTIONAL_FIELDS) and not plain.bias_values.any()


# ---- SlotAllocator ------------------------------------------------------------------------------
def test_slot_allocator_never_hands_out_the_sink_and_refuses_double_release():
    slots = SlotAllocator(3)
    taken = [slots.acquire() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2] and slots.num_free == 0, "the sink (3) is never handed out"
    with pytest.raises(RuntimeError, match="no free batch slot"):
        slots.acquire()
    slots.release(taken[1])
    with pytest.raises(ValueError, match="not in use"):
        slots.release(taken[1])
    with pytest.raises(ValueError, match="not in use"):
        slots.release(3)  # the sink
    with pytest.raises(ValueError, match="not in use"):
        slots.release(-1)
    assert slots.num_free == 1 and slots.acquire() == taken[1]
    fresh = SlotAllocator(2)
    with pytest.raises(ValueError, match="not in use"):
        fresh.release(0)  # never acquired
