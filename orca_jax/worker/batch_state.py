"""The persistent batch: per-slot state that lives on the device across steps, and the small
per-step inputs that update it.

Every running sequence holds a slot (`Scheduler.slots`, a row in [0, max_num_seqs); row
`max_num_seqs` is the padding sink). What grows with the context or the vocabulary stays on
the device, per slot, and is changed in place (donated with the KV cache):

    DeviceState (R = max_num_seqs + 1 slots, P = max_pages_per_seq, V = vocab)
      page_table     i32[R, P]  the slot's pages; PADDING_PAGE where unused
      last_token     i32[R]     the token the slot sampled last, until a step feeds it (then -1)
      output_counts  i32[R, V]  how often each token occurs in the slot's output (penalties)
      prompt_seen    bool[R, V] which tokens occur in its prompt (repetition penalty)

Each step the host sends only a `StepInputs` (about 18 KB at 256 rows, whatever max_model_len
is): per row its slot, start, length and sampling parameters, the token ids the host knows
(prompt chunks, recomputes), and the pages added since the slot's last step. A decode row's
token is `PENDING_TOKEN`: the device takes it from `last_token`, so a sampled token reaches
the next step without a trip through the host, which is what lets the engine dispatch step
N+1 before it has read step N's tokens. `expand` (the first code of the step program) turns
state + inputs into the same `Batch` that `orca_jax.worker.batch.build_batch` builds in numpy, so the
model and kernels are unchanged; build_batch stays as the reference form (tests, simulate).

`BatchState` is the host side: numpy mirrors of what each slot holds (its sampling
parameters, how many of its pages the device has, whether its last row sampled), written when
a sequence joins its slot, so building a step costs O(rows) vectorised numpy plus O(tokens the
host must send).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.worker.batch import PENDING_TOKEN, TOP_K_CAP, Batch, SamplingInputs, VerifyLayout, token_bucket
from orca_jax.config import EngineConfig
from orca_jax.structured.guided_decoding import step_token_bitmask
from orca_jax.kernels.metadata import AttentionMetadata
from orca_jax.core.kv_cache import PADDING_PAGE
from orca_jax.worker.sampling import TokenCounts
from orca_jax.core.scheduler import ScheduledBatch
from orca_jax.core.sampling_params import MAX_LOGIT_BIAS

# row_flags bits.
ROW_SAMPLES = 1  # the row reaches its sequence's end: its sampled token is kept in last_token
ROW_JOINS = 2  # the slot is new to the row's sequence: its device rows start from empty
ROW_LOGPROBS = 4  # the row asks for top log-probabilities
ROW_GUIDED = 8  # the row samples under a grammar: token_bitmask masks its logits
ROW_BIASED = 16  # the row's request has a logit_bias: bias_ids / bias_values hold it
# Columns of StepInputs.sampling.
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(6)


@dataclass(frozen=True)
class DeviceState:
    page_table: jax.Array  # i32[R, P]
    last_token: jax.Array  # i32[R]
    output_counts: jax.Array  # i32[R, V]
    prompt_seen: jax.Array  # bool[R, V]


@dataclass(frozen=True)
class StepInputs:
    """All that crosses host -> device per step; shapes depend only on the token bucket T."""

    input_ids: np.ndarray  # i32[T]: known token ids; PENDING_TOKEN where the device has it; 0 pads
    row_slot: np.ndarray  # i32[S]: slot of each row; the sink for padding rows
    row_start: np.ndarray  # i32[S]: tokens cached before this step
    row_len: np.ndarray  # i32[S]: new tokens (0 for padding rows)
    row_prompt_len: np.ndarray  # i32[S]: positions below it are prompt (penalty bookkeeping)
    row_flags: np.ndarray  # i32[S]: ROW_* bits
    sample_index: np.ndarray  # i32[S]: which output token the row samples (seeded draws)
    top_k: np.ndarray  # i32[S]: 0 = off
    seeds: np.ndarray  # u32[S]
    sampling: np.ndarray  # f32[S, 6]: temperature, top_p, min_p, presence, frequency, repetition
    page_writes: np.ndarray  # i32[C, 2]: (slot * P + column, page); padding writes the sink's column 0
    num_seqs: np.ndarray  # i32[1]
    # i32[S]: draft tokens the row verifies (its last row_drafts tokens; speculative decoding).
    # Each adds an output position after the row's own: logits, a sampled token, log-probs.
    row_drafts: np.ndarray
    # i32[S, ceil(V / 32)]: allowed next tokens of ROW_GUIDED rows (all ones elsewhere). The
    # runner sends it only when a row is guided; otherwise a device-resident all-ones array
    # of the bucket's shape stands in (orca_jax.worker.runner).
    token_bitmask: np.ndarray
    # i32[T]: for a token of a prompt that asks for prompt_logprobs, the prompt token after it
    # (orca_jax.models.prompt_logprobs); -1 elsewhere, and then the step skips that work.
    prompt_targets: np.ndarray
    # i32[S, MAX_LOGIT_BIAS] / f32[S, MAX_LOGIT_BIAS]: the logit_bias of ROW_BIASED rows as (token,
    # bias) pairs, zero-padded (a zero bias on token 0 changes nothing). Sent only in a step with
    # such a row, as the bitmask is (OPTIONAL_FIELDS).
    bias_ids: np.ndarray
    bias_values: np.ndarray

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self))


for _cls in (DeviceState, StepInputs):
    jax.tree_util.register_dataclass(_cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])


# The fields a step carries only when one of its rows has the flag: in any other step they hold
# their neutral value (an all-ones bitmask, a zero bias), and the runner passes a copy of it
# placed on the device once per bucket instead (runner_base.with_placed_neutral_fields), so a
# step that needs neither sends neither (1.5 MB of bitmask and 600 KB of bias at S = 256).
OPTIONAL_FIELDS = {"token_bitmask": ROW_GUIDED, "bias_ids": ROW_BIASED, "bias_values": ROW_BIASED}


def step_flags(inputs: StepInputs) -> int:
    """The ROW_* bits any row of the step has."""
    return int(np.bitwise_or.reduce(inputs.row_flags))


def unsent_fields(inputs: StepInputs | None = None, flags: int | None = None) -> tuple[str, ...]:
    """The optional fields no row of this step needs (given the step or its step_flags): they
    hold their neutral value."""
    flags = step_flags(inputs) if flags is None else flags
    return tuple(name for name, flag in OPTIONAL_FIELDS.items() if not flags & flag)


def num_slots(config: EngineConfig) -> int:
    return config.max_num_seqs + 1


def page_write_capacity(config: EngineConfig, num_tokens: int) -> int:
    """Most page-table entries one step can add: a row of n new tokens starting at s adds
    ceil((s+n)/ps) - ceil(s/ps) <= n/ps + 1 pages, so a bucket adds at most T/ps + S; and a
    sequence joining after a cached prefix adds that prefix's pages, which the scheduler
    keeps to `cached_pages_per_step` per step."""
    return config.seq_bucket(num_tokens) + num_tokens // config.page_size + 1 + config.cached_pages_per_step


def create_token_counts(config: EngineConfig, vocab_size: int, sharding=None) -> tuple[jax.Array, jax.Array]:
    """The penalty state, zeroed: allocated before the KV pool is sized, since it is the part
    that scales with the vocabulary (63 MB at 257 slots and V = 49152)."""
    shape = (num_slots(config), vocab_size)
    return _zeros(shape, jnp.int32, sharding), _zeros(shape, jnp.bool_, sharding)


def create_device_state(config: EngineConfig, token_counts, sharding=None) -> DeviceState:
    R = num_slots(config)
    output_counts, prompt_seen = token_counts
    return DeviceState(
        page_table=_full((R, config.max_pages_per_seq), PADDING_PAGE, sharding),
        last_token=_full((R,), PENDING_TOKEN, sharding),
        output_counts=output_counts,
        prompt_seen=prompt_seen,
    )


def _zeros(shape, dtype, sharding):
    return jnp.zeros(shape, dtype, device=sharding)


def _full(shape, value, sharding):
    return jnp.full(shape, value, jnp.int32, device=sharding)


def _prompt_targets(seqs, starts: np.ndarray, lens: np.ndarray, ends: np.ndarray, T: int) -> np.ndarray:
    """i32[T]: the next prompt token of each prompt token the step computes for a sequence that
    asks for prompt_logprobs (its first sample only: the others have the same prompt), else -1.
    A prompt's last token has none (what follows it is sampled)."""
    targets = np.full(T, -1, np.int32)
    for row, seq in enumerate(seqs):
        if seq.params.prompt_logprobs is None or seq.index != 0:
            continue
        start, stop = int(starts[row]), min(int(starts[row] + lens[row]), seq.num_prompt_tokens - 1)
        if start < stop:
            first = int(ends[row] - lens[row])
            targets[first:first + stop - start] = seq.prompt_token_ids[start + 1:stop + 1]
    return targets


