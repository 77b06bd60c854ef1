"""PageAllocator (reference-counted pages, published pages cached and evicted least recently
released first; page 0 is the padding sink) and device cache sizing."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.core.prefix_cache import hash_page
from orca_jax.core.kv_cache import (
    PADDING_PAGE,
    PageAllocator,
    choose_num_pages,
    create_kv_cache,
    fit_context_to_pool,
    kv_bytes_per_page,
)

MODEL = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
)


def test_padding_page_is_never_handed_out():
    alloc = PageAllocator(num_pages=9, page_size=4)
    assert alloc.num_usable == 8 and alloc.num_free == 8 and alloc.num_used == 0
    pages = alloc.allocate(8)
    assert PADDING_PAGE == 0
    assert sorted(pages) == list(range(1, 9))
    assert alloc.num_free == 0 and alloc.num_used == 8


def test_allocate_and_free_round_trip():
    alloc = PageAllocator(num_pages=6, page_size=4)
    a = alloc.allocate(2)
    b = alloc.allocate(3)
    assert len(set(a) | set(b)) == 5, "pages handed out twice"
    assert alloc.num_free == 0
    alloc.free(a)
    assert alloc.num_free == 2 and alloc.num_used == 3
    c = alloc.allocate(2)
    assert set(c) == set(a), "freed pages are reused"
    assert not set(c) & set(b)
    alloc.free(b + c)
    assert alloc.num_free == alloc.num_usable == 5


def test_out_of_pages_raises_and_changes_nothing():
    alloc = PageAllocator(num_pages=4, page_size=2)
    held = alloc.allocate(2)
    assert not alloc.can_allocate(2) and alloc.can_allocate(1)
    with pytest.raises(ValueError, match="asked for 2 pages, 1 free"):
        alloc.allocate(2)
    assert alloc.num_free == 1
    last = alloc.allocate(1)
    assert not set(last) & set(held) and last != [PADDING_PAGE]
    assert alloc.allocate(0) == []


def test_pages_needed_rounds_up():
    alloc = PageAllocator(num_pages=4, page_size=8)
    assert [alloc.pages_needed(n) for n in (0, 1, 7, 8, 9, 16, 17)] == [0, 1, 1, 1, 2, 2, 3]


def test_grow_to():
    alloc = PageAllocator(num_pages=6, page_size=4)  # 5 usable pages = 20 tokens
    pages: list[int] = []
    assert alloc.grow_to(pages, 1) and len(pages) == 1
    assert alloc.grow_to(pages, 4) and len(pages) == 1, "a page holds page_size tokens"
    assert alloc.grow_to(pages, 5) and len(pages) == 2
    assert alloc.grow_to(pages, 3) and len(pages) == 2, "never shrinks"
    first_two = list(pages)
    assert alloc.grow_to(pages, 20) and len(pages) == 5 and pages[:2] == first_two
    assert alloc.num_free == 0
    assert PADDING_PAGE not in pages and len(set(pages)) == 5

    other: list[int] = []
    alloc.free(pages[3:])
    del pages[3:]
    assert alloc.num_free == 2
    assert not alloc.grow_to(other, 9), "9 tokens need 3 pages, 2 free"
    assert other == [] and alloc.num_free == 2, "a failed grow allocates nothing"
    assert alloc.grow_to(other, 8) and len(other) == 2 and not set(other) & set(pages)


def test_needs_two_pages():
    with pytest.raises(ValueError, match="page 0"):
        PageAllocator(num_pages=1, page_size=4)


@settings(max_examples=150, deadline=None)
@given(
    num_pages=st.integers(2, 24),
    page_size=st.sampled_from([1, 2, 4, 16]),
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 80)), max_size=60),
)
def test_random_grow_and_free_keep_ownership_exclusive(num_pages, page_size, ops):
    """Owners grow and release at random; no page is ever owned twice, page 0 never leaves,
    and free + owned always equals the usable pool."""
    alloc = PageAllocator(num_pages, page_size)
    owners: dict[int, list[int]] = {}
    for owner, tokens in ops:
        pages = owners.setdefault(owner, [])
        if tokens == 0:
            alloc.free(pages)
            owners[owner] = []
        else:
            before = list(pages)
            free_before = alloc.num_free
            missing = max(0, alloc.pages_needed(tokens) - len(pages))
            ok = alloc.grow_to(pages, tokens)
            assert ok == (missing <= free_before)
            if ok:
                assert len(pages) * page_size >= tokens and pages[: len(before)] == before
                assert alloc.num_free == free_before - missing
            else:
                assert pages == before and alloc.num_free == free_before
        owned = [p for ps in owners.values() for p in ps]
        assert len(owned) == len(set(owned)), "a page has two owners"
        assert PADDING_PAGE not in owned
        assert all(1 <= p < num_pages for p in owned)
        assert len(owned) + alloc.num_free == alloc.num_usable
    for pages in owners.values():
        alloc.free(pages)
    assert alloc.num_free == alloc.num_usable
    assert sorted(alloc.allocate(alloc.num_usable)) == list(range(1, num_pages))


# ---- shared and cached pages (prefix caching) ----------------------------------------------------
H = [hash_page(None, [i]) for i in range(16)]  # distinct page hashes


def test_a_published_page_outlives_its_holder_until_evicted():
    alloc = PageAllocator(num_pages=4, page_size=4)  # pages 1-3
    a = alloc.allocate(2)
    assert alloc.publish(a[0], H[0]) and alloc.publish(a[1], H[1])
    alloc.free(a)
    assert alloc.num_free == 3 and alloc.num_used == 0 and alloc.num_cached == 2
    assert alloc.lookup([H[0], H[1], H[2]]) == a, "cached after release; the chain stops at the miss"
    assert alloc.lookup([H[1]]) == [a[1]] and alloc.lookup([H[2], H[0]]) == []
    # Allocation takes the free page first, then evicts the least recently released: a
    # sequence's pages are released last page first, so its tail goes before its head.
    [fresh] = alloc.allocate(1)
    assert fresh not in a and alloc.num_cached == 2
    [evicted] = alloc.allocate(1)
    assert evicted == a[1] and alloc.num_evictions == 1
    assert alloc.lookup([H[0], H[1]]) == [a[0]], "the evicted page is no longer found"
    assert alloc.published() == {H[0]: a[0]}


def test_holding_a_cached_page_shares_it_and_takes_it_off_the_evictable_list():
    alloc = PageAllocator(num_pages=4, page_size=4)
    [page] = alloc.allocate(1)
    alloc.publish(page, H[0])
    alloc.hold([page])  # a second sequence finds it while the first still holds it
    assert alloc.ref_count(page) == 2 and alloc.num_used == 1
    alloc.free([page])
    assert alloc.ref_count(page) == 1 and alloc.num_free == 2, "still held by one"
    alloc.free([page])
    assert alloc.num_free == 3 and alloc.num_used == 0
    alloc.hold([page])  # found again while evictable
    assert alloc.ref_count(page) == 1 and alloc.num_free == 2
    assert page not in alloc.allocate(2), "a held page is never handed out"
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([page, page])  # held once, released twice in one call: nothing changes
    assert alloc.ref_count(page) == 1


def test_publishing_refuses_duplicates_and_unheld_pages():
    alloc = PageAllocator(num_pages=5, page_size=4)
    a, b = alloc.allocate(1)[0], alloc.allocate(1)[0]
    assert alloc.publish(a, H[0])
    assert not alloc.publish(b, H[0]), "the first page computed for a prefix stays the cached one"
    assert not alloc.publish(a, H[1]), "a page holds one prefix"
    assert alloc.published() == {H[0]: a}
    alloc.free([b])
    assert alloc.num_cached == 1 and b in alloc._free, "an unpublished page is plainly free"
    with pytest.raises(ValueError, match="not held"):
        alloc.publish(b, H[2])
    with pytest.raises(ValueError, match="not published"):
        alloc.hold([b])


def test_unpublish_and_reset():
    alloc = PageAllocator(num_pages=5, page_size=4)
    pages = alloc.allocate(3)
    for page, page_hash in zip(pages, H):
        alloc.publish(page, page_hash)
    alloc.unpublish(pages[0], H[1])  # not its hash: nothing
    assert alloc.num_cached == 3
    alloc.free(pages[1:])
    alloc.unpublish(pages[1], H[1])  # evictable and unpublished: plainly free
    assert alloc.lookup([H[1]]) == [] and pages[1] in alloc._free and pages[1] not in alloc._evictable
    assert alloc.reset_prefix_cache() == 2
    assert alloc.num_cached == 0 and alloc.lookup([H[0]]) == [] and alloc.lookup([H[2]]) == []
    assert alloc.ref_count(pages[0]) == 1, "a held page stays held"
    alloc.free(pages[:1])
    assert sorted(alloc._free) == [1, 2, 3, 4] and not alloc._evictable


@settings(max_examples=150, deadline=None)
@given(num_pages=st.integers(2, 12), ops=st.lists(st.tuples(st.sampled_from("agfpuhr"), st.integers(0, 7),
                                                             st.integers(0, 15)), max_size=80))
def test_random_sharing_keeps_counts_and_lists_consistent(num_pages, ops):
    """Allocate, release, publish, unpublish, hold and reset at random, against a model of who
    holds what: reference counts equal the holders, never negative; a held page is on no free
    list; every page is held, free or evictable, exactly one of them; published pages map both
    ways; page 0 never appears."""
    alloc = PageAllocator(num_pages, page_size=4)
    holders: dict[int, list[int]] = {}
    for op, owner, k in ops:
        pages = holders.setdefault(owner, [])
        if op == "a" and alloc.can_allocate(1):
            pages.extend(alloc.allocate(1))
        elif op == "g":
            alloc.grow_to(pages, (len(pages) + k % 3) * 4)
        elif op == "f":
            alloc.free(pages)
            holders[owner] = []
        elif op == "p" and pages:
            alloc.publish(pages[k % len(pages)], H[k])
        elif op == "u":
            page = alloc.published().get(H[k])
            if page is not None:
                alloc.unpublish(page, H[k])
        elif op == "h":
            found = alloc.lookup([H[k]])
            if found and found[0] not in pages:
                alloc.hold(found)
                pages.extend(found)
        elif op == "r" and k == 0:
            alloc.reset_prefix_cache()
        counts = {}
        for held in holders.values():
            for page in held:
                counts[page] = counts.get(page, 0) + 1
        assert PADDING_PAGE not in counts
        assert all(alloc.ref_count(p) == counts.get(p, 0) for p in range(num_pages))
        free, evictable = set(alloc._free), set(alloc._evictable)
        assert len(free) == len(alloc._free) and not free & evictable
        assert not (free | evictable) & set(counts), "a held page is on a free list"
        assert len(free) + len(evictable) + len(counts) == alloc.num_usable
        published = alloc.published()
        assert evictable <= set(published.values()) and not free & set(published.values())
        assert len(set(published.values())) == len(published), "two hashes on one page"
    for held in holders.values():
        alloc.free(held)
    assert alloc.num_free == alloc.num_usable and alloc.num_used == 0


def test_cache_shape_and_page_bytes():
    cache = create_kv_cache(MODEL, num_pages=5, page_size=8, dtype=jnp.float32)
    assert cache.shape == (MODEL.num_layers, 5, 8, 2 * MODEL.num_kv_heads, MODEL.head_dim)
    assert cache.dtype == jnp.float32
    assert not bool(jnp.any(cache != 0))
    per_page = kv_bytes_per_page(MODEL, 8, jnp.bfloat16)
    assert per_page == MODEL.num_layers * 8 * 2 * MODEL.num_kv_heads * MODEL.head_dim * 2
    assert kv_bytes_per_page(MODEL, 8, jnp.float32) * 5 == cache.nbytes


def test_choose_num_pages():
    explicit = EngineConfig(num_pages=7, page_size=8, max_model_len=64).resolve(MODEL)
    assert choose_num_pages(explicit, MODEL, jnp.float32) == 7

    per_page = kv_bytes_per_page(MODEL, 8, jnp.float32)
    budget = EngineConfig(page_size=8, max_model_len=64, max_num_seqs=32,
                          kv_cache_memory_bytes=10 * per_page + 1).resolve(MODEL)
    assert choose_num_pages(budget, MODEL, jnp.float32) == 10

    # Never more than every sequence at full length can use, plus the padding page.
    capped = EngineConfig(page_size=8, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8,
                          kv_cache_memory_bytes=1000 * per_page).resolve(MODEL)
    assert choose_num_pages(capped, MODEL, jnp.float32) == 2 * 8 + 1

    tiny = EngineConfig(page_size=8, max_model_len=64, kv_cache_memory_bytes=1).resolve(MODEL)
    assert choose_num_pages(tiny, MODEL, jnp.float32) == 2


def test_a_pool_shorter_than_the_models_context_lowers_it_and_says_so(caplog):
    """The model's 4096 tokens need 513 pages of 8 (with the sink); a budget of 101 pages
    serves 800 tokens per sequence, and the log says why the context dropped."""
    per_page = kv_bytes_per_page(MODEL, 8, jnp.float32)
    config = EngineConfig(page_size=8, kv_cache_memory_bytes=101 * per_page).resolve(MODEL)
    assert config.max_model_len == MODEL.max_position_embeddings
    num_pages = choose_num_pages(config, MODEL, jnp.float32)
    assert num_pages == 101
    with caplog.at_level("WARNING", logger="orca_jax.core.kv_cache"):
        fitted = fit_context_to_pool(config, num_pages)
    assert fitted.max_model_len == 800
    assert "max_model_len lowered from 4096" in caplog.text and "800" in caplog.text

    caplog.clear()
    roomy = EngineConfig(page_size=8, kv_cache_memory_bytes=600 * per_page).resolve(MODEL)
    with caplog.at_level("WARNING", logger="orca_jax.core.kv_cache"):
        assert fit_context_to_pool(roomy, choose_num_pages(roomy, MODEL, jnp.float32)) == roomy
    assert not caplog.text
