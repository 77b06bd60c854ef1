"""Data parallelism: `data_parallel_size` whole engines in one process, each on its own devices.

A model that fits one chip (or one tensor x pipeline group of chips) is served on a machine of
several as replicas, vLLM's `--data-parallel-size`: replica r holds devices
[r * T * P, (r + 1) * T * P) of this process, its own weights, KV cache, scheduler and step
programs, and shares nothing with the others at run time. Requests are routed between them
(`orca_jax.engine.router`); the async front (`orca_jax.engine.data_parallel`) and the offline
`LLM` step each replica on its own thread, so their device work overlaps.

One warm-up, before serving, for all: on a GPU replica 0 compiles every step program and the
others then take them from JAX's persistent compilation cache together (there its key leaves the
device assignment out, so a program compiled for GPU 0 serves GPU 3), a deserialization instead
of a compile. On CPU and TPU the key holds the devices, so the replicas compile at once, on
threads (XLA releases the GIL while it compiles).

Across hosts (jax.distributed): each process serves its own replicas on its own devices, so the
replicas of process p are numbered from p x (its local replica count); no request or step
crosses hosts. The hosts still share jax.distributed's coordination service (on process 0):
start-up waits for all of them, and losing process 0 ends the others after its heartbeat
timeout, so they are one job, not independent servers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import jax

from orca_jax.config import EngineConfig
from orca_jax.engine.engine import LLMEngine
from orca_jax.worker.compilation_cache import active_cache_dir
from orca_jax.worker.compile_guard import compile_counts

logger = logging.getLogger(__name__)


def devices_per_replica(config: EngineConfig) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size


def local_replica_count(config: EngineConfig) -> int:
    """This process's share of the replicas: all of them on one host, an equal part on each of
    several (jax.distributed)."""
    processes = jax.process_count()
    if config.data_parallel_size % processes:
        raise ValueError(f"data_parallel_size={config.data_parallel_size} must divide by the number of "
                         f"processes ({processes}): each host serves the same number of replicas")
    return config.data_parallel_size // processes


def replica_device_groups(config: EngineConfig, devices=None) -> list[list]:
    """The devices of each of this process's replicas: consecutive groups of T x P local devices."""
    devices = list(devices) if devices is not None else jax.local_devices()
    count, size = local_replica_count(config), devices_per_replica(config)
    needed = count * size
    if needed > len(devices):
        raise ValueError(
            f"data_parallel_size={config.data_parallel_size} x tensor_parallel_size={config.tensor_parallel_size} x "
            f"pipeline_parallel_size={config.pipeline_parallel_size} needs {needed} devices per process, but this "
            f"one has {len(devices)} ({devices[0].platform}); on CPU, force more with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed}")
    return [devices[r * size:(r + 1) * size] for r in range(count)]


def replica_index_offset(local_count: int) -> int:
    """The global index of this process's first replica (0 on one host): process p serves
    replicas p x local_count onwards."""
    return jax.process_index() * local_count


def build_replicas(config: EngineConfig, *, warmup: bool = True, devices=None, **engine_kwargs) -> list[LLMEngine]:
    """This process's replicas, warmed up once (see the module's docstring). Each is an
    LLMEngine of data_parallel_size 1 on its own devices; `engine_kwargs` go to every one
    (make_runner, in tests).

    Every replica takes replica 0's KV pool size: pools sized from each device's own free
    memory could differ by a page, and with them the cache's shape (so the programs, which
    could then not be shared) and possibly max_model_len, which the server checks prompts
    against once for all replicas."""
    groups = replica_device_groups(config, devices)
    replica_config = dataclasses.replace(config, data_parallel_size=1)
    started = time.perf_counter()
    engines: list[LLMEngine] = []
    for r, group in enumerate(groups):
        if engines:
            replica_config = dataclasses.replace(replica_config, num_pages=engines[0].runner.num_pages)
        engine = LLMEngine(replica_config, warmup=False, devices=group, **engine_kwargs)
        engine.replica_index = replica_index_offset(len(groups)) + r
        engines.append(engine)
    built = time.perf_counter()
    if warmup:
        _warm_up(engines)
    logger.info("data parallelism: %d replicas of %d device(s) each (%s), built in %.1f s, warmed up in %.1f s",
                len(engines), devices_per_replica(config), ", ".join(
                    f"replica {e.replica_index}: {[d.id for d in g]}" for e, g in zip(engines, groups)),
                built - started, time.perf_counter() - built)
    return engines


def _warm_up(engines: list[LLMEngine]) -> None:
    counts_before = compile_counts()
    rest = engines
    if len(engines) > 1 and _cache_serves_other_devices():
        engines[0].warmup()  # the others read its programs back
        rest = engines[1:]
    # Together: XLA releases the GIL while it compiles or deserializes.
    with ThreadPoolExecutor(max_workers=len(rest), thread_name_prefix="replica-warmup") as pool:
        list(pool.map(lambda engine: engine.warmup(), rest))
    counts = compile_counts() - counts_before
    logger.info("warm-up of %d replicas: %d programs compiled, %d read from the compilation cache",
                len(engines), counts.compiled, counts.cache_hits)


def _cache_serves_other_devices() -> bool:
    """Whether a program compiled for one replica's devices is a cache hit for another's: jax
    leaves the device assignment out of the cache key on GPUs only (for multi-process runs), so
    on CPU and TPU each replica compiles its own, all at once."""
    # jax writes cache entries from process 0 only: another host's replicas compile their own.
    return jax.default_backend() == "gpu" and active_cache_dir() is not None and jax.process_index() == 0
