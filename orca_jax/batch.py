"""Batch: everything one step needs from the host, as flat int/float arrays padded to buckets.

Built in numpy once per step and handed to the jitted step as a pytree: the token ids, the
attention metadata (`orca_jax.kernels.metadata.AttentionMetadata`, the ragged structure that
RoPE, the KV write and attention read), the row of each sequence's last token, and the
per-row sampling parameters. Shapes depend only on the token bucket T (and through it the
sequence bucket S), so each bucket is one program.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

import jax
import numpy as np

from orca_jax.config import EngineConfig
from orca_jax.kernels.metadata import AttentionMetadata
from orca_jax.kv_cache import PADDING_PAGE
from orca_jax.scheduler import ScheduledBatch

# Penalty history encoding: generated token t is stored as t, prompt token t as -(t + 2),
# and -1 marks an empty slot. One int array carries both sets without knowing the vocabulary.
NO_TOKEN = -1
# The largest top_k a row carries: past every vocabulary, so a larger one means the same.
TOP_K_CAP = np.iinfo(np.int32).max


def encode_prompt_history(token_ids) -> np.ndarray:
    return -(np.asarray(token_ids, np.int32) + 2)


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
    # Token history for penalties, i32[S, max_model_len], encoded as described at NO_TOKEN.
    # Only filled for rows that use penalties.
    history: np.ndarray
    want_logprobs: np.ndarray  # bool[S]


@dataclass(frozen=True)
class Batch:
    input_ids: np.ndarray  # i32[T]
    metadata: AttentionMetadata  # positions, slot mapping, page table, kv/query lengths
    logits_indices: np.ndarray  # i32[S]: row of each sequence's last scheduled token
    sampling: SamplingInputs

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


jax.tree_util.register_dataclass(
    SamplingInputs, data_fields=[f.name for f in dataclasses.fields(SamplingInputs)], meta_fields=[]
)
jax.tree_util.register_dataclass(
    Batch, data_fields=[f.name for f in dataclasses.fields(Batch)], meta_fields=[]
)


def token_bucket(config: EngineConfig, num_tokens: int) -> int:
    i = bisect.bisect_left(config.token_buckets, num_tokens)
    if i == len(config.token_buckets):
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {config.token_buckets[-1]}")
    return config.token_buckets[i]


def empty_batch(config: EngineConfig, num_tokens: int) -> Batch:
    """A batch of padding only: the shape of one bucket (used for warm-up)."""
    return build_batch(config, [], bucket=num_tokens)


def build_batch(config: EngineConfig, scheduled: ScheduledBatch, bucket: int | None = None) -> Batch:
    total = sum(n for _, n in scheduled)
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
    for row, (seq, n_new) in enumerate(scheduled):
        first = seq.num_computed_tokens
        pos = np.arange(first, first + n_new, dtype=np.int32)
        pages = np.asarray(seq.page_ids, np.int32)
        input_ids[start:start + n_new] = seq.tokens(first, first + n_new)
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
        history=np.full((S, config.max_model_len), NO_TOKEN, np.int32),
        want_logprobs=np.zeros(S, bool),
    )
    for row, (seq, _) in enumerate(scheduled):
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
        inputs.sample_index[row] = len(seq.output_token_ids)
        inputs.want_logprobs[row] = p.logprobs is not None
        if p.uses_penalties:
            n_prompt, n_out = seq.num_prompt_tokens, len(seq.output_token_ids)
            inputs.history[row, :n_prompt] = encode_prompt_history(seq.prompt_token_ids)
            inputs.history[row, n_prompt:n_prompt + n_out] = seq.output_token_ids
    return inputs

