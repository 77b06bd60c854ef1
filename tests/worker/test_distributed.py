"""Multi-host serving (orca_jax/worker/multihost.py): two `orca-jax serve` processes joined by
jax.distributed on 127.0.0.1 (CPU collectives over gloo), one device each, tensor parallel over
both. Process 0 serves HTTP and schedules; process 1 runs the same steps. Their outputs must
equal one process's, and SIGTERM to the leader must end both."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from orca_jax import SamplingParams
from orca_jax.engine.engine import LLMEngine

ENGINE_FLAGS = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=8, num_pages=32, max_model_len=128)
START_TIMEOUT_S = 240
REQUESTS = [  # (prompt token ids, sampling fields): greedy, and seeded random sampling
    ([5, 17, 99, 3, 42], dict(temperature=0.0)),
    (list(range(10, 33)), dict(temperature=0.0)),  # longer than the 16-token budget: chunked
    ([7, 7, 7, 8], dict(temperature=0.8, top_p=0.9, seed=11)),
    ([300, 200, 100], dict(temperature=1.0, seed=5)),
]
MAX_TOKENS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(model: str, process_id: int, coordinator: str, http_port: int, log,
                  layout: tuple[str, ...] = ("--tensor-parallel-size", "2"), devices: int = 1) -> subprocess.Popen:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()]
    cmd = [sys.executable, "-m", "orca_jax.cli", "--log-level", "INFO", "serve", "--model", model,
           *layout, *flags, "--coordinator-address", coordinator,
           "--num-processes", "2", "--process-id", str(process_id), "--port", str(http_port)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(url: str, processes: list[subprocess.Popen], logs) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for p, log in zip(processes, logs):
            if p.poll() is not None:
                pytest.fail(f"process exited early with {p.returncode}:\n{_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"server not healthy after {START_TIMEOUT_S} s:\n{_tail(logs[0])}\n{_tail(logs[1])}")


def kill_all(processes: list[subprocess.Popen], logs) -> None:
    """Whatever a test left running is killed, and the logs closed."""
    for p in processes:
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in logs:
        log.close()


def _tail(log) -> str:
    log.flush()
    return open(log.name).read()[-3000:]


def complete(url: str, model: str, prompt: list[int], fields: dict) -> str:
    body = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def one_process_texts(model: str) -> list[str]:
    # One step at a time here; the two-process server overlaps steps (the default): the
    # texts must agree across both the process count and the scheduling mode.
    engine = LLMEngine(model=model, warmup=False, async_scheduling=False, **ENGINE_FLAGS)
    for i, (prompt, fields) in enumerate(REQUESTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **fields))
    texts = {}
    while engine.has_unfinished_requests():
        texts.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
    return [texts[str(i)] for i in range(len(REQUESTS))]


def test_two_processes_serve_like_one_and_stop_together(tiny_llama_dir, tmp_path):
    model = str(tiny_llama_dir)
    coordinator, http_port = f"127.0.0.1:{free_port()}", free_port()
    logs = [open(tmp_path / f"process{i}.log", "w") for i in range(2)]
    processes = [start_process(model, i, coordinator, http_port, logs[i]) for i in (1, 0)][::-1]
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_healthy(url, processes, logs)
        # Concurrent requests, so that steps mix them (prefill chunks next to decodes).
        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            served = list(pool.map(lambda r: complete(url, model, *r), REQUESTS))
        assert served == one_process_texts(model)
        assert all(served)

        processes[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in processes]
        assert codes == [0, 0], f"{_tail(logs[0])}\n{_tail(logs[1])}"
        follower_log = _tail(logs[1])
        assert "process 1 of 2" in follower_log and "stop received" in follower_log
    finally:
        kill_all(processes, logs)


@pytest.mark.parametrize("layout,replicas", [(("--data-parallel-size", "4"), ([0, 1], [2, 3])),
                                             (("-dp", "2", "-pp", "2"), ([0], [1]))], ids=["dp4", "dp2_pp2"])
def test_data_parallel_hosts_each_serve_their_own_replicas(tiny_llama_dir, tmp_path, layout, replicas):
    """Two processes of 2 devices: each host serves replicas of its own (`-dp 4`: 0-1 and 2-3;
    `-dp 2 -pp 2`: one pipeline each, process 1's scheduled by process 1) on its own port, with
    one process's outputs; each stops on its own SIGTERM."""
    model = str(tiny_llama_dir)
    coordinator, ports = f"127.0.0.1:{free_port()}", [free_port(), free_port()]
    logs = [open(tmp_path / f"process{i}.log", "w") for i in range(2)]
    processes = [start_process(model, i, coordinator, ports[i], logs[i], layout, devices=2) for i in range(2)]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url in urls:
            wait_healthy(url, processes, logs)
        expected = one_process_texts(model)
        for url in urls:
            with ThreadPoolExecutor(len(REQUESTS)) as pool:
                assert list(pool.map(lambda r: complete(url, model, *r), REQUESTS)) == expected
        for url, own in zip(urls, replicas):
            labelled = set(re.findall(r'^orca_engine_steps_total{replica="(\d+)"}', httpx.get(f"{url}/metrics").text,
                                      re.M))
            assert labelled == {str(r) for r in own}
        for p in processes:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in processes]
        assert codes == [0, 0], f"{_tail(logs[0])}\n{_tail(logs[1])}"
    finally:
        kill_all(processes, logs)


# ---- start-up rules, in-process ---------------------------------------------------------------
def test_serve_flags_parse():
    from orca_jax.cli import build_parser

    args = build_parser().parse_args(["serve", "--coordinator-address", "10.0.0.1:1234", "--num-processes", "2",
                                      "--process-id", "1"])
    assert (args.coordinator_address, args.num_processes, args.process_id) == ("10.0.0.1:1234", 2, 1)


@pytest.mark.parametrize("env,flags,wanted", [
    ({}, (None, None), False),  # one process: jax.distributed is not started
    ({}, ("10.0.0.1:1234", None), True),
    ({}, (None, 4), True),  # e.g. a TPU slice where JAX finds the rest itself
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, (None, None), True),
    ({"TPU_WORKER_HOSTNAMES": "t1k-w-0,t1k-w-1"}, (None, None), True),  # Cloud TPU VM, 2 hosts
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, (None, None), False),  # single-host TPU VM
])
def test_distributed_start_is_wanted_only_when_asked(monkeypatch, env, flags, wanted):
    from orca_jax.worker import multihost

    for name in ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert multihost.wants_distributed(*flags) is wanted


def test_no_step_is_sent_after_stop(monkeypatch):
    """Once the followers were told to stop, a late step raises instead of broadcasting to
    processes that already left (which would hang); stop itself is sent once."""
    from orca_jax.worker import multihost
    from orca_jax.config import EngineConfig

    sent = []
    monkeypatch.setattr(multihost.multihost_utils, "broadcast_one_to_all", lambda x: sent.append(x) or x)
    channel = multihost.StepChannel(EngineConfig())
    channel.send_stop()
    channel.send_stop()
    assert len(sent) == 1 and list(sent[0]) == [0, 1]  # one header: (0 tokens, stop)
    with pytest.raises(RuntimeError, match="after the followers were stopped"):
        channel.send(object())  # refused before the batch is looked at
    assert len(sent) == 1
