"""build_batch: the flat, bucket-padded step inputs for a hand-made mixed batch."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_jax.worker.batch import Batch, build_batch, empty_batch, token_bucket
from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.kernels.testing import ragged_metadata
from orca_jax.core.kv_cache import PADDING_PAGE, PageAllocator
from orca_jax.core.sampling_params import SamplingParams
from orca_jax.core.scheduler import ScheduledBatch, Scheduler
from orca_jax.core.sequence import Sequence

MODEL = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
)


def make_config(**kw) -> EngineConfig:
    settings_ = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=64, min_token_bucket=8)
    settings_.update(kw)
    return EngineConfig(**settings_).resolve(MODEL)


def make_seq(seq_id, prompt, output=(), computed=0, pages=(), params=None, seed=0) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(prompt), params or SamplingParams(temperature=0), seed)
    seq.output_token_ids = list(output)
    seq.num_computed_tokens = computed
    seq.page_ids = list(pages)
    return seq


def test_buckets_are_powers_of_two_up_to_the_budget():
    assert make_config(max_num_batched_tokens=32).token_buckets == (8, 16, 32)
    assert make_config(max_num_batched_tokens=48).token_buckets == (8, 16, 32, 48)
    assert make_config(max_num_batched_tokens=4, max_num_seqs=2).token_buckets == (4,)
    config = make_config(max_num_batched_tokens=48)
    assert [token_bucket(config, n) for n in (1, 8, 9, 16, 17, 33, 48)] == [8, 8, 16, 16, 32, 48, 48]
    with pytest.raises(ValueError, match="exceed the largest bucket 48"):
        token_bucket(config, 49)
    assert config.seq_bucket(8) == 4 and config.seq_bucket(16) == 4
    assert make_config(max_num_seqs=16).seq_bucket(8) == 8


def test_mixed_batch_metadata():
    """A decode, a first prefill chunk and a continued prefill chunk in one step."""
    config = make_config()  # page_size 4, buckets 8/16/32, 4 sequence rows
    # A: 5 prompt + 2 generated tokens, 6 cached: decodes its last token (position 6).
    a = make_seq(0, [11, 12, 13, 14, 15], output=[16, 17], computed=6, pages=[3, 7])
    # B: 10-token prompt, first chunk of 6 tokens (positions 0..5).
    b = make_seq(1, list(range(100, 110)), computed=0, pages=[2, 5])
    # C: 9-token prompt, 4 cached, the remaining 5 (positions 4..8).
    c = make_seq(2, list(range(200, 209)), computed=4, pages=[4, 6, 8])
    batch = build_batch(config, [(a, 1), (b, 6), (c, 5)])

    assert batch.num_tokens == 16 == token_bucket(config, 12), "12 tokens go to the 16 bucket"
    np.testing.assert_array_equal(
        batch.input_ids[:12], [17, 100, 101, 102, 103, 104, 105, 204, 205, 206, 207, 208])
    np.testing.assert_array_equal(batch.metadata.positions[:12], [6, 0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8])
    expected_slots = [
        7 * 4 + 2,  # A pos 6 -> page_ids[1] = 7, offset 2
        2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1,  # B pos 0..5
        6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3, 8 * 4 + 0,  # C pos 4..8
    ]
    np.testing.assert_array_equal(batch.metadata.slot_mapping[:12], expected_slots)
    # Padding tokens write only into the padding page.
    pad = batch.metadata.slot_mapping[12:]
    assert np.all(pad // config.page_size == PADDING_PAGE), pad

    S = config.seq_bucket(16)
    assert batch.metadata.page_table.shape == (S, config.max_pages_per_seq) == (4, 16)
    np.testing.assert_array_equal(batch.metadata.page_table[0, :3], [3, 7, 0])
    np.testing.assert_array_equal(batch.metadata.page_table[1, :3], [2, 5, 0])
    np.testing.assert_array_equal(batch.metadata.page_table[2, :4], [4, 6, 8, 0])
    assert np.all(batch.metadata.page_table[0, 2:] == PADDING_PAGE) and np.all(batch.metadata.page_table[3] == PADDING_PAGE)
    np.testing.assert_array_equal(batch.metadata.kv_lens, [7, 6, 9, 0])
    np.testing.assert_array_equal(batch.metadata.cu_q_lens, [0, 1, 7, 12, 12])
    np.testing.assert_array_equal(batch.metadata.num_seqs, [3])
    np.testing.assert_array_equal(batch.logits_indices[:3], [0, 6, 11])
    for name in ("input_ids", "logits_indices"):
        assert getattr(batch, name).dtype == np.int32, name
    for field in dataclasses.fields(batch.metadata):
        assert getattr(batch.metadata, field.name).dtype == np.int32, field.name


def test_the_kernel_tests_build_their_metadata_as_build_batch_does():
    """kernels/testing.py lays out the kernel tests' cases by hand (no scheduler there); it must
    be the layout the engine sends, or the kernels would be tested on another contract."""
    config = make_config()
    a = make_seq(0, [11, 12, 13, 14, 15], output=[16, 17], computed=6, pages=[3, 7])
    b = make_seq(1, list(range(100, 110)), computed=0, pages=[2, 5])
    c = make_seq(2, list(range(200, 209)), computed=4, pages=[4, 6, 8])
    scheduled = [(a, 1), (b, 6), (c, 5)]
    built = build_batch(config, scheduled).metadata
    by_hand = ragged_metadata([(n, s.num_computed_tokens + n) for s, n in scheduled], built.page_table.copy(),
                              built.kv_lens.copy(), page_size=config.page_size, num_tokens=built.positions.shape[0])
    for field in dataclasses.fields(built):
        np.testing.assert_array_equal(getattr(by_hand, field.name), getattr(built, field.name), err_msg=field.name)


def test_sampling_rows():
    config = make_config()
    greedy = make_seq(0, [5, 6], computed=1, pages=[1])
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                            frequency_penalty=0.25, repetition_penalty=1.3, logprobs=2)
    sampled = make_seq(1, [7, 8, 9], output=[10, 10], computed=4, pages=[2, 3], params=params, seed=2**32 + 5)
    batch = build_batch(config, [(greedy, 1), (sampled, 1)])
    s = batch.sampling
    np.testing.assert_allclose(s.temperature[:2], [0.0, 0.7], rtol=1e-6)
    np.testing.assert_array_equal(s.top_k[:2], [0, 5])
    np.testing.assert_allclose(s.top_p[:2], [1.0, 0.9], rtol=1e-6)
    np.testing.assert_allclose(s.min_p[:2], [0.0, 0.05], rtol=1e-6)
    np.testing.assert_allclose(s.repetition_penalty[:2], [1.0, 1.3], rtol=1e-6)
    np.testing.assert_array_equal(s.seeds[:2], [0, 5])  # seeds are reduced to uint32
    np.testing.assert_array_equal(s.sample_index[:2], [0, 2])
    np.testing.assert_array_equal(s.want_logprobs[:2], [False, True])
    # Padding rows: neutral parameters.
    assert s.temperature[2] == 0 and s.top_p[2] == 1 and s.repetition_penalty[2] == 1
    assert not any(f.name == "history" for f in dataclasses.fields(s)), "penalties read per-slot counts"


def assert_batches_equal(got: Batch, expected: Batch) -> None:
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
        name = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_hand_made_pairs_build_what_the_scheduler_builds():
    """build_batch takes schedule()'s ScheduledBatch (counts already advanced, the sampling
    rows' tokens counted as pending) or hand-made (sequence, n) pairs of sequences whose
    counts were not advanced (ScheduledBatch.of): the two must give the same batch, sampling
    rows included, at each step of a run with decodes, chunked prefills and a join."""
    config = make_config(max_num_batched_tokens=16, max_num_seqs=3)
    sched = Scheduler(config, PageAllocator(40, config.page_size))
    params = SamplingParams(temperature=0.8, top_k=3, repetition_penalty=1.2, logprobs=1, max_tokens=6)
    prompts = {0: [11, 12, 13], 1: list(range(100, 121)), 2: [7, 8, 9, 10, 11]}
    seqs = {i: Sequence(i, f"r{i}", 0, p, params if i == 1 else SamplingParams(temperature=0), seed=i)
            for i, p in prompts.items()}
    sched.add(seqs[0])
    sched.add(seqs[1])
    num_samples = 0
    for step in range(8):
        if step == 2:
            sched.add(seqs[2])  # joins mid-run
        scheduled = sched.schedule()
        assert isinstance(scheduled, ScheduledBatch) and scheduled
        from_scheduler = build_batch(config, scheduled)
        sched.unschedule(scheduled)  # back to the counts a hand-made pair has
        pairs = list(scheduled)
        assert_batches_equal(build_batch(config, pairs), from_scheduler)
        assert_batches_equal(build_batch(config, ScheduledBatch.of(pairs)), from_scheduler)
        redone = sched.schedule()
        assert redone == pairs and redone.starts == scheduled.starts and redone.samples == scheduled.samples
        num_samples += sum(redone.samples)
        sched.postprocess(redone, [40 + step] * len(redone))
    assert num_samples > 3 and len(seqs[2].output_token_ids) > 0


def test_sample_index_of_a_sampling_row_is_its_output_index():
    """The draw of the k-th output token is keyed by k, whether the row comes from schedule()
    (which counts the row's token as pending) or from hand-made pairs."""
    config = make_config()
    sched = Scheduler(config, PageAllocator(20, config.page_size))
    seq = Sequence(0, "r0", 0, [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=8), seed=1)
    sched.add(seq)
    for k in range(4):
        scheduled = sched.schedule()
        assert seq.num_pending == 1 and scheduled.samples == [True]
        assert build_batch(config, scheduled).sampling.sample_index[0] == k
        sched.unschedule(scheduled)
        assert seq.num_pending == 0
        assert build_batch(config, [(seq, scheduled.num_new[0])]).sampling.sample_index[0] == k
        sched.postprocess(sched.schedule(), [9 + k])
    assert seq.output_token_ids == [9, 10, 11, 12]


def test_empty_batch_is_all_padding():
    config = make_config()
    for bucket in config.token_buckets:
        batch = empty_batch(config, bucket)
        assert batch.num_tokens == bucket
        assert batch.metadata.num_seqs[0] == 0
        assert np.all(batch.metadata.slot_mapping // config.page_size == PADDING_PAGE)
        assert np.all(batch.metadata.page_table == PADDING_PAGE) and np.all(batch.metadata.cu_q_lens == 0)


def test_batch_is_a_pytree_of_arrays():
    config = make_config()
    batch = build_batch(config, [(make_seq(0, [1, 2, 3], pages=[1]), 3)])
    leaves = jax.tree.leaves(batch)
    # metadata and the rest, sampling inputs (with the guided rows and bitmask, the biased rows and biases)
    assert len(leaves) == 8 + 15
    assert all(isinstance(x, np.ndarray) for x in leaves)
    rebuilt = jax.tree.unflatten(jax.tree.structure(batch), leaves)
    assert isinstance(rebuilt, Batch)


@st.composite
def scheduled_batches(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 40))
    config = make_config(page_size=page_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_model_len=48, min_token_bucket=draw(st.sampled_from([1, 4, 8])))
    num_seqs = draw(st.integers(0, max_num_seqs))
    next_page, scheduled = 1, []
    remaining = budget
    for i in range(num_seqs):
        if remaining == 0:
            break
        total = draw(st.integers(1, 47))  # tokens the sequence holds (prompt + generated)
        n_prompt = draw(st.integers(1, total))
        computed = draw(st.integers(0, total - 1))
        n_new = draw(st.integers(1, min(total - computed, remaining)))
        remaining -= n_new
        n_pages = -(-(computed + n_new) // page_size)
        pages = list(range(next_page, next_page + n_pages))
        next_page += n_pages
        tokens = draw(st.lists(st.integers(0, 511), min_size=total, max_size=total))
        seq = make_seq(i, tokens[:n_prompt], output=tokens[n_prompt:], computed=computed, pages=pages)
        scheduled.append((seq, n_new))
    return config, scheduled


@settings(max_examples=200, deadline=None)
@given(scheduled_batches())
def test_random_batches(case):
    config, scheduled = case
    batch = build_batch(config, scheduled)
    total = sum(n for _, n in scheduled)
    T = batch.num_tokens
    assert T == token_bucket(config, max(total, 1))
    assert T in config.token_buckets and T >= total
    S = config.seq_bucket(T)
    assert S >= len(scheduled)
    assert batch.metadata.page_table.shape == (S, config.max_pages_per_seq)
    assert batch.metadata.kv_lens.shape == batch.logits_indices.shape == (S,) and batch.metadata.cu_q_lens.shape == (S + 1,)
    assert batch.metadata.num_seqs[0] == len(scheduled)

    ps = config.page_size
    real_slots = batch.metadata.slot_mapping[:total]
    assert len(set(real_slots.tolist())) == total, "two tokens write the same cache slot"
    assert np.all(real_slots // ps != PADDING_PAGE), "a real token writes the padding page"
    assert np.all(batch.metadata.slot_mapping[total:] // ps == PADDING_PAGE), "padding escapes page 0"
    assert np.all(batch.input_ids[total:] == 0) and np.all(batch.metadata.positions[total:] == 0)

    start = 0
    for row, (seq, n_new) in enumerate(scheduled):
        first = seq.num_computed_tokens
        assert batch.metadata.cu_q_lens[row] == start and batch.metadata.cu_q_lens[row + 1] == start + n_new
        np.testing.assert_array_equal(batch.metadata.positions[start:start + n_new], np.arange(first, first + n_new))
        np.testing.assert_array_equal(batch.input_ids[start:start + n_new], seq.tokens(first, first + n_new))
        for i, pos in enumerate(range(first, first + n_new)):
            assert batch.metadata.slot_mapping[start + i] == seq.page_ids[pos // ps] * ps + pos % ps
        assert batch.metadata.kv_lens[row] == first + n_new
        assert batch.logits_indices[row] == start + n_new - 1
        np.testing.assert_array_equal(batch.metadata.page_table[row, :len(seq.page_ids)], seq.page_ids)
        assert np.all(batch.metadata.page_table[row, len(seq.page_ids):] == PADDING_PAGE)
        start += n_new
    # Rows past the real sequences are empty and point at nothing but the padding page.
    assert np.all(batch.metadata.cu_q_lens[len(scheduled):] == total)
    assert np.all(batch.metadata.kv_lens[len(scheduled):] == 0)
    assert np.all(batch.metadata.page_table[len(scheduled):] == PADDING_PAGE)
