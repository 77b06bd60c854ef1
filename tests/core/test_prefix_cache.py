"""Prefix caching: the page hashes (orca_jax/core/prefix_cache.py), and the engine on the tiny random
Llama giving, with caching on, token for token the outputs it gives with caching off (greedy
and seeded) while computing fewer prompt tokens: many requests on one long prefix, prefixes
ending mid-page, a prompt that is exactly a cached prefix, n = 4, a multi-turn chat, a tiny
pool that preempts and evicts, a failed step, and no compiles after warm-up; requests with
different cache salts (vLLM's cache_salt) never share a page, requests with the same one do.

The allocator's reference counts and eviction are tested in tests/core/test_kv_cache.py, the
scheduler's admission and publishing (with a fake KV cache that checks every read) in
tests/core/test_scheduler.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from orca_jax import SamplingParams
from orca_jax.worker.compile_guard import compile_count, no_compiles
from orca_jax.errors import RequestError
from orca_jax.core.prefix_cache import extend_page_hashes, hash_page


# ---- hashes --------------------------------------------------------------------------------
def test_a_page_hash_covers_its_tokens_its_parent_and_the_salt():
    root = hash_page(None, [1, 2, 3, 4])
    assert root == hash_page(None, [1, 2, 3, 4]) and len(root) == 16
    assert root != hash_page(None, [1, 2, 3, 5]), "a token differs"
    assert root != hash_page(None, [1, 2, 3, 4], salt="tenant-a"), "the salt keys the first page"
    assert hash_page(None, [1], salt="a") != hash_page(None, [1], salt="b")
    child = hash_page(root, [5, 6, 7, 8])
    assert child != hash_page(hash_page(None, [0, 2, 3, 4]), [5, 6, 7, 8]), "the parent keys the page"
    assert child != hash_page(None, [5, 6, 7, 8]), "a first page never equals a later one"
    # Token ids past 32 bits are not folded onto small ones.
    assert hash_page(None, [2**32 + 1]) != hash_page(None, [1])


def test_extending_page_hashes_is_incremental_and_counts_full_pages_only():
    tokens = list(range(100, 123))  # 23 tokens: 5 full pages of 4, 3 left over

    def slice_(start, stop):
        return tokens[start:stop]

    hashes = extend_page_hashes([], slice_, 10, 4)
    assert len(hashes) == 2, "10 tokens fill two pages"
    first_two = list(hashes)
    extend_page_hashes(hashes, slice_, 23, 4)
    assert len(hashes) == 5 and hashes[:2] == first_two
    assert hashes == extend_page_hashes([], slice_, 23, 4), "in steps or at once, the same chain"
    expected, parent = [], None
    for i in range(5):
        parent = hash_page(parent, tokens[4 * i:4 * i + 4])
        expected.append(parent)
    assert hashes == expected


# ---- the engine, caching on against off ------------------------------------------------------
SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=32, page_size=8, num_pages=64, max_model_len=256)


@pytest.fixture(scope="module")
def engines(tiny_engine_factory):
    return {on: tiny_engine_factory(enable_prefix_caching=on, **SETTINGS) for on in (True, False)}


@pytest.fixture(scope="module")
def tiny_pool_engines(tiny_engine_factory):
    """14 usable pages of 8 tokens: a few long prompts preempt one another, and cached pages
    nobody holds are evicted to make room."""
    settings = dict(SETTINGS, num_pages=15, max_model_len=112)
    return {on: tiny_engine_factory(enable_prefix_caching=on, **settings) for on in (True, False)}


class ScheduledTokens:
    """Counts the tokens the engine's steps compute (wraps scheduler.schedule)."""

    def __init__(self, engine):
        self.real = engine.scheduler.schedule
        self.total = 0
        engine.scheduler.schedule = self

    def __call__(self):
        scheduled = self.real()
        self.total += scheduled.num_tokens
        return scheduled


def run(engine, requests, max_steps: int = 5000, cache_salt: str | None = None) -> tuple[dict, int]:
    """All requests to the end, in one batch (added before the first step, salted with
    `cache_salt`). Returns per request (its samples' token ids, finish reasons,
    num_cached_tokens) and the tokens computed; checks that the engine is idle with no page
    held afterwards."""
    counter = ScheduledTokens(engine)
    try:
        engine.add_requests(requests, cache_salt=cache_salt)
        final = {}
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        else:
            raise AssertionError("engine did not finish")
    finally:
        engine.scheduler.schedule = counter.real
    assert set(final) == {r[0] for r in requests}
    assert all(out.error is None for out in final.values())
    assert engine.allocator.num_used == 0 and engine.num_free_pages == engine.allocator.num_usable, "pages held"
    results = {rid: ([c.token_ids for c in out.outputs], [c.finish_reason for c in out.outputs],
                     out.num_cached_tokens) for rid, out in final.items()}
    return results, counter.total


