"""JAX's persistent compilation cache, switched on once per process.

With it, a second start loads each step program from disk (about 0.1 s) instead of compiling
it (1.3-8 s on a 2-core CPU). The setting is process-wide in JAX, so this module is the only
place that touches it: `enable_compilation_cache` (explicit: point the process at a directory)
and `configure_for_process`, through which an engine's `compilation_cache_dir` reaches the
process once: the first engine's setting is applied, and a later engine that asks for another
one is told the process keeps its cache, rather than switching it under engines already running.

JAX skips caching programs that compiled in under a second or that serialize small; both
thresholds are lowered to nothing here, because on a second start every program that is not
on disk is a compile in the start-up path (the step programs, and the small ones that create
the KV cache).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

logger = logging.getLogger(__name__)

# -1: no size threshold, and JAX may not raise it for the filesystem (see its flag's help).
_CACHE_EVERY_ENTRY_SIZE = -1
_CACHE_EVERY_COMPILE_TIME_S = 0.0


def enable_compilation_cache(path: str | Path) -> bool:
    """Make JAX read and write compiled programs under `path` from now on. Idempotent; a
    different path replaces the previous one. A directory that cannot be created or written
    only costs time: a warning, and False (JAX then compiles as if the cache were off)."""
    directory = Path(path).expanduser()
    if active_cache_dir() == str(directory):
        return True
    problem = _unwritable_reason(directory)
    if problem:
        logger.warning("compilation cache %s is not usable (%s): every start compiles its programs", directory,
                       problem)
        return False
    jax.config.update("jax_persistent_cache_min_compile_time_secs", _CACHE_EVERY_COMPILE_TIME_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", _CACHE_EVERY_ENTRY_SIZE)
    replacing = active_cache_dir() is not None
    jax_cache.set_cache_dir(str(directory))
    if replacing:
        # JAX opens its cache once, at the first compile after a path is set; forget the old one.
        jax_cache.reset_cache()
    logger.info("compilation cache: %s", directory)
    return True


def configure_for_process(path: str | Path | None) -> str | None:
    """An engine's `compilation_cache_dir`, applied to the process if it has no cache yet (None
    asks for none). A cache already active stays, with a warning when the engine asked for
    another directory or for none. Returns the directory in use afterwards (None: off)."""
    active = active_cache_dir()
    if active is None:
        if path is not None and enable_compilation_cache(path):
            return str(Path(path).expanduser())
        return None
    if path is None or str(Path(path).expanduser()) != active:
        logger.warning("compilation cache: this process already uses %s (JAX's cache is process-wide); "
                       "compilation_cache_dir=%s is not applied", active, path)
    return active


def active_cache_dir() -> str | None:
    """The directory JAX's persistent cache uses in this process, or None when it is off."""
    return jax.config.jax_compilation_cache_dir


def _unwritable_reason(directory: Path) -> str | None:
    try:
        # Only this user writes here: JAX runs what it loads from the cache.
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return None
