"""Counting XLA programs, so that "nothing compiles after warm-up" is checkable.

JAX reports every program it builds for a backend through `jax.monitoring`: the event
`/jax/core/compile/backend_compile_duration` wraps both a real XLA compile and a load from the
persistent compilation cache (`orca_jax.worker.compilation_cache`), and a load also records
`/jax/compilation_cache/cache_hits`. So `programs - cache_hits` is what XLA really compiled.
A program built after warm-up is a bug either way (a cache load still costs a trace, a
lowering and a deserialization in the middle of serving), so the guard counts `programs`.

The listeners are registered once per process, at import (they cannot be removed), so the
counts cover everything built after `orca_jax.worker.compile_guard` was first imported.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import jax

_PROGRAM_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclass(frozen=True)
class CompileCounts:
    """Programs built for the backend, and how many of them came from the persistent cache."""

    programs: int = 0
    cache_hits: int = 0

    @property
    def compiled(self) -> int:
        """Programs XLA really compiled (persistent-cache misses, or the cache off)."""
        return self.programs - self.cache_hits

    def __sub__(self, earlier: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.programs - earlier.programs, self.cache_hits - earlier.cache_hits)

    def __add__(self, other: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.programs + other.programs, self.cache_hits + other.cache_hits)


_lock = threading.Lock()  # warm-up compiles from several threads at once
_programs = 0
_cache_hits = 0


def _on_duration_event(name: str, *_args, **_kwargs) -> None:
    global _programs
    if name == _PROGRAM_EVENT:
        with _lock:
            _programs += 1


def _on_event(name: str, *_args, **_kwargs) -> None:
    global _cache_hits
    if name == _CACHE_HIT_EVENT:
        with _lock:
            _cache_hits += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration_event)
jax.monitoring.register_event_listener(_on_event)


def compile_counts() -> CompileCounts:
    """Programs and persistent-cache hits in this process so far."""
    with _lock:
        return CompileCounts(_programs, _cache_hits)


def compile_count() -> int:
    """Programs built in this process so far (compiled, or loaded from the persistent cache)."""
    return compile_counts().programs


class UnexpectedCompileError(AssertionError):
    pass


@contextlib.contextmanager
def no_compiles(what: str = "serving"):
    """Fail if any program is built inside the block (compiled or loaded from the cache)."""
    before = compile_count()
    yield
    built = compile_count() - before
    if built:
        raise UnexpectedCompileError(f"{built} XLA compile(s) happened during {what} after warm-up")