def same_outputs(on: dict, off: dict) -> None:
    assert on.keys() == off.keys()
    for rid in on:
        assert on[rid][:2] == off[rid][:2], f"{rid}: caching changed the tokens"


def run_both(engines, requests) -> tuple[dict, int, dict, int]:
    """The same requests on the caching engine (its cache emptied first) and the other one."""
    engines[True].reset_prefix_cache()
    on, computed_on = run(engines[True], requests)
    off, computed_off = run(engines[False], requests)
    same_outputs(on, off)
    assert all(cached in (0, None) for _, _, cached in off.values()), "hits with caching off"
    return on, computed_on, off, computed_off


def greedy(max_tokens=8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def random_tokens(rng, n: int) -> list[int]:
    return rng.integers(3, 434, size=n).tolist()


def test_requests_sharing_a_long_prefix(engines):
    """A 100-token prefix (12.5 pages: it ends mid-page) and tails of 1-20 tokens, greedy and
    seeded: the same tokens, and the prefix is computed about once."""
    rng = np.random.default_rng(0)
    prefix = random_tokens(rng, 100)
    tails = [1, 3, 8, 12, 20, 5]
    requests = [(f"r{i}", prefix + random_tokens(rng, n),
                 greedy(6) if i % 2 else SamplingParams(max_tokens=6, temperature=0.9, seed=i, ignore_eos=True))
                for i, n in enumerate(tails)]
    # Arrival order is admission order: the first request computes the prefix while the
    # others wait for the token budget, then each finds its 12 full pages.
    on, computed_on, off, computed_off = run_both(engines, requests)
    prompt_tokens = sum(len(p) for _, p, _ in requests)
    assert computed_off == prompt_tokens + sum(6 - 1 for _ in requests), "off computes every prompt token"
    assert on["r0"][2] == 0
    assert [on[f"r{i}"][2] for i in range(1, len(tails))] == [96] * (len(tails) - 1), "12 full pages each"
    assert computed_on == computed_off - 96 * (len(tails) - 1)


def test_a_prompt_that_is_exactly_a_cached_prefix(engines):
    """A prompt of whole pages that is all cached still computes its last page (its last
    token's logits are needed to sample, and a shared page is never written); a prompt that
    repeats a cached prompt ending mid-page takes its full pages and computes the rest."""
    rng = np.random.default_rng(1)
    aligned, ragged = random_tokens(rng, 64), random_tokens(rng, 45)
    first = [("aligned-1", aligned, greedy(5)), ("ragged-1", ragged, greedy(5))]
    again = [("aligned-2", aligned, greedy(5)), ("ragged-2", ragged, greedy(5)),
             ("aligned-prefix", aligned[:40], greedy(5))]
    engines[True].reset_prefix_cache()
    on_first, _ = run(engines[True], first)
    on_again, computed = run(engines[True], again)
    off_first, _ = run(engines[False], first)
    off_again, _ = run(engines[False], again)
    same_outputs(on_first, off_first)
    same_outputs(on_again, off_again)
    assert on_again["aligned-2"][2] == 56, "7 of 8 pages: the last one is recomputed"
    assert on_again["ragged-2"][2] == 40
    assert on_again["aligned-prefix"][2] == 32, "a 40-token prompt ends a page: the last is computed"
    assert computed == (64 - 56) + (45 - 40) + (40 - 32) + 3 * 4


def test_n4_samples_prefill_once(engines):
    """n = 4 seeded samples of one prompt share its pages: the prompt is computed about once,
    not four times, and the samples are those of the uncached run."""
    rng = np.random.default_rng(2)
    prompt = random_tokens(rng, 30)  # fits one step's budget beside nothing else
    requests = [("n4", prompt, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True))]
    on, computed_on, off, computed_off = run_both(engines, requests)
    assert len(set(map(tuple, on["n4"][0]))) > 1, "the four samples differ"
    assert computed_off == 4 * 30 + 4 * 5
    # The first sample computes all 30; each other takes 3 full pages (24 tokens) and computes 6.
    assert computed_on == 30 + 3 * 6 + 4 * 5


