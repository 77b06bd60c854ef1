"""Batch: what the model and the sampler of one step read, as flat arrays padded to buckets.

The token ids, the attention metadata (`orca_jax.kernels.metadata.AttentionMetadata`, the
ragged structure that RoPE, the KV write and attention read), the row of each sequence's last
token, and the per-row sampling parameters. Shapes depend only on the token bucket T (and
through it the sequence bucket S), so each bucket is one program.

The engine's step program builds its Batch on the device, from the persistent per-slot state
and a small per-step delta (`orca_jax.worker.batch_state.expand`). `build_batch` here builds the same
Batch in numpy from the host's view of the schedule: the reference that expand is tested
against, and the form hand-made model and kernel tests use.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

import jax
import numpy as np

from orca_jax.config import EngineConfig
from orca_jax.structured.guided_decoding import step_token_bitmask
from orca_jax.kernels.metadata import AttentionMetadata
from orca_jax.core.kv_cache import PADDING_PAGE
from orca_jax.core.scheduler import ScheduledBatch
from orca_jax.core.sampling_params import MAX_LOGIT_BIAS

# input_ids entry of a token the host does not hold: a sampled token still on the device (the
# step program takes it from the persistent batch state, orca_jax.worker.batch_state).
PENDING_TOKEN = -1
# The largest top_k a row carries: past every vocabulary, so a larger one means the same.
TOP_K_CAP = np.iinfo(np.int32).max


@dataclass(frozen=True)
class SamplingInputs:
    """Per-row sampling parameters (S rows)."""

    temperature: np.ndarray  # f32[S]; 0 = greedy
    top_k: np.ndarray  # i32[S]; 0 = off
    top_p: np.ndarray  # f32[S]
    min_p: np.ndarray  # f32[S]
    presence_penalty: np.ndarray  # f32[S]
    frequency_penalty: np.ndarray  # f32[S]
    repetition_penalty: np.ndarray  # f32[S]
    seeds: np.ndarray  # u32[S]; per-sequence seed
    sample_index: np.ndarray  # i32[S]; which output token this is, folded into the seed
    want_logprobs: np.ndarray  # bool[S]
    # Constrained decoding (orca_jax.structured.guided_decoding): the rows whose logits the bitmask masks,
    # and the allowed tokens per row (bit v of word v // 32; all ones for free rows). None in
    # hand-made sampler inputs: then nothing is masked.
    guided: np.ndarray | None = None  # bool[S]
    token_bitmask: np.ndarray | None = None  # i32[S, ceil(V / 32)]
    # logit_bias (SamplingParams.logit_bias): the rows that have one, and per row (token, bias)
    # pairs, zero-padded; None in hand-made sampler inputs: then nothing is biased.
    biased: np.ndarray | None = None  # bool[S]
    bias_ids: np.ndarray | None = None  # i32[S, B]
    bias_values: np.ndarray | None = None  # f32[S, B]


@dataclass(frozen=True)
class VerifyLayout:
    """Speculative decoding: the step's output positions, L of them (L = EngineConfig.logits_rows).
    Row r's positions are `offsets[r]` onwards, 1 + (its draft count): logits at its last
    known token, then at each draft; positions past the real ones are padding."""

    row_of: np.ndarray  # i32[L]: the row (sequence) of each position
    offsets: np.ndarray  # i32[S]: each row's first position
    draft_tokens: np.ndarray  # i32[L]: the draft the position's logits verify (the next input token); -1: none


@dataclass(frozen=True)
class Batch:
    input_ids: np.ndarray  # i32[T]
    metadata: AttentionMetadata  # positions, slot mapping, page table, kv/query lengths
    # i32[S] (i32[L] with speculation): token index of each output position, a sequence's last
    # scheduled token (and with speculation the token before each of its drafts).
    logits_indices: np.ndarray
    sampling: SamplingInputs  # per output position
    verify: VerifyLayout | None = None  # only in steps of an engine that speculates

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


jax.tree_util.register_dataclass(
    SamplingInputs, data_fields=[f.name for f in dataclasses.fields(SamplingInputs)], meta_fields=[]
)
for _cls in (Batch, VerifyLayout):
    jax.tree_util.register_dataclass(_cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])


def token_bucket(config: EngineConfig, num_tokens: int) -> int:
    i = bisect.bisect_left(config.token_buckets, num_tokens)
    if i == len(config.token_buckets):
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {config.token_buckets[-1]}")
    return config.token_buckets[i]


def empty_batch(config: EngineConfig, num_tokens: int) -> Batch:
    """A batch of padding only: the shape of one bucket (used for warm-up)."""
    return build_batch(config, [], bucket=num_tokens)


def build_batch(config: EngineConfig, scheduled: ScheduledBatch | list, bucket: int | None = None) -> Batch:
    """`scheduled` as schedule() returns it, or (sequence, new tokens) pairs of sequences whose
    cached counts have not been advanced (hand-made tests)."""
    if not isinstance(scheduled, ScheduledBatch):
        scheduled = ScheduledBatch.of(scheduled)
    total = scheduled.num_tokens
    T = bucket or token_bucket(config, max(total, 1))
    S = config.seq_bucket(T)
    page_size = config.page_size
    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.arange(T, dtype=np.int32) % page_size + PADDING_PAGE * page_size
    page_table = np.full((S, config.max_pages_per_seq), PADDING_PAGE, np.int32)
    kv_lens = np.zeros(S, np.int32)
    cu_q_lens = np.full(S + 1, total, np.int32)
    logits_indices = np.zeros(S, np.int32)
    cu_q_lens[0] = 0

    start = 0
    for row, (seq, n_new, first) in enumerate(zip(scheduled.seqs, scheduled.num_new, scheduled.starts)):
        pos = np.arange(first, first + n_new, dtype=np.int32)
        pages = np.asarray(seq.page_ids, np.int32)
        known = seq.tokens(first, min(first + n_new, seq.num_tokens))
        input_ids[start:start + len(known)] = known
        input_ids[start + len(known):start + n_new] = PENDING_TOKEN
        positions[start:start + n_new] = pos
        slot_mapping[start:start + n_new] = pages[pos // page_size] * page_size + pos % page_size
        page_table[row, :len(pages)] = pages
        kv_lens[row] = first + n_new
        start += n_new
        cu_q_lens[row + 1] = start
        logits_indices[row] = start - 1

    metadata = AttentionMetadata(
        positions=positions,
        slot_mapping=slot_mapping,
        page_table=page_table,
        kv_lens=kv_lens,
        cu_q_lens=cu_q_lens,
        num_seqs=np.array([len(scheduled)], np.int32),
    )
    return Batch(
        input_ids=input_ids,
        metadata=metadata,
        logits_indices=logits_indices,
        sampling=_sampling_inputs(config, scheduled, S),
    )


def _sampling_inputs(config: EngineConfig, scheduled: ScheduledBatch, S: int) -> SamplingInputs:
    guided, token_bitmask = step_token_bitmask(scheduled, S, config.vocab_size)
    inputs = SamplingInputs(
        temperature=np.zeros(S, np.float32),
        top_k=np.zeros(S, np.int32),
        top_p=np.ones(S, np.float32),
        min_p=np.zeros(S, np.float32),
        presence_penalty=np.zeros(S, np.float32),
        frequency_penalty=np.zeros(S, np.float32),
        repetition_penalty=np.ones(S, np.float32),
        seeds=np.zeros(S, np.uint32),
        sample_index=np.zeros(S, np.int32),
        want_logprobs=np.zeros(S, bool),
        guided=guided,
        token_bitmask=token_bitmask,
        biased=np.zeros(S, bool),
        bias_ids=np.zeros((S, MAX_LOGIT_BIAS), np.int32),
        bias_values=np.zeros((S, MAX_LOGIT_BIAS), np.float32),
    )
    for row, (seq, samples) in enumerate(zip(scheduled.seqs, scheduled.samples)):
        p = seq.params
        inputs.temperature[row] = p.temperature
        # Any top_k at least the vocabulary keeps it all; the cap keeps it an int32.
        inputs.top_k[row] = min(p.top_k, TOP_K_CAP)
        inputs.top_p[row] = p.top_p
        inputs.min_p[row] = p.min_p
        inputs.presence_penalty[row] = p.presence_penalty
        inputs.frequency_penalty[row] = p.frequency_penalty
        inputs.repetition_penalty[row] = p.repetition_penalty
        inputs.seeds[row] = seq.seed & 0xFFFFFFFF
        # The pending tokens come first (this row's own is among them once schedule() counted it).
        inputs.sample_index[row] = len(seq.output_token_ids) + seq.num_pending - (samples and scheduled.pending_counted)
        inputs.want_logprobs[row] = p.logprobs is not None
        if p.logit_bias:
            inputs.biased[row] = True
            inputs.bias_ids[row, :len(p.logit_bias)] = list(p.logit_bias)
            inputs.bias_values[row, :len(p.logit_bias)] = list(p.logit_bias.values())
    return inputs

