"""Paged KV cache: the host page allocator and the device cache array.

Device layout, per layer: `[num_pages, page_size, 2 * num_kv_heads, head_dim]` with K at even
and V at odd head slots (the layout of jax's TPU ragged paged attention kernel). All layers live
in one array `[num_layers, num_pages, ...]`; the step views it as `num_layers * num_pages` pages
and offsets page ids by layer, so the layer scan writes in place into one donated buffer.

Page 0 is never handed out: padding tokens write their K/V there, so a padded step cannot
touch a page that belongs to a sequence.
"""

from __future__ import annotations

import logging
from collections import deque

import jax
import jax.numpy as jnp

from orca_jax.config import EngineConfig, ModelConfig, kv_pool_tokens

logger = logging.getLogger(__name__)

PADDING_PAGE = 0


class PageAllocator:
    """Free list of KV pages. Pages are owned by one sequence at a time."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("need at least 2 pages: page 0 is reserved as the padding sink")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))
        self._is_free = [False] + [True] * (num_pages - 1)  # catches double frees cheaply

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        """Take `num_pages` free pages. Running short is the caller's bug, not a state of the
        pool: the scheduler asks `can_allocate` (through `grow_to`) and preempts instead."""
        if num_pages > len(self._free):
            raise ValueError(f"asked for {num_pages} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(num_pages)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool. A page freed twice (or page 0) would later get two owners,
        so it is an error here rather than silent corruption there."""
        for page in pages:
            if page == PADDING_PAGE or self._is_free[page]:
                raise ValueError(f"page {page} is not allocated (double free or padding page)")
            self._is_free[page] = True
        self._free.extend(pages)

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


def kv_bytes_per_page(model: ModelConfig, page_size: int, dtype) -> int:
    itemsize = jnp.dtype(dtype).itemsize
    return model.num_layers * page_size * 2 * model.num_kv_heads * model.head_dim * itemsize


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
    """All layers' pages: [num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim].
    With a sharding (tensor parallelism) each device allocates only its own slice."""
    shape = (model.num_layers, num_pages, page_size, 2 * model.num_kv_heads, model.head_dim)
    # jnp.zeros places each device's slice itself, from a program jax caches per shape, dtype
    # and sharding: rebuilding the cache after a failed step compiles nothing.
    return jnp.zeros(shape, dtype, device=sharding)
