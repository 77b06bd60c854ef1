"""Speculation: who proposes before a step, and the two backoffs (per sequence, and the
engine's return to overlapped steps when proposing does not pay). Host only."""

from __future__ import annotations

from orca_jax.core.sampling_params import SamplingParams
from orca_jax.core.sequence import Sequence, SequenceStatus
from orca_jax.config.speculative import SpeculativeConfig
from orca_jax.spec_decode.proposing import NgramSequenceProposer, Speculation, can_speculate

CONFIG = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1,
                           backoff_after=2, backoff_steps=4)


class Recorder:
    """A proposer that offers `drafts` to everyone and remembers whom it was asked for."""

    def __init__(self, drafts=(7, 8, 9)):
        self.drafts, self.asked = list(drafts), []

    def propose(self, seqs, limits):
        self.asked.append([(s.seq_id, limit) for s, limit in zip(seqs, limits)])
        return [self.drafts[:limit] for limit in limits]


def decoding(seq_id: int, params: SamplingParams | None = None, prompt=(1, 2, 3), outputs=(4,)) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(prompt), params or SamplingParams(max_tokens=10), seed=0)
    seq.output_token_ids = list(outputs)
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.status = SequenceStatus.RUNNING
    return seq


def max_len(seq):
    return seq.num_prompt_tokens + seq.params.max_tokens


def test_only_plain_decoding_sequences_propose_within_their_length_limit():
    proposer = Recorder()
    spec = Speculation(CONFIG, proposer)
    plain, near_end = decoding(0), decoding(1, SamplingParams(max_tokens=3), outputs=(4,))
    penalised = decoding(2, SamplingParams(max_tokens=10, repetition_penalty=1.2))
    prefilling = decoding(3)
    prefilling.num_computed_tokens = 1
    pending = decoding(4)
    pending.num_pending = 1
    assert not can_speculate(penalised)
    assert spec.propose([plain, near_end, penalised, prefilling, pending], max_len) == 2
    # near_end: prompt 3 + max_tokens 3 = 6, it holds 4 tokens: one draft, then its own token.
    assert proposer.asked == [[(0, 3), (1, 1)]]
    assert plain.draft_token_ids == [7, 8, 9] and near_end.draft_token_ids == [7]
    assert penalised.draft_token_ids == prefilling.draft_token_ids == pending.draft_token_ids == []


def test_a_sequence_whose_proposals_fail_skips_them_for_a_while_and_longer_each_time():
    spec = Speculation(CONFIG, Recorder())
    seq = decoding(0)
    spec.record([(seq, 3, 0)], 1)
    assert seq.skip_proposals == 0  # one failure: not yet
    spec.record([(seq, 3, 0)], 1)
    assert seq.skip_proposals == 4
    for _ in range(4):
        spec.propose([seq], max_len)
        assert seq.draft_token_ids == []
    spec.propose([seq], max_len)
    assert seq.draft_token_ids == [7, 8, 9]
    spec.record([(seq, 3, 0)], 1)
    assert seq.skip_proposals == 8  # doubled
    spec.record([(seq, 3, 2)], 1)
    assert seq.num_failed_proposals == 0


def test_the_engine_overlaps_steps_again_while_proposing_does_not_pay():
    spec = Speculation(CONFIG, Recorder(), overlap_allowed=True)
    seqs = [decoding(i) for i in range(10)]
    for _ in range(2):  # two proposing steps gaining nothing
        assert spec.proposing
        spec.propose(seqs, max_len)
        spec.record([(s, 3, 0) for s in seqs], 10)
    assert not spec.proposing and spec.overlap_steps_left == 4
    for _ in range(4):  # overlapped steps count down (no proposal before them)
        spec.record([], 10)
    assert spec.proposing
    for _ in range(2):  # every sequence still backs off on its own: no proposal, no gain
        spec.propose(seqs, max_len)
        assert all(not s.draft_token_ids for s in seqs)
        spec.record([], 10)
    assert spec.overlap_steps_left == 8  # doubled
    for _ in range(8):
        spec.record([], 10)
    # A step that gains at least a tenth of its rows resets the span.
    spec.propose(seqs, max_len)
    spec.record([(seqs[0], 3, 1)], 10)
    assert spec.proposing and spec._overlap_span == CONFIG.backoff_steps


def test_steps_with_only_prefills_do_not_count_against_speculation():
    spec = Speculation(CONFIG, Recorder(), overlap_allowed=True)
    prefilling = decoding(0)
    prefilling.num_computed_tokens = 0
    for _ in range(5):
        spec.propose([prefilling], max_len)
        spec.record([], 1)
    assert spec.proposing


def test_without_async_scheduling_the_engine_never_stops_proposing():
    spec = Speculation(CONFIG, Recorder(), overlap_allowed=False)
    seqs = [decoding(i) for i in range(4)]
    for _ in range(10):
        spec.propose(seqs, max_len)
        spec.record([], 4)
    assert spec.proposing


def test_ngram_histories_follow_appended_tokens_and_are_dropped_when_finished():
    proposer = NgramSequenceProposer(CONFIG)
    seq = decoding(0, prompt=(5, 6, 7, 5, 6), outputs=())
    seq.num_computed_tokens = 4
    assert proposer.propose([seq], [3]) == [[7, 5, 6]]
    seq.output_token_ids += [9, 5]
    # "9 5" never occurred before; "5" did, most recently followed by 6 9 5.
    assert proposer.propose([seq], [3]) == [[6, 9, 5]]
    assert list(proposer._histories[0][1][:seq.num_tokens]) == seq.prompt_token_ids + seq.output_token_ids
    seq.status = SequenceStatus.FINISHED
    proposer.release_finished()
    assert not proposer._histories


def test_no_proposals_above_disable_by_batch_size():
    config = SpeculativeConfig("ngram", disable_by_batch_size=2)
    spec = Speculation(config, Recorder(), overlap_allowed=True)
    assert spec.proposes_for(1) and spec.proposes_for(2) and not spec.proposes_for(3)
    spec.record([], 3)  # an overlapped step (nothing proposed before it) changes nothing
    assert spec.proposes_for(2)
