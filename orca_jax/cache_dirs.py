"""Where orca_jax keeps what it can reuse between runs: compiled XLA programs and converted
model weights. Both make a second start fast; neither is needed for correctness, so a
missing or unwritable directory only costs time.

The root is `$ORCA_JAX_CACHE_DIR` if set, else `$XDG_CACHE_HOME/orca_jax`, else
`~/.cache/orca_jax` (the per-user cache directory of the XDG convention, as pip and
Hugging Face use). The variable exists so that a test suite or a read-only home can point the
whole cache elsewhere at once; each cache is also a setting of its own (`EngineConfig`).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "ORCA_JAX_CACHE_DIR"


def cache_root() -> Path:
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "orca_jax"


def default_compilation_cache_dir() -> str:
    """JAX's persistent compilation cache (compiled step programs)."""
    return str(cache_root() / "xla")


def default_model_cache_dir() -> str:
    """Converted weights and tokenizers of GGUF models, keyed by file hash and dtype."""
    return str(cache_root() / "models")