def test_a_multi_turn_chat_reuses_its_history(engines):
    """Turn 2 resends turn 1's prompt and answer: it finds the pages of both."""
    rng = np.random.default_rng(3)
    turn1 = random_tokens(rng, 37)
    engines[True].reset_prefix_cache()
    results = {}
    for on in (True, False):
        first, _ = run(engines[on], [("turn-1", turn1, greedy(20))])
        answer = first["turn-1"][0][0]
        turn2 = turn1 + answer + random_tokens(np.random.default_rng(4), 9)
        second, computed = run(engines[on], [("turn-2", turn2, greedy(6))])
        results[on] = (first, second, computed, turn2)
    same_outputs(results[True][0], results[False][0])
    same_outputs(results[True][1], results[False][1])
    cached = results[True][1]["turn-2"][2]
    # 37 prompt + 19 computed answer tokens = 56 tokens in the cache: 7 full pages. The last
    # full page's tokens are published only once they are known on the host, which, with
    # overlapped steps, may be one step after they were computed; at least 6 pages are found.
    assert cached >= 48 and cached % 8 == 0, cached
    assert results[True][2] == len(results[True][3]) - cached + 5


def test_tiny_pool_with_preemption_and_eviction(tiny_pool_engines):
    """Long prompts on 14 pages: sequences preempt one another and cached pages are evicted to
    make room, and still every output equals the uncached run's."""
    rng = np.random.default_rng(5)
    shared = random_tokens(rng, 40)
    requests = [(f"p{i}", (shared if i % 2 else random_tokens(rng, 40)) + random_tokens(rng, 10 + 3 * i),
                 greedy(24) if i % 3 else SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True))
                for i in range(6)]
    engine = tiny_pool_engines[True]
    preemptions, evictions = engine.scheduler.num_preemptions, engine.allocator.num_evictions
    on, _, off, _ = run_both(tiny_pool_engines, requests)
    assert engine.scheduler.num_preemptions > preemptions, "the pool never ran short"
    assert engine.allocator.num_evictions > evictions, "no cached page was evicted"
    assert any(cached for _, _, cached in on.values()), "nothing was found in the cache"


def test_penalised_requests_do_not_take_a_cached_prefix(engines):
    """Penalties count the tokens a step feeds, and a cached prefix is not fed: such a request
    computes its whole prompt (and gives the uncached tokens), though it may publish pages."""
    rng = np.random.default_rng(6)
    prompt = random_tokens(rng, 33)
    penalised = SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.5, presence_penalty=0.5,
                               ignore_eos=True)
    requests = [("plain", prompt, greedy(4))]
    engines[True].reset_prefix_cache()
    run(engines[True], requests)
    on, _ = run(engines[True], [("penalised", prompt, penalised)])
    off, _ = run(engines[False], [("penalised", prompt, penalised)])
    same_outputs(on, off)
    assert on["penalised"][2] == 0


def test_a_failed_step_publishes_nothing(engines, monkeypatch):
    """The pages a failed step was to fill are not found by a later request with the same
    prompt, which runs as if nothing had happened."""
    engine = engines[True]
    engine.reset_prefix_cache()
    rng = np.random.default_rng(7)
    prompt = random_tokens(rng, 30)
    expected, _ = run(engines[False], [("ok", prompt, greedy(6))])
    real = engine.runner.dispatch
    calls = []

    def fail_first(scheduled):
        calls.append(len(scheduled.published))
        if len(calls) == 1:
            raise RuntimeError("injected device failure")
        return real(scheduled)

    monkeypatch.setattr(engine.runner, "dispatch", fail_first)
    engine.add_request("doomed", prompt, greedy(6))
    outs = {o.request_id: o for o in engine.step()}
    assert outs["doomed"].error and "injected" in outs["doomed"].error
    assert calls[0] == 3, "the failed step had published the prompt's 3 full pages"
    assert engine.allocator.num_cached == 0, "its publications were taken back"
    after, _ = run(engine, [("ok", prompt, greedy(6))])
    assert after["ok"][2] == 0, "a page of the failed step was found"
    same_outputs(after, expected)


def test_no_compiles_with_prefix_caching(engines):
    """Warm-up covers every program: cache hits change only the inputs' values."""
    engine = engines[True]
    rng = np.random.default_rng(8)
    prefix = random_tokens(rng, 70)
    requests = [(f"c{i}", prefix + random_tokens(rng, 2 + 5 * i),
                 SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True,
                                logprobs=2 if i == 1 else None))
                for i in range(5)]
    requests.append(("n3", prefix, SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=3, ignore_eos=True)))
    engine.reset_prefix_cache()
    compile_count()
    with no_compiles("prefix-cached serving"):
        on, _ = run(engine, requests)
    assert sum(cached or 0 for _, _, cached in on.values()) >= 4 * 64


