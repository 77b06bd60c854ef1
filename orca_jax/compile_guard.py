"""Counting XLA compiles, so that "nothing compiles after warm-up" is checkable.

JAX reports every backend compile through `jax.monitoring`; one listener (registered once per
process, since listeners cannot be removed) counts them.
"""

from __future__ import annotations

import contextlib
import threading

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_registered = False


def _on_event(name: str, *_args, **_kwargs) -> None:
    global _count
    if name == _COMPILE_EVENT:
        with _lock:
            _count += 1


def compile_count() -> int:
    """Backend compiles in this process since the counter was first used."""
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _registered = True
        return _count


class UnexpectedCompileError(AssertionError):
    pass


@contextlib.contextmanager
def no_compiles(what: str = "serving"):
    """Fail if anything is compiled inside the block."""
    before = compile_count()
    yield
    compiled = compile_count() - before
    if compiled:
        raise UnexpectedCompileError(f"{compiled} XLA compile(s) happened during {what} after warm-up")
