"""Shared by the tests of benchmarks/: the scripts are not a package, so each is loaded from its
file (test modules cannot import one another under --import-mode=importlib)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark_script(name: str):
    """benchmarks/<name>.py as a module, registered in sys.modules (dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_benchmark():
    """`load_benchmark(name)` -> benchmarks/<name>.py as a module."""
    return load_benchmark_script
