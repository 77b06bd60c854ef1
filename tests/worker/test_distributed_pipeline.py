"""Pipeline stages across processes (orca_jax/worker/pipeline.py, orca_jax/worker/multihost.py): two
`orca-jax serve` processes joined by jax.distributed on 127.0.0.1 (CPU collectives over gloo),
one CPU device each, `--pipeline-parallel-size 2`: stage 0 (embedding, first layer) on process
0, which serves HTTP and schedules; stage 1 (second layer, head, sampling) on process 1. The
activations and the sampled tokens cross between them by `StageLink`s (a ppermute over the two
stages' rows); the step inputs by jax.distributed's key-value store. Their outputs must equal
one process's without a pipeline, neither may build a program once serving, and SIGTERM to the
leader must end both.

The helpers (ports, health, requests, the one-process reference) are tests/worker/test_distributed.py's."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest


def _sibling(name: str):
    """A module of this directory by path (pytest imports tests in importlib mode: they are not
    importable by name)."""
    spec = importlib.util.spec_from_file_location(f"_orca_jax_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dist = _sibling("test_distributed")


def start_stage_process(model: str, process_id: int, coordinator: str, http_port: int, log) -> subprocess.Popen:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in dist.ENGINE_FLAGS.items()]
    cmd = [sys.executable, "-m", "orca_jax.cli", "--log-level", "INFO", "serve", "--model", model,
           "--pipeline-parallel-size", "2", *flags, "--coordinator-address", coordinator,
           "--num-processes", "2", "--process-id", str(process_id), "--port", str(http_port)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def test_two_processes_serve_a_pipeline_like_one_process_and_stop_together(tiny_llama_dir, tmp_path):
    model = str(tiny_llama_dir)
    coordinator, http_port = f"127.0.0.1:{dist.free_port()}", dist.free_port()
    logs = [open(tmp_path / f"process{i}.log", "w") for i in range(2)]
    processes = [start_stage_process(model, i, coordinator, http_port, logs[i]) for i in (1, 0)][::-1]
    try:
        url = f"http://127.0.0.1:{http_port}"
        dist.wait_healthy(url, processes, logs)
        # Concurrent requests (greedy and seeded, one prefilled in chunks), so that the batches
        # in flight mix them.
        with ThreadPoolExecutor(len(dist.REQUESTS)) as pool:
            served = list(pool.map(lambda r: dist.complete(url, model, *r), dist.REQUESTS))
        assert served == dist.one_process_texts(model)
        assert all(served)

        processes[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in processes]
        leader_log, follower_log = dist._tail(logs[0]), dist._tail(logs[1])
        assert codes == [0, 0], f"{leader_log}\n{follower_log}"
        # --pipeline-parallel-size reached both engines; each process built its own stage only.
        assert "pipeline_parallel_size 2" in leader_log and "pipeline_parallel_size 2" in follower_log
        assert "process 0 of 2 holds stages [0]" in leader_log
        assert "process 1 of 2 holds stages [1]" in follower_log
        assert "handed over by jax.distributed's key-value store" in leader_log
        assert "handed over by jax.distributed's key-value store" in follower_log
        # The leader warmed up every program it runs; the follower built its own during the
        # leader's padding steps, and nothing once requests came.
        assert "built on first use" not in leader_log
        assert "stop received" in follower_log and "0 programs built while serving" in follower_log
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


# ---- in-process: flags and the placement rules ----------------------------------------------------
def test_serve_passes_the_pipeline_size_to_the_engine():
    from orca_jax.cli.commands import _engine_config, build_parser

    args = build_parser().parse_args(["serve", "--pipeline-parallel-size", "2", "--num-processes", "2",
                                      "--process-id", "1", "--coordinator-address", "127.0.0.1:1234"])
    assert _engine_config(args).pipeline_parallel_size == 2


def _fake_mesh(processes_per_row: list[list[int]]):
    rows = [[SimpleNamespace(id=10 * s + i, process_index=p) for i, p in enumerate(row)]
            for s, row in enumerate(processes_per_row)]
    return SimpleNamespace(devices=np.array(rows, dtype=object))


def test_each_stage_belongs_to_one_process():
    from orca_jax.worker.pipeline_layout import stage_processes

    assert stage_processes(_fake_mesh([[0, 0], [1, 1]])) == [0, 1]
    assert stage_processes(_fake_mesh([[0], [0], [1], [1]])) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"stage 1 spans processes \[0, 1\]"):
        stage_processes(_fake_mesh([[0, 0], [0, 1], [1, 1]]))


def test_a_multi_process_pipeline_uses_every_device(monkeypatch):
    import jax

    from orca_jax.worker import pipeline

    monkeypatch.setattr(pipeline.jax, "process_count", lambda: 2)
    device = jax.devices()[0]
    with pytest.raises(ValueError, match="must equal the number of devices of all processes"):
        pipeline.make_pipeline_mesh(1, 1, devices=[device, device])


class FakeKeyValueStore:
    """jax.distributed's key-value client, in memory (one process plays leader and follower)."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        assert key not in self.values
        self.values[key] = value

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        return self.values[key]

    def key_value_delete(self, key: str) -> None:
        del self.values[key]