def test_reset_prefix_cache_forgets_everything(engines):
    engine = engines[True]
    rng = np.random.default_rng(9)
    prompt = random_tokens(rng, 50)
    run(engine, [("a", prompt, greedy(3))])
    assert engine.allocator.num_cached > 0
    assert engine.reset_prefix_cache() is True
    assert engine.allocator.num_cached == 0 and engine.num_free_pages == engine.allocator.num_usable
    again, _ = run(engine, [("b", prompt, greedy(3))])
    assert again["b"][2] == 0


# ---- cache salts -----------------------------------------------------------------------------
def test_requests_share_cached_pages_only_under_the_same_salt(engines):
    """One 64-token prompt under no salt, salt "a" (given in a prompt dict) and salt "b" (given
    to add_requests): each computes the whole prompt, while the cache holds the others' pages,
    since a salt keys every page; each finds its own pages again, 7 of 8 (the last is always
    computed), with the tokens of the uncached run. Two salts in one batch share nothing
    either."""
    engine = engines[True]
    engine.reset_prefix_cache()
    prompt = random_tokens(np.random.default_rng(10), 64)
    expected, _ = run(engines[False], [("x", prompt, greedy(4))])
    tokens = expected["x"][0]

    def cached(request_id, prompt_form, salt=None) -> int:
        before = engine.scheduler.prefix_cache_hits
        result, _ = run(engine, [(request_id, prompt_form, greedy(4))], cache_salt=salt)
        assert result[request_id][0] == tokens, f"{request_id}: the salt changed the tokens"
        assert engine.scheduler.prefix_cache_hits - before == result[request_id][2]
        return result[request_id][2]

    assert cached("plain", prompt) == 0
    assert cached("salt-a", {"prompt_token_ids": prompt, "cache_salt": "a"}) == 0, "salt a took unsalted pages"
    assert cached("salt-b", prompt, salt="b") == 0, "salt b took pages of another salt"
    assert engine.allocator.num_cached >= 3 * 8, "each salt published its own pages"
    assert cached("salt-a-again", {"prompt_token_ids": prompt, "cache_salt": "a"}) == 56
    assert cached("salt-b-again", {"prompt_token_ids": prompt}, salt="b") == 56
    assert cached("plain-again", prompt) == 56
    # In one batch: the second of two salts admitted finds nothing of the first's.
    fresh = random_tokens(np.random.default_rng(11), 64)
    together, _ = run(engine, [("c", {"prompt_token_ids": fresh, "cache_salt": "c"}, greedy(4)),
                               ("d", {"prompt_token_ids": fresh, "cache_salt": "d"}, greedy(4))])
    assert together["c"][2] == together["d"][2] == 0 and together["c"][:2] == together["d"][:2]


@pytest.mark.parametrize("prompt,kwargs,param,match", [
    ([5] * 20, dict(cache_salt=""), "cache_salt", "non-empty string"),
    ([5] * 20, dict(cache_salt=7), "cache_salt", "non-empty string"),
    ({"prompt_token_ids": [5] * 20, "cache_salt": ""}, {}, "cache_salt", "non-empty string"),
    ({"prompt_token_ids": [5] * 20, "cache_salt": ["a"]}, {}, "cache_salt", "non-empty string"),
    ({"prompt_token_ids": [5] * 20, "cache_salt": "\ud800"}, {}, "cache_salt", "Unicode"),
    ({"prompt_token_ids": [5] * 20, "cache_salt": "a"}, dict(cache_salt="b"), "cache_salt", "given twice"),
    ({"prompt": "hello", "multi_modal_data": {}}, {}, "prompt", "'multi_modal_data'"),
    ({"prompt": "hello", "prompt_token_ids": [5]}, {}, "prompt", "exactly one"),
    ({"cache_salt": "a"}, {}, "prompt", "exactly one"),
    ({"prompt": [5, 6]}, {}, "prompt", "'prompt_token_ids'"),
    ({"prompt_token_ids": "hello"}, {}, "prompt", "text goes in 'prompt'"),
])
def test_bad_salts_and_prompt_dicts_are_refused_naming_the_field(engines, prompt, kwargs, param, match):
    engine = engines[True]
    with pytest.raises(RequestError, match=match) as info:
        engine.add_request("bad", prompt, greedy(2), **kwargs)
    assert info.value.param == param
    assert not engine.requests and not engine.has_unfinished_requests()