def empty_step_inputs(config: EngineConfig, num_tokens: int) -> StepInputs:
    """A step of padding only: one bucket's shapes (warm-up, and what a multi-host follower
    receives into)."""
    return BatchState(config).build(ScheduledBatch(), bucket=num_tokens)


class BatchState:
    """Host mirrors of the per-slot state, and the builder of each step's StepInputs."""

    def __init__(self, config: EngineConfig):
        self.config = config
        R = num_slots(config)
        self.sink = config.max_num_seqs
        self.pages_on_device = np.zeros(R, np.int32)  # page-table entries the device holds per slot
        self.sampled_last = np.zeros(R, bool)  # the slot's last row sampled: its next token is on the device
        # Pipeline parallelism: every token comes from the host. Under Orca's rule a sequence is
        # scheduled only after its last batch returned, so the host has its token, and only the
        # last stage samples: the first stage, which embeds, never holds a sampled token.
        self.tokens_from_host = config.pipeline_parallel_size > 1
        self.params = np.zeros((R, 6), np.float32)
        self.params[:, TOP_P] = self.params[:, REPETITION] = 1.0
        self.top_k = np.zeros(R, np.int32)
        self.seeds = np.zeros(R, np.uint32)
        self.want_logprobs = np.zeros(R, bool)
        self.prompt_len = np.zeros(R, np.int32)
        self.has_bias = np.zeros(R, bool)
        self.bias_ids = np.zeros((R, MAX_LOGIT_BIAS), np.int32)
        self.bias_values = np.zeros((R, MAX_LOGIT_BIAS), np.float32)

    def _join(self, seq) -> None:
        """A sequence takes its slot: the slot's mirrors start from its parameters."""
        slot, p = seq.slot, seq.params
        self.params[slot] = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                             p.repetition_penalty)
        # Any top_k at least the vocabulary keeps it all; the cap keeps it an int32.
        self.top_k[slot] = min(p.top_k, TOP_K_CAP)
        self.seeds[slot] = seq.seed & 0xFFFFFFFF
        self.want_logprobs[slot] = p.logprobs is not None
        self.prompt_len[slot] = seq.num_prompt_tokens
        self._join_logit_bias(slot, p.logit_bias)
        self.pages_on_device[slot] = 0
        self.sampled_last[slot] = False
        seq.slot_joined = False
        seq.pages_trimmed_to = None

    def _join_logit_bias(self, slot: int, logit_bias: dict[int, float] | None) -> None:
        self.has_bias[slot] = bool(logit_bias)
        self.bias_ids[slot] = 0
        self.bias_values[slot] = 0.0
        if logit_bias:
            self.bias_ids[slot, :len(logit_bias)] = list(logit_bias)
            self.bias_values[slot, :len(logit_bias)] = list(logit_bias.values())

    def _step_logit_bias(self, slots: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(biased bool[n], bias_ids i32[S, B], bias_values f32[S, B]) of the step's rows: a
        gather of the slots' tables, done only in a step with a biased row."""
        biased = self.has_bias[slots]
        ids, values = np.zeros((S, MAX_LOGIT_BIAS), np.int32), np.zeros((S, MAX_LOGIT_BIAS), np.float32)
        if biased.any():
            ids[:len(slots)], values[:len(slots)] = self.bias_ids[slots], self.bias_values[slots]
        return biased, ids, values

    def build(self, scheduled: ScheduledBatch, bucket: int | None = None) -> StepInputs:
        n = len(scheduled)
        seqs = scheduled.seqs
        # A padded policy's rectangle ("request_padded") is computed whole: its padding tokens run
        # through the dense layers after the real ones and write the sink page.
        T = bucket or token_bucket(self.config, max(scheduled.num_tokens + scheduled.num_padding_tokens, 1))
        S = self.config.seq_bucket(T)
        joins = np.zeros(S, bool)
        for row, seq in enumerate(seqs):
            if seq.slot_joined:
                joins[row] = True
                self._join(seq)
            elif seq.pages_trimmed_to is not None:  # a rejected run gave pages back: resend from there
                self.pages_on_device[seq.slot] = min(self.pages_on_device[seq.slot], seq.pages_trimmed_to)
                seq.pages_trimmed_to = None

        slots = np.fromiter((s.slot for s in seqs), np.int32, n)
        starts = np.asarray(scheduled.starts, np.int32)
        lens = np.asarray(scheduled.num_new, np.int32)
        samples = np.asarray(scheduled.samples, bool)
        ends = np.cumsum(lens, dtype=np.int32)

        row_slot = np.full(S, self.sink, np.int32)
        row_slot[:n] = slots
        row_start, row_len = _padded(starts, S), _padded(lens, S)
        row_prompt_len = _padded(self.prompt_len[slots], S)
        guided, token_bitmask = step_token_bitmask(scheduled, S, self.config.vocab_size)
        biased, bias_ids, bias_values = self._step_logit_bias(slots, S)
        flags = (samples * ROW_SAMPLES + joins[:n] * ROW_JOINS + self.want_logprobs[slots] * ROW_LOGPROBS
                 + guided[:n] * ROW_GUIDED + biased * ROW_BIASED)
        row_flags = _padded(flags.astype(np.int32), S)

        input_ids = np.zeros(T, np.int32)
        on_device = self.sampled_last[slots] & (not self.tokens_from_host)
        num_drafts = np.fromiter((len(d) for d in scheduled.drafts), np.int32, n)
        # Such a row's first token is the pending one (then only its drafts, if any).
        input_ids[(ends - lens)[on_device]] = PENDING_TOKEN
        for row in np.flatnonzero(~on_device).tolist():  # prompt chunks and recomputes
            start, known = int(starts[row]), int(lens[row] - num_drafts[row])
            input_ids[ends[row] - lens[row]:ends[row] - lens[row] + known] = seqs[row].tokens(start, start + known)
        for row in np.flatnonzero(num_drafts).tolist():
            input_ids[ends[row] - num_drafts[row]:ends[row]] = scheduled.drafts[row]
        assert (lens[on_device] == 1 + num_drafts[on_device]).all(), \
            "a row fed from the device carries one token, then its drafts"
        self.sampled_last[slots] = samples

        pending = np.fromiter((s.num_pending for s in seqs), np.int32, n)
        outputs = np.fromiter((len(s.output_token_ids) for s in seqs), np.int32, n)
        sample_index = _padded(outputs + pending - samples * scheduled.pending_counted, S)  # pending ones first

        prompt_targets = _prompt_targets(seqs, starts, lens, ends, T)

        sampling = np.zeros((S, 6), np.float32)
        sampling[:, TOP_P] = sampling[:, REPETITION] = 1.0
        sampling[:n] = self.params[slots]
        return StepInputs(
            input_ids=input_ids,
            row_slot=row_slot,
            row_start=row_start,
            row_len=row_len,
            row_prompt_len=row_prompt_len,
            row_flags=row_flags,
            sample_index=sample_index,
            top_k=_padded(self.top_k[slots], S),
            seeds=_padded(self.seeds[slots], S),
            sampling=sampling,
            page_writes=self._page_writes(seqs, slots, starts + lens, page_write_capacity(self.config, T)),
            num_seqs=np.array([n], np.int32),
            token_bitmask=token_bitmask,
            row_drafts=_padded(num_drafts, S),
            prompt_targets=prompt_targets,
            bias_ids=bias_ids,
            bias_values=bias_values,
        )

    def _page_writes(self, seqs, slots: np.ndarray, ends: np.ndarray, capacity: int) -> np.ndarray:
        """The page-table entries the device lacks for this step's tokens (pages reserved
        further ahead, as the request-level policy does, are sent when first needed)."""
        ps, P = self.config.page_size, self.config.max_pages_per_seq
        writes = np.empty((capacity, 2), np.int32)
        writes[:] = (self.sink * P, PADDING_PAGE)
        needed = -(-ends // ps)
        count = 0
        for row in np.flatnonzero(needed > self.pages_on_device[slots]).tolist():
            slot, have, need = int(slots[row]), int(self.pages_on_device[slots[row]]), int(needed[row])
            k = need - have
            writes[count:count + k, 0] = slot * P + np.arange(have, need)
            writes[count:count + k, 1] = seqs[row].page_ids[have:need]
            self.pages_on_device[slot] = need
            count += k
        assert count <= capacity, f"{count} page writes exceed the step's capacity {capacity}"
        return writes


def _padded(values: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, values.dtype)
    out[:len(values)] = values
    return out


# ---- on the device ---------------------------------------------------------------------------
def expand(state: DeviceState, inputs: StepInputs, page_size: int, logits_rows: int | None = None):
    """state + the step's inputs -> (state with this step's joins, pages and fed tokens
    applied, the step's Batch, its TokenCounts, the count of PENDING tokens that found no
    token, which must be 0). Runs inside the step program. `logits_rows` (speculative
    decoding, EngineConfig.logits_rows): the Batch has that many output positions, laid out
    by `verify_layout`; None: one per row."""
    R, P = state.page_table.shape
    T, S = inputs.input_ids.shape[0], inputs.row_slot.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    ends = jnp.cumsum(inputs.row_len).astype(jnp.int32)  # i32[S]
    total = ends[-1]
    # The row of each token: the first whose end lies past it (padding tokens: the last row).
    row_of = jnp.minimum(jnp.searchsorted(ends, t, side="right"), S - 1)
    real = t < total
    slot_of = jnp.where(real, inputs.row_slot[row_of], R)  # R: out of range, dropped by scatters
    positions = jnp.where(real, inputs.row_start[row_of] + t - (ends[row_of] - inputs.row_len[row_of]), 0)

    page_table, output_counts, prompt_seen = _reset_joined_slots(state, inputs)
    page_table = page_table.reshape(-1).at[inputs.page_writes[:, 0]].set(inputs.page_writes[:, 1]).reshape(R, P)

    # Tokens the host did not know are the slot's last sampled one; each is read once.
    pending = inputs.input_ids == PENDING_TOKEN
    from_slot = state.last_token[jnp.minimum(slot_of, R - 1)]
    input_ids = jnp.where(pending, from_slot, inputs.input_ids)
    unresolved = jnp.sum(pending & (from_slot < 0))
    last_token = state.last_token.at[jnp.where(pending, slot_of, R)].set(PENDING_TOKEN, mode="drop")

    # Penalty statistics from the tokens fed: a decode row feeds the last output token, so at
    # sampling time the counts cover every output token so far (recomputes rebuild them).
    is_output = real & (positions >= inputs.row_prompt_len[row_of])
    output_counts = output_counts.at[jnp.where(is_output, slot_of, R), input_ids].add(1, mode="drop")
    prompt_seen = prompt_seen.at[jnp.where(real & ~is_output, slot_of, R), input_ids].set(True, mode="drop")

    real_row = inputs.row_len > 0
    page_of_token = page_table[jnp.minimum(slot_of, R - 1), positions // page_size]
    metadata = AttentionMetadata(
        positions=positions,
        slot_mapping=jnp.where(real, page_of_token * page_size + positions % page_size,
                               t % page_size + PADDING_PAGE * page_size),
        page_table=page_table[inputs.row_slot],
        kv_lens=jnp.where(real_row, inputs.row_start + inputs.row_len, 0),
        cu_q_lens=jnp.concatenate([jnp.zeros(1, jnp.int32), ends]),
        num_seqs=inputs.num_seqs,
    )
    state = DeviceState(page_table, last_token, output_counts, prompt_seen)
    if logits_rows is None:
        batch = Batch(input_ids=input_ids, metadata=metadata, logits_indices=jnp.where(real_row, ends - 1, 0),
                      sampling=sampling_inputs(inputs))
        return state, batch, TokenCounts(output_counts, prompt_seen, inputs.row_slot), unresolved
    layout, token_index, draft_index = verify_layout(inputs, input_ids, ends, logits_rows)
    sampling = jax.tree.map(lambda x: x[layout.row_of], sampling_inputs(inputs))
    # Position i of a row samples its output token i further on (seeded draws stay per token).
    sampling = dataclasses.replace(sampling, sample_index=sampling.sample_index + draft_index)
    batch = Batch(input_ids=input_ids, metadata=metadata, logits_indices=token_index, sampling=sampling,
                  verify=layout)
    return state, batch, TokenCounts(output_counts, prompt_seen, inputs.row_slot[layout.row_of]), unresolved


def verify_layout(inputs: StepInputs, input_ids: jax.Array, ends: jax.Array, num_positions: int):
    """The output positions of a speculating step: each real row has 1 + row_drafts of them,
    back to back in row order: (VerifyLayout, token index of each position, its index within
    its row). Position i of a row takes the logits of the row's token before its i-th draft
    (i = 0: its last known token), so they verify draft i, or after the last draft give the
    bonus token."""
    S, T = inputs.row_len.shape[0], input_ids.shape[0]
    per_row = jnp.where(inputs.row_len > 0, 1 + inputs.row_drafts, 0)
    cum = jnp.cumsum(per_row).astype(jnp.int32)
    offsets = cum - per_row
    j = jnp.arange(num_positions, dtype=jnp.int32)
    row_of = jnp.minimum(jnp.searchsorted(cum, j, side="right"), S - 1).astype(jnp.int32)
    index = j - offsets[row_of]
    real = j < cum[-1]
    drafts = inputs.row_drafts[row_of]
    token_index = jnp.where(real, ends[row_of] - 1 - drafts + index, 0)
    draft_tokens = jnp.where(real & (index < drafts), input_ids[jnp.minimum(token_index + 1, T - 1)], -1)
    layout = VerifyLayout(row_of=row_of, offsets=offsets, draft_tokens=draft_tokens)
    return layout, token_index, jnp.where(real, index, 0)


def _reset_joined_slots(state: DeviceState, inputs: StepInputs):
    """Empty the rows of slots a sequence joins this step. A loop over the joining rows only
    (a handful per step), each a row update in place: a masked write of all S rows would
    touch S x V counts every step."""
    joined = (inputs.row_flags & ROW_JOINS) != 0
    (join_rows,) = jnp.nonzero(joined, size=joined.shape[0], fill_value=0)

    def reset(i, carry):
        page_table, counts, seen = carry
        slot = inputs.row_slot[join_rows[i]]
        page_table = jax.lax.dynamic_update_slice(page_table, jnp.full((1, page_table.shape[1]), PADDING_PAGE,
                                                                       page_table.dtype), (slot, 0))
        counts = jax.lax.dynamic_update_slice(counts, jnp.zeros((1, counts.shape[1]), counts.dtype), (slot, 0))
        seen = jax.lax.dynamic_update_slice(seen, jnp.zeros((1, seen.shape[1]), seen.dtype), (slot, 0))
        return page_table, counts, seen

    carry = (state.page_table, state.output_counts, state.prompt_seen)
    return jax.lax.fori_loop(0, jnp.sum(joined), reset, carry)


def sampling_inputs(inputs: StepInputs) -> SamplingInputs:
    s = inputs.sampling
    return SamplingInputs(
        temperature=s[:, TEMPERATURE], top_k=inputs.top_k, top_p=s[:, TOP_P], min_p=s[:, MIN_P],
        presence_penalty=s[:, PRESENCE], frequency_penalty=s[:, FREQUENCY], repetition_penalty=s[:, REPETITION],
        seeds=inputs.seeds, sample_index=inputs.sample_index,
        want_logprobs=(inputs.row_flags & ROW_LOGPROBS) != 0,
        guided=(inputs.row_flags & ROW_GUIDED) != 0, token_bitmask=inputs.token_bitmask,
        biased=(inputs.row_flags & ROW_BIASED) != 0, bias_ids=inputs.bias_ids, bias_values=inputs.bias_values,
    )


def record_sampled(state: DeviceState, inputs: StepInputs, tokens: jax.Array,
                   verify: VerifyLayout | None = None, num_accepted: jax.Array | None = None) -> DeviceState:
    """Keep each sampling row's token in its slot, for the next step to feed: with speculation,
    its last new token (after the accepted drafts)."""
    R = state.last_token.shape[0]
    if verify is not None:
        tokens = tokens[verify.offsets + num_accepted]
    samples = (inputs.row_flags & ROW_SAMPLES) != 0
    last_token = state.last_token.at[jnp.where(samples, inputs.row_slot, R)].set(tokens, mode="drop")
    return dataclasses.replace(state, last_token=last_token)
