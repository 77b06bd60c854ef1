"""Paged KV cache: the host page allocator and the device cache array.

Device layout, per layer: `[num_pages, page_size, 2 * num_kv_heads, head_dim]` with K at even
and V at odd head slots (the layout of jax's TPU ragged paged attention kernel). All layers live
in one array `[num_layers, num_pages, ...]`; the step views it as `num_layers * num_pages` pages
and offsets page ids by layer, so the layer scan writes in place into one donated buffer.

Page 0 is never handed out: padding tokens write their K/V there, so a padded step cannot
touch a page that belongs to a sequence. Pages are held by reference and full pages can be
published under their content hash, so sequences with a common prefix share its pages
(`PageAllocator`, `orca_jax.core.prefix_cache`).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque

import jax
import jax.numpy as jnp

from orca_jax.config import EngineConfig, ModelConfig, kv_pool_tokens
from orca_jax.kernels.kv_quant import cache_head_dim

logger = logging.getLogger(__name__)

PADDING_PAGE = 0


class PageAllocator:
    """The pool of KV pages: who holds each page, and what is known of its contents.

    A page is held by reference: a sequence holds every page of its page table once, and
    several sequences hold the same page when they share a cached prefix. A full page whose
    tokens are in the cache can be *published* under its content hash (`orca_jax.core.prefix_cache`):
    `lookup` then finds it for a later sequence with the same prefix. A page nobody holds any
    more stays cached if it is published, and is evicted, least recently released first, only
    when a page is needed and none is free; so `num_free` counts free and evictable pages
    alike, and `num_used` only the pages some sequence holds. Page 0, the padding sink, is
    never handed out, published or counted.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("need at least 2 pages: page 0 is reserved as the padding sink")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))  # held by nobody, no published contents
        self._refs = [0] * num_pages
        # Held by nobody but published, in release order (the first is evicted first).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._page_of_hash: dict[bytes, int] = {}
        self._hash_of_page: dict[int, bytes] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: free ones, and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_used(self) -> int:
        """Pages some sequence holds."""
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        """Published pages, held or not."""
        return len(self._page_of_hash)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free

    def allocate(self, num_pages: int) -> list[int]:
        """Take `num_pages` pages, free ones first, then evicting cached ones nobody holds.
        Running short is the caller's bug, not a state of the pool: the scheduler asks
        `can_allocate` (through `grow_to`) and preempts instead."""
        if num_pages > self.num_free:
            raise ValueError(f"asked for {num_pages} pages, {self.num_free} free")
        pages = [self._take_unheld() for _ in range(num_pages)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def _take_unheld(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._evictable.popitem(last=False)
        self._forget(page)
        self.num_evictions += 1
        return page

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page. A page nobody holds any more becomes free, or
        evictable if it is published; pages are released in reverse, so that a sequence's
        last pages (the least shared) are evicted before its first. Dropping a reference
        that is not held (a double free, or page 0) would later give a page two owners, so it
        is an error here rather than silent corruption there."""
        for page, count in Counter(pages).items():
            if page == PADDING_PAGE or self._refs[page] < count:
                raise ValueError(f"page {page} is not allocated (double free or padding page)")
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of_page:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def grow_to(self, pages: list[int], num_tokens: int) -> bool:
        """Append pages to `pages` until it holds `num_tokens` tokens. False if the pool is short
        (then nothing is allocated)."""
        missing = self.pages_needed(num_tokens) - len(pages)
        if missing <= 0:
            return True
        if not self.can_allocate(missing):
            return False
        pages.extend(self.allocate(missing))
        return True

    # ---- content-addressed pages (prefix caching) -------------------------------------------
    def lookup(self, page_hashes: list[bytes]) -> list[int]:
        """The published pages of the longest prefix of `page_hashes` (a chain: page i's hash
        covers pages 0..i, so the first miss ends the prefix). Takes no reference."""
        pages = []
        for page_hash in page_hashes:
            page = self._page_of_hash.get(page_hash)
            if page is None:
                break
            pages.append(page)
        return pages

    def hold(self, pages: list[int]) -> None:
        """Take a reference to each of these published pages (a prefix `lookup` found)."""
        for page in pages:
            if page not in self._hash_of_page:
                raise ValueError(f"page {page} is not published")
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1

    def publish(self, page: int, page_hash: bytes) -> bool:
        """Record that a held, full page holds the tokens `page_hash` names. False (and
        nothing changes) when another page is published under that hash already (two
        sequences computed the same prefix at once; the first one stays the cached one) or
        this page is published already."""
        if self._refs[page] == 0:
            raise ValueError(f"page {page} is not held: only a sequence's own page can be published")
        if page_hash in self._page_of_hash or page in self._hash_of_page:
            return False
        self._page_of_hash[page_hash] = page
        self._hash_of_page[page] = page_hash
        return True

    def unpublish(self, page: int, page_hash: bytes) -> None:
        """Forget that `page` holds `page_hash` (its contents were not written after all: the
        step that was to write them failed). Nothing if it is not published under that hash."""
        if self._page_of_hash.get(page_hash) != page:
            return
        self._forget(page)
        if page in self._evictable:
            del self._evictable[page]
            self._free.append(page)

    def reset_prefix_cache(self) -> int:
        """Forget every page's contents (after new weights, or a lost cache): cached pages nobody
        holds become free, held ones stay held but will not be found. Returns how many pages
        were published."""
        num_published = len(self._page_of_hash)
        self._page_of_hash.clear()
        self._hash_of_page.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
        return num_published

    def published(self) -> dict[bytes, int]:
        """hash -> page, for tests and checks."""
        return dict(self._page_of_hash)

    def _forget(self, page: int) -> None:
        del self._page_of_hash[self._hash_of_page.pop(page)]


def kv_bytes_per_page(model: ModelConfig, page_size: int, dtype) -> int:
    """Bytes of one page over all layers; an 8-bit cache counts each row's scale bytes."""
    itemsize = jnp.dtype(dtype).itemsize
    row = cache_head_dim(model.head_dim, dtype)
    return model.num_layers * page_size * 2 * model.num_kv_heads * row * itemsize


def choose_num_pages(config: EngineConfig, model: ModelConfig, dtype, device=None, num_shards: int = 1) -> int:
    """Pages that fit the memory budget: a fraction of free accelerator memory (like vLLM's
    gpu_memory_utilization, measured after the weights are loaded), or a stated byte budget on
    CPU, where JAX reports no memory limit. Both are per device: with the cache sharded over
    `num_shards` devices (tensor parallelism), a device holds 1/num_shards of each page."""
    per_page = kv_bytes_per_page(model, config.page_size, dtype) // num_shards
    if config.num_pages is not None:
        num_pages, source = config.num_pages, "num_pages set"
    else:
        budget, source = _memory_budget(config, device or jax.local_devices()[0])
        # Never more pages than every sequence at full length could use, plus the sink page.
        useful = config.max_num_seqs * config.max_pages_per_seq + 1
        num_pages = max(2, min(budget // per_page, useful))
    logger.info(
        "KV cache: %d pages of %d tokens (%d tokens for sequences), %.1f MiB per device (%s)",
        num_pages, config.page_size, kv_pool_tokens(num_pages, config.page_size), num_pages * per_page / 2**20,
        source,
    )
    return num_pages


def _memory_budget(config: EngineConfig, device) -> tuple[int, str]:
    """Bytes for the cache on one device, and where the number comes from."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        budget = int(free * config.gpu_memory_utilization)
        return budget, f"{config.gpu_memory_utilization:.0%} of {free / 2**30:.2f} GiB free on {device.platform}"
    return config.kv_cache_memory_bytes, f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}"


def fit_context_to_pool(config: EngineConfig, num_pages: int) -> EngineConfig:
    """`config.fit_kv_pool(num_pages)`, saying so when it lowers the context or when an
    explicit max_model_len is longer than the pool."""
    fitted = config.fit_kv_pool(num_pages)
    pool_tokens = kv_pool_tokens(num_pages, config.page_size)
    if fitted.max_model_len < config.max_model_len:
        logger.warning(
            "max_model_len lowered from %d (the model's context) to %d: the KV pool of %d pages holds only "
            "%d tokens; raise kv_cache_memory_bytes / gpu_memory_utilization or num_pages for the full context",
            config.max_model_len, fitted.max_model_len, num_pages, pool_tokens)
    elif fitted.max_model_len > pool_tokens:
        logger.warning(
            "max_model_len %d is longer than the KV pool (%d pages, %d tokens): longer requests are refused",
            fitted.max_model_len, num_pages, pool_tokens)
    return fitted


def create_kv_cache(model: ModelConfig, num_pages: int, page_size: int, dtype, sharding=None) -> jax.Array:
    """All layers' pages: [num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim]
    (head_dim + 2 for an 8-bit cache: each row's scale, kernels/kv_quant.py; zeros read as
    zero rows with scale 0). With a sharding (tensor parallelism) each device allocates only
    its own slice."""
    shape = (model.num_layers, num_pages, page_size, 2 * model.num_kv_heads, cache_head_dim(model.head_dim, dtype))
    # jnp.zeros places each device's slice itself, from a program jax caches per shape, dtype
    # and sharding: rebuilding the cache after a failed step compiles nothing.
    return jnp.zeros(shape, dtype, device=sharding)
