"""`bench serve` against orca_jax's own server (tiny random Llama, 127.0.0.1): every request
streams to its drawn length and the report carries TTFT, TPOT, ITL and end-to-end latency."""

from __future__ import annotations

import json
import socket

import pytest

from orca_jax import cli
from orca_jax.entrypoints.server import ServerSettings, build_app


@pytest.fixture(scope="module")
def server_url(tiny_engine_factory, serve_in_thread):
    engine = tiny_engine_factory(max_num_seqs=4, max_num_batched_tokens=16, page_size=8, num_pages=64,
                                 max_model_len=64)
    _, app = build_app(engine, ServerSettings("tiny-llama"), max_waiting_requests=64)
    with serve_in_thread(app) as url:
        yield url, engine


def test_bench_serve_replays_the_trace(server_url, tmp_path, capsys):
    url, engine = server_url
    out = tmp_path / "serve.json"
    code = cli.main(["bench", "serve", "--base-url", url, "--num-requests", "8", "--rate", "40", "--scale", "0.05",
                     "--vocab-size", "512", "--min-token-id", "3", "--no-progress", "--json", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["model"] == "tiny-llama"  # asked the server
    assert record["completed"] == 8 and record["failed"] == 0 and record["requests_with_unexpected_length"] == []
    s = record["summary"]
    assert s["output_tokens"] == record["trace"]["useful_output_tokens"]
    for key in ("ttft_ms", "e2e_ms", "itl_ms", "normalized_latency_ms"):
        assert 0 < s[key]["p50"] <= s[key]["p99"], key
    assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
    assert s["requests_per_s"] > 0 and s["output_tokens_per_s"] > 0
    assert record["trace"]["rate"] == 40.0 and "--rate 40.0" in record["command"]
    assert engine.allocator.num_used == 0
    assert "inter-token latency" in capsys.readouterr().out


def test_unreachable_server_is_counted_as_failures(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    code = cli.main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--served-model", "m",
                     "--num-requests", "2", "--scale", "0.05", "--vocab-size", "512", "--no-progress"])
    assert code == 1


def test_bench_serve_without_a_vocabulary_asks_the_server(server_url, capsys):
    """No --tokenizer, no --vocab-size: the prompt ids come from the served model's own
    vocabulary (listed in /v1/models), never from a fixed range that may not fit it."""
    from orca_jax.bench.serve_client import ServeTarget, served_vocabulary

    url, engine = server_url
    vocab = served_vocabulary(ServeTarget(url))
    assert vocab.size == engine.model_config.vocab_size
    assert set(vocab.excluded) == set(engine.tokenizer.all_special_ids) and vocab.excluded
    code = cli.main(["bench", "serve", "--base-url", url, "--num-requests", "3", "--scale", "0.05", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"prompt token ids: {vocab.size} ({len(vocab.excluded)} excluded), from {url}/v1/models" in out


def test_bench_serve_says_what_to_pass_when_the_vocabulary_is_unknown(tmp_path, capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    code = cli.main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-requests", "2",
                     "--no-progress"])
    assert code == 2
    assert "pass --tokenizer or --vocab-size" in capsys.readouterr().err
