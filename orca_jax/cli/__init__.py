"""The `orca-jax` command line, the top layer: it parses flags into an `EngineConfig` and hands
off to an entry point (`generate`, `serve`, `convert`) or to a benchmark (`bench ...`), so it is
the one folder that may import `bench/`. `python -m orca_jax.cli` runs it too (`__main__.py`)."""

from orca_jax.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
