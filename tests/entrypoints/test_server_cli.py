"""`orca-jax serve` as a user runs it: a separate process on 127.0.0.1 with an API key, a small
body limit, and a clean shutdown on SIGTERM / SIGINT while streams are live."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
KEY = "test-key-123"
MODEL = "tiny"


class ServerProcess:
    """`python -m orca_jax.cli serve ... --port 0`; the port is read from uvicorn's log line."""

    def __init__(self, model_dir: Path, *extra: str, env: dict[str, str] | None = None):
        command = [sys.executable, "-m", "orca_jax.cli", "--log-level", "INFO", "serve", "--model", str(model_dir),
                   "--served-model-name", MODEL, "--port", "0", "--max-num-seqs", "2",
                   "--max-num-batched-tokens", "16", "--page-size", "8", "--num-pages", "160",
                   "--max-model-len", "512", *extra]
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
        env.pop("ORCA_JAX_API_KEY", None)
        self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self._port = threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()
        if not self._port.wait(120):
            self.stop()
            raise AssertionError("server did not start:\n" + "".join(self.log[-30:]))
        self.url = f"http://127.0.0.1:{self.port}"

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if match:
                self.port = int(match[1])
                self._port.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    process = ServerProcess(tiny_llama_dir, "--api-key", KEY, "--max-request-bytes", "2048")
    yield process
    process.stop()


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def completion_body(**fields) -> dict:
    return {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 4, **fields}


def test_api_key_is_enforced_on_the_api(server):
    url = f"{server.url}/v1/completions"
    for headers in ({}, auth("wrong-key"), {"Authorization": KEY}):
        response = httpx.post(url, json=completion_body(), headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="Paris", max_tokens=3).choices[0].text is not None
    # Probes and scrapers need no key.
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "orca_requests_total" in httpx.get(f"{server.url}/metrics").text


def test_binds_to_loopback_only_by_default(server):
    """The listening socket's local address is 127.0.0.1 (not 0.0.0.0), per the kernel."""
    port_hex = f"{server.port:04X}"
    listening = [line.split()[1] for line in Path(f"/proc/{server.proc.pid}/net/tcp").read_text().splitlines()[1:]
                 if line.split()[1].endswith(f":{port_hex}") and line.split()[3] == "0A"]
    assert listening == [f"0100007F:{port_hex}"]


def test_oversized_bodies_are_refused(server):
    big = json.dumps(completion_body(prompt="x" * 4096))
    declared = httpx.post(f"{server.url}/v1/completions", content=big, headers=auth())
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit must hold while the body streams in
        for start in range(0, len(big), 512):
            yield big[start:start + 512].encode()

    chunked = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=auth())
    assert chunked.status_code == 413
    assert httpx.post(f"{server.url}/v1/completions", json=completion_body(), headers=auth()).status_code == 200


def read_stream(url: str, results: list, index: int, first_chunk: threading.Event) -> None:
    """Collect one streamed completion's finish reason, or the error that ended it."""
    body = completion_body(max_tokens=480, ignore_eos=True, stream=True)
    reason = None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth(), timeout=60) as response:
            if response.status_code != 200:
                results[index] = f"status {response.status_code}"
                return
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    first_chunk.set()
                    choice = json.loads(line[6:])["choices"][0]
                    reason = choice["finish_reason"] or reason
                elif line == "data: [DONE]":
                    results[index] = reason
                    return
        results[index] = f"ended without [DONE] ({reason})"
    except httpx.HTTPError as exc:
        results[index] = f"error: {type(exc).__name__}"


def start_long_streams(url: str, count: int) -> tuple[list, list[threading.Thread]]:
    """`count` streamed completions read on their own threads, once the first chunk arrived:
    (their finish reasons as they end, the reader threads)."""
    results: list = [None] * count
    first_chunk = threading.Event()
    readers = [threading.Thread(target=read_stream, args=(url, results, i, first_chunk)) for i in range(count)]
    for reader in readers:
        reader.start()
    assert first_chunk.wait(60), "no stream started"
    return results, readers


def wait_for_gauges(url: str, running, waiting, timeout: float = 30) -> None:
    """Until the gauges read `running` and `waiting`: numbers, or with data-parallel replicas
    lists of one number per replica (their `replica` labels in order)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics").text
        now = {name: _gauge(text, name, per_replica=isinstance(running, list))
               for name in ("orca_num_requests_running", "orca_num_requests_waiting")}
        if now == {"orca_num_requests_running": running, "orca_num_requests_waiting": waiting}:
            return
        assert time.monotonic() < deadline, f"gauges never reached running={running} waiting={waiting}: {now}"
        time.sleep(0.02)


def _gauge(text: str, name: str, per_replica: bool):
    if not per_replica:
        return float(re.search(rf"^{name} (\S+)$", text, re.M)[1])
    return [float(v) for v in re.findall(rf'^{name}{{replica="\d+"}} (\S+)$', text, re.M)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_aborts_live_streams_and_exits_cleanly(tiny_llama_dir, sig):
    process = ServerProcess(tiny_llama_dir, "--api-key", KEY)
    try:
        # Four long streams on a 2-sequence engine: two run, two wait, none can finish soon.
        results, readers = start_long_streams(process.url, 4)
        wait_for_gauges(process.url, running=2, waiting=2)
        started = time.monotonic()
        process.proc.send_signal(sig)
        code = process.proc.wait(30)
        for reader in readers:
            reader.join(30)
        assert code == 0, "".join(process.log[-20:])
        assert time.monotonic() - started < 15
        assert results == ["abort"] * len(results), results
    finally:
        process.stop()


def test_data_parallel_server_spreads_streams_and_stops_every_replica_on_sigterm(tiny_llama_dir):
    """`serve -dp 2` on 2 forced host devices: four long streams run two on each replica (none
    waits), /metrics labels each replica, and SIGTERM aborts all four and exits 0."""
    process = ServerProcess(tiny_llama_dir, "--api-key", KEY, "-dp", "2",
                            env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    try:
        assert any("data parallelism: 2 replicas" in line for line in process.log), "".join(process.log[-20:])
        results, readers = start_long_streams(process.url, 4)
        wait_for_gauges(process.url, running=[2, 2], waiting=[0, 0])
        process.proc.send_signal(signal.SIGTERM)
        code = process.proc.wait(30)
        for reader in readers:
            reader.join(30)
        assert code == 0, "".join(process.log[-20:])
        assert results == ["abort"] * len(results), results
    finally:
        process.stop()
