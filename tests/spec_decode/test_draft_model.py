"""The draft-model proposer: a second runner with its own KV pool, slots and buckets.

With the target as its own draft every proposal is the target's greedy continuation, so every
draft is accepted; with another (random) model few are. Either way greedy outputs equal those
without speculation, through chunked catch-up of long prompts, preemption and aborts, and the
draft side's pages and slots all come back.
"""

from __future__ import annotations

import pytest

from orca_jax import SamplingParams
from orca_jax.worker.compile_guard import no_compiles

# One small pool for every engine (the workloads preempt), and no prefix caching: then the draft
# runners' step programs are the spec-off engine's, and compile once (the compilation cache).
SETTINGS = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, max_model_len=192, num_pages=20,
                enable_prefix_caching=False)


def greedy(max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def run(run_engine):
    """Run requests to the end: per request id, (token ids, finish reason) per sample."""
    def run_reduced(engine, requests, abort_at=None):
        final = run_engine(engine, requests, abort_at)
        return {rid: [(c.token_ids, c.finish_reason) for c in out.outputs] for rid, out in final.items()}
    return run_reduced


def assert_all_returned(engine) -> None:
    assert engine.allocator.num_free == engine.allocator.num_usable
    draft = engine.speculation.proposer
    assert not draft.shadows
    assert draft.allocator.num_free == draft.allocator.num_usable
    assert draft.slots.num_free == engine.config.max_num_seqs


# Long prompts (more than the 32-token budget) make the draft side catch up in chunks.
WORKLOAD = [
    ("short", [5, 17, 33, 5, 17, 99], greedy()),
    ("long", list(range(3, 80)), greedy(20)),
    ("n2", [7, 8, 9, 7, 8], greedy(16, n=2)),
    ("sampled", [11, 12, 13], SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True)),
]


@pytest.fixture(scope="module")
def engines(tiny_engine_factory, tiny_llama_factory):
    other = tiny_llama_factory(seed=7)
    return {
        "off": tiny_engine_factory(**SETTINGS),
        "self": tiny_engine_factory(**SETTINGS,
                                    speculative_config={"method": "draft_model", "num_speculative_tokens": 3}),
        "other": tiny_engine_factory(**SETTINGS, speculative_config={
            "method": "draft_model", "num_speculative_tokens": 4, "model": str(other)}),
    }


def test_the_target_as_its_own_draft_is_accepted_whole(engines, run):
    before = engines["self"].scheduler.num_draft_tokens
    greedy_only = [r for r in WORKLOAD if r[2].temperature == 0]
    assert run(engines["self"], greedy_only) == run(engines["off"], greedy_only)
    scheduler = engines["self"].scheduler
    assert scheduler.num_draft_tokens > before
    # Same weights, same greedy rule: only float differences between batch shapes could
    # reject a draft.
    assert scheduler.num_accepted_tokens >= 0.95 * scheduler.num_draft_tokens
    assert_all_returned(engines["self"])


def test_another_model_gives_the_same_greedy_tokens(engines, run):
    engine = engines["other"]
    drafted, accepted = engine.scheduler.num_draft_tokens, engine.scheduler.num_accepted_tokens
    greedy_only = [r for r in WORKLOAD if r[2].temperature == 0]
    assert run(engine, greedy_only) == run(engines["off"], greedy_only)
    assert engine.scheduler.num_draft_tokens > drafted
    assert engine.scheduler.num_accepted_tokens - accepted < engine.scheduler.num_draft_tokens - drafted
    assert_all_returned(engine)


def test_seeded_sampling_is_reproducible_and_aborts_return_everything(engines, run):
    engine = engines["other"]
    first = run(engine, WORKLOAD)
    assert run(engine, WORKLOAD) == first
    solo = first["long"][0][0]
    aborted = run(engine, WORKLOAD, abort_at={"long": 4})
    assert aborted["long"][0][1] == "abort" and aborted["long"][0][0] == solo[:len(aborted["long"][0][0])]
    assert_all_returned(engine)


def test_a_pool_that_preempts_keeps_greedy_parity(engines, run):
    spec = engines["self"]
    preempted = spec.scheduler.num_preemptions
    requests = [(f"p{i}", [3 + i, 40, 41, 3 + i, 40] * 4, greedy(40)) for i in range(4)]
    assert run(spec, requests) == run(engines["off"], requests)
    assert spec.scheduler.num_preemptions > preempted and spec.scheduler.num_accepted_tokens > 0
    assert_all_returned(spec)


def test_no_compiles_after_warmup(engines, run):
    with no_compiles("draft-model speculative decoding"):
        run(engines["self"], WORKLOAD)


def test_a_target_that_took_its_first_draft_without_verifying_still_gets_a_proposal(engines):
    """The target decoded one token on its own (drafts cut by the budget, or an overlapped
    step), and it was the first draft the shadow had fed: the shadow's cache then covers every
    token, yet its last token is fed again, since its logits give the next draft."""
    from orca_jax.core.sequence import Sequence, SequenceStatus

    proposer = engines["self"].speculation.proposer
    target = Sequence(10_000, "direct", 0, [5, 17, 33, 5, 17], greedy(), seed=0)
    target.status = SequenceStatus.RUNNING
    first = proposer.propose([target], [3])[0]
    assert len(first) == 3
    target.output_token_ids.append(first[0])
    second = proposer.propose([target], [3])[0]
    # The target as its own draft: the continuation goes on where the first proposal did.
    assert second[:2] == first[1:]
    target.status = SequenceStatus.FINISHED
    proposer.release_finished()
    assert not proposer.shadows and proposer.allocator.num_free == proposer.allocator.num_usable


# Seeded requests whose sampling is truncated to 2-3 tokens, so that a greedy draft equals the
# sampled token about half the time (accepted) and differs otherwise (rejected).
SEEDED = [
    ("top-p", [5, 17, 33, 5, 17, 99], SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=2, seed=1234,
                                                     ignore_eos=True)),
    ("top-k-long", list(range(3, 80)), SamplingParams(max_tokens=20, temperature=1.0, top_k=2, seed=7,
                                                      ignore_eos=True)),
    ("n2", [7, 8, 9, 7, 8], SamplingParams(max_tokens=16, n=2, temperature=0.7, top_k=3, seed=21, ignore_eos=True)),
]


@pytest.mark.parametrize("name", ["self", "other"])
def test_seeded_outputs_are_identical_to_no_speculation(engines, run, name):
    """Coupled acceptance (worker/rejection.py): every position draws the plain sampler's
    token with the same seed and output index, so seeded requests give exactly the tokens of
    the engine without speculation, whichever drafts were accepted. With the target as its
    own draft about half are (a rejected draft is a sampled token other than the argmax);
    the other model's drafts are mostly rejected."""
    engine = engines[name]
    drafted, accepted = engine.scheduler.num_draft_tokens, engine.scheduler.num_accepted_tokens
    assert run(engine, SEEDED) == run(engines["off"], SEEDED)
    drafted = engine.scheduler.num_draft_tokens - drafted
    accepted = engine.scheduler.num_accepted_tokens - accepted
    assert drafted > 0 and accepted < drafted, (drafted, accepted)
    if name == "self":
        assert accepted > 0, "no draft accepted: the test proves nothing"
    assert_all_returned(engine)
