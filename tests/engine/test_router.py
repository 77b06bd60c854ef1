"""The data-parallel router (orca_jax/engine/router.py): least loaded, unless a replica that was
sent the prompt's prefix is within the slack."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from orca_jax.core.prefix_cache import hash_page
from orca_jax.engine.router import PrefixAffinityRouter, default_slack

PAGE = 4


def router(n=3, slack=2, capacity=1000) -> PrefixAffinityRouter:
    return PrefixAffinityRouter(n, PAGE, slack=slack, capacity=capacity)


def sent(r: PrefixAffinityRouter, prompt, loads):
    """Route a request and record that its replica took it, as the server does."""
    route = r.route(prompt, loads)
    r.record(route)
    return route


def test_without_a_shared_prefix_the_least_loaded_replica_takes_it():
    r = router()
    assert sent(r, list(range(10)), [3, 1, 2]).replica == 1
    assert sent(r, list(range(100, 110)), [0, 5, 0]).reason == "least_loaded"


def test_equal_loads_rotate_so_a_burst_spreads():
    r = router(n=3)
    loads = [0, 0, 0]
    chosen = []
    for i in range(6):
        replica = sent(r, [1000 + i] * 9, loads).replica  # distinct prompts: no affinity
        loads[replica] += 1
        chosen.append(replica)
    assert sorted(chosen) == [0, 0, 1, 1, 2, 2] and loads == [2, 2, 2]


def test_a_prefix_goes_back_to_its_replica_while_loads_are_close():
    r = router(slack=2)
    prefix = list(range(12))  # 3 full pages
    first = sent(r, prefix + [50], [0, 0, 0])
    loads = [0, 0, 0]
    loads[first.replica] = 2  # within the slack
    again = sent(r, prefix + [60, 61], loads)
    assert again.replica == first.replica and again.reason == "prefix" and again.matched_pages == 3
    loads = [0, 0, 0]
    loads[first.replica] = 3  # past the slack: balance wins
    away = sent(r, prefix + [70], loads)
    assert away.replica != first.replica and away.reason == "least_loaded"


def test_the_longest_matching_prefix_wins():
    r = router(slack=10)
    base = list(range(8))
    a = sent(r, base + [90, 91, 92, 93], [0, 0, 0]).replica  # pages: base[0:4], base[4:8], [90..93]
    b = sent(r, base + [80, 81, 82, 83], [0 if i != a else 1 for i in range(3)]).replica  # 2 pages with a
    assert sent(r, base + [80, 81, 82, 83, 1], [0, 0, 0]).replica == b
    assert sent(r, base + [90, 91, 92, 93, 1], [0, 0, 0]).replica == a


def test_only_what_a_replica_took_is_remembered_and_reset_forgets_it():
    r = router(slack=10)
    prefix = list(range(8))
    refused = r.route(prefix, [0, 0, 0])  # say its replica's queue was full: not recorded
    assert r.route(prefix, [0, 0, 0]).matched_pages == 0
    r.record(refused, replica=2)  # another replica took it instead
    again = r.route(prefix + [9], [0, 0, 0])
    assert (again.replica, again.reason, again.matched_pages) == (2, "prefix", 2)
    r.reset()
    assert r.route(prefix, [0, 0, 0]).matched_pages == 0


def test_salts_and_partial_pages_do_not_match():
    r = router(slack=10)
    prefix = list(range(8))
    first = sent(r, {"prompt_token_ids": prefix, "cache_salt": "tenant-a"}, [0, 0, 0])
    other = sent(r, {"prompt_token_ids": prefix, "cache_salt": "tenant-b"}, [0, 0, 0])
    assert other.reason == "least_loaded" and other.replica != first.replica
    assert sent(r, prefix[:3], [0, 0, 0]).matched_pages == 0  # less than a page: nothing to share


def test_token_prompts_hash_like_the_engines_prefix_cache():
    r = router()
    tokens = list(range(9))
    first = hash_page(None, tokens[:4])
    assert r.page_hashes(tokens) == [first, hash_page(first, tokens[4:8])]
    assert len(r.page_hashes("x" * (4 * PAGE * 2 + 3))) == 2  # text: blocks of 4 characters a token


def test_a_malformed_prompt_routes_without_affinity_and_is_left_to_the_engine():
    r = router()
    assert r.page_hashes({"bogus": 1}) == [] and r.page_hashes([1.5, "a"]) == []
    assert sent(r, {"bogus": 1}, [1, 0, 1]).replica == 1


def test_the_record_forgets_the_least_recently_routed_pages():
    r = router(n=2, slack=5, capacity=3)
    sent(r, list(range(8)), [0, 0])  # 2 pages
    sent(r, list(range(100, 108)), [0, 0])  # 2 more: the oldest page is dropped
    assert len(r._holders) == 3
    assert sent(r, list(range(8)), [0, 0]).matched_pages == 0  # its first page is gone


@settings(max_examples=60, deadline=None)
@given(loads=st.lists(st.integers(0, 20), min_size=2, max_size=5), slack=st.integers(0, 4),
       prompt=st.lists(st.integers(0, 7), min_size=0, max_size=20))
def test_never_further_than_the_slack_from_the_least_loaded(loads, slack, prompt):
    r = PrefixAffinityRouter(len(loads), 2, slack=slack)
    for replica in range(len(loads)):  # every replica holds some prefix of the prompt
        r._remember(r.page_hashes(prompt[: 2 * (replica + 1)]), replica)
    route = r.route(prompt, loads)
    assert loads[route.replica] - min(loads) <= slack
    if route.reason == "least_loaded":
        assert loads[route.replica] == min(loads)


def test_bad_settings_and_load_counts_are_refused():
    with pytest.raises(ValueError):
        PrefixAffinityRouter(0, 16, slack=1)
    with pytest.raises(ValueError, match="2 loads for 3 replicas"):
        router().route([1, 2], [0, 0])
    assert default_slack(32) == 8 and default_slack(2) == 1