def dist_model_config():
    from orca_jax.config import ModelConfig

    return ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, max_position_embeddings=4096)


def test_steps_cross_the_key_value_store_whole_and_in_order(monkeypatch):
    """Each step one value under its number; the token bitmask only with a guided row and the
    logit bias only with a biased one (the receiver fills in their neutral values); stop ends the receiver's loop; old steps are deleted."""
    from orca_jax.worker import multihost
    from orca_jax.worker.batch_state import OPTIONAL_FIELDS, ROW_BIASED, ROW_GUIDED, empty_step_inputs
    from orca_jax.config import EngineConfig

    store = FakeKeyValueStore()
    monkeypatch.setattr(multihost, "_key_value_client", lambda: store)
    monkeypatch.setattr(multihost.StepChannel, "KEEP_STEPS", 2)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, page_size=8, num_pages=32,
                          max_model_len=128).resolve(dist_model_config())
    leader, follower = multihost.StepChannel(config), multihost.StepChannel(config)
    assert leader.transport == follower.transport == "kv"
    rng = np.random.default_rng(0)
    steps = []
    for bucket, guided, biased in [(8, False, False), (16, True, False), (8, False, True), (16, True, True)]:
        inputs = empty_step_inputs(config, bucket)
        inputs.input_ids[:] = rng.integers(0, 500, bucket)
        inputs.num_seqs[:] = 1
        if guided:
            inputs.row_flags[0] = ROW_GUIDED
            inputs = dataclasses.replace(inputs, token_bitmask=inputs.token_bitmask.copy())
            inputs.token_bitmask[0] = rng.integers(-2**31, 2**31, inputs.token_bitmask.shape[1])
        if biased:
            inputs.row_flags[1] |= ROW_BIASED
            inputs = dataclasses.replace(inputs, bias_ids=inputs.bias_ids.copy(), bias_values=inputs.bias_values.copy())
            inputs.bias_ids[1, :3], inputs.bias_values[1, :3] = [7, 9, 400], [1.5, -100.0, 3.0]
        leader.send(inputs)
        steps.append(inputs)
        value = store.values[leader._key(len(steps) - 1)]
        # The header (12 bytes) and the arrays; the bitmask only with a guided row, the bias with a biased one.
        needed = {"token_bitmask": guided, "bias_ids": biased, "bias_values": biased}
        assert set(needed) == set(OPTIONAL_FIELDS)
        unsent = sum(getattr(inputs, name).nbytes for name, sent in needed.items() if not sent)
        assert len(value) == 12 + inputs.nbytes - unsent
        got = follower.receive()
        for name in multihost._STEP_FIELDS:
            np.testing.assert_array_equal(getattr(got, name), getattr(inputs, name), err_msg=name)
    leader.send_stop()
    assert follower.receive() is None and follower.stopped
    assert sorted(store.values) == [leader._key(3), leader._key(4)]  # steps 0 to 2 deleted
    with pytest.raises(RuntimeError, match="after the followers were stopped"):
        leader.send(steps[0])
