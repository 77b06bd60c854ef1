"""What both runners share (orca_jax/worker/runner_base.py). The step path itself (dispatch,
send_and_run, the bitmask placed once) runs in every engine test, through both runners
(tests/worker/test_runner.py, tests/worker/test_pipeline.py)."""

from __future__ import annotations

import pytest

from orca_jax.worker import runner_base


@pytest.mark.parametrize("cores, programs, workers", [(1, 7, 1), (2, 7, 1), (4, 7, 2), (16, 7, 7), (16, 0, 1)])
def test_a_compile_gets_two_cores(monkeypatch, cores, programs, workers):
    monkeypatch.setattr(runner_base.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert runner_base.compile_workers(programs) == workers
