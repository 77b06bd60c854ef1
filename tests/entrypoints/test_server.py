"""The OpenAI-compatible server, in process on 127.0.0.1, driven by the official `openai` client
and by raw HTTP: completions and chat (streamed and not), sampling options, usage, 15+ kinds
of bad input, disconnects, a failing step, a full queue, compiles, and a bounded load test.

One server (uvicorn on a background thread, the tiny random Llama) serves the whole module;
every test leaves it idle with all KV pages back in the pool.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orca_jax.engine.async_engine import AsyncLLMEngine
from orca_jax.worker.compile_guard import no_compiles
from orca_jax.engine.engine import LLMEngine
from orca_jax.entrypoints.server import ServerSettings, build_app

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 64 * 1024
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Paris is the capital of"}]


@dataclass
class LiveServer:
    url: str
    engine: LLMEngine
    async_engine: AsyncLLMEngine
    wait_idle: Callable[[], None]  # until nothing runs or waits and every KV page is free

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60, **kw)

    def post(self, path: str, body, timeout: float = 60) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=content, timeout=timeout,
                          headers={"Content-Type": "application/json"})

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{label="v"}': value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples


@pytest.fixture(scope="module")
def live(tiny_engine_factory, serve_in_thread, server_idle_waiter):
    engine = tiny_engine_factory(max_num_seqs=8, max_num_batched_tokens=32, page_size=8, num_pages=128,
                                 max_model_len=MAX_MODEL_LEN)
    async_engine, app = build_app(engine, ServerSettings(MODEL, max_request_bytes=MAX_REQUEST_BYTES),
                                  max_waiting_requests=64)
    with serve_in_thread(app) as url:
        yield LiveServer(url, engine, async_engine, server_idle_waiter(async_engine))


@pytest.fixture(autouse=True)
def server_left_idle(live):
    yield
    live.wait_idle()


# ---- the openai client -------------------------------------------------------------------------
def test_models_and_health(live):
    assert [m.id for m in live.client().models.list().data] == [MODEL]
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}


def test_metrics_exposes_every_series(live):
    live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    samples = live.metrics()
    expected = [
        'orca_requests_total{finish_reason="length"}', 'orca_requests_total{finish_reason="abort"}',
        "orca_time_to_first_token_seconds_count", "orca_time_per_output_token_seconds_count",
        "orca_e2e_request_latency_seconds_count", "orca_num_requests_running", "orca_num_requests_waiting",
        "orca_kv_cache_usage_ratio", "orca_kv_pages_used", "orca_kv_pages_total", "orca_num_preemptions_total",
        "orca_engine_steps_total", "orca_prompt_tokens_total", "orca_generation_tokens_total",
        "orca_prefix_cache_queries_total", "orca_prefix_cache_hits_total", "orca_prefix_cache_pages",
        "orca_spec_decode_num_drafts_total", "orca_spec_decode_num_draft_tokens_total",
        "orca_spec_decode_num_accepted_tokens_total", "orca_spec_decode_mean_acceptance_length",
    ]
    assert [name for name in expected if name not in samples] == []
    assert samples['orca_requests_total{finish_reason="length"}'] >= 1
    assert samples["orca_time_per_output_token_seconds_count"] >= 1
    assert samples["orca_kv_pages_total"] == live.engine.allocator.num_usable


def test_completion_usage_counts(live):
    tokenizer = live.engine.tokenizer
    out = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(live):
    """A prompt of 40 tokens, twice: the second finds 4 full pages of 8 (the last page is
    always computed), as usage and the Prometheus counters both say."""
    live.engine.reset_prefix_cache()
    prompt = list(range(50, 90))
    client = live.client()
    before = live.metrics()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    assert second.choices[0].text == first.choices[0].text
    after = live.metrics()
    assert after["orca_prefix_cache_queries_total"] - before["orca_prefix_cache_queries_total"] == 80
    assert after["orca_prefix_cache_hits_total"] - before["orca_prefix_cache_hits_total"] == 32
    assert after["orca_prefix_cache_pages"] >= 4


def test_cache_salt_keeps_prefix_cache_pages_apart(live):
    """vLLM's cache_salt: the same 40-token prompt under salts "a", "b" and none finds nothing
    of the others' pages; under "a" again it finds its own 4 full pages, as usage says; a chat
    request's salt works the same way."""
    live.engine.reset_prefix_cache()
    prompt = list(range(100, 140))
    client = live.client()

    def cached(**salt) -> int:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, extra_body=salt)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="a") == 0
    assert cached(cache_salt="b") == 0, "salt b found salt a's pages"
    assert cached() == 0, "an unsalted request found salted pages"
    assert cached(cache_salt="a") == 32 and cached() == 32 and cached(cache_salt="b") == 32
    messages = [{"role": "user", "content": "Paris is the capital of France, and Berlin is the capital of " * 3}]

    def chat_cached(salt: str) -> int:
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                             extra_body={"cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens

    assert chat_cached("x") == 0 and chat_cached("y") == 0
    assert chat_cached("x") > 0


def test_chat_completion_uses_the_chat_template(live):
    tokenizer = live.engine.tokenizer
    out = live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                                extra_body={"ignore_eos": True})
    templated = tokenizer.encode("<s>user: Paris is the capital of</s><s>assistant: ", add_special_tokens=False)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.usage.prompt_tokens == len(templated) and out.usage.completion_tokens == 6


def test_streamed_chat_assembles_to_the_non_streamed_text(live):
    client = live.client()
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    choice_chunks = [c for c in chunks if c.choices]
    assert choice_chunks[0].choices[0].delta.role == "assistant"
    assert choice_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert len(choice_chunks) > 3, "streamed in pieces"
    text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_streamed_completion_assembles_to_the_non_streamed_text(live):
    client = live.client()
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_string_ends_the_text_before_it(live):
    client = live.client()
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    assert stop.strip(), f"need a visible stop string from {free!r}"
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == free[:free.index(stop)]


def test_n_two_returns_two_choices(live):
    out = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=3,
                                           extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.choices[0].text != out.choices[1].text  # distinct samples
    assert out.usage.completion_tokens == 16
    chat = live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2, seed=3,
                                                 extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_completion_logprobs(live):
    out = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) == 3
        assert chosen == pytest.approx(max(top.values()))  # greedy takes the most likely token
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_and_echo(live):
    chat = live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                                 logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    echoed = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(PROMPT) and len(echoed.choices[0].text) > len(PROMPT)


def test_seed_reproducibility(live):
    client = live.client()

    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_several_prompts_and_token_id_prompts(live):
    ids = live.engine.tokenizer.encode(PROMPT)
    out = live.client().completions.create(model=MODEL, prompt=[PROMPT, "Paris is"], max_tokens=4, n=2, temperature=0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in out.choices}
    assert by_index[0] == by_index[1]  # greedy: both samples of one prompt agree
    as_ids = live.client().completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert as_ids.choices[0].text == by_index[0]
    assert as_ids.usage.prompt_tokens == len(ids)


# ---- bad input ---------------------------------------------------------------------------------
def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


BAD_REQUESTS = [
    # (id, path, body, status, param)
    ("malformed-json", "/v1/completions", b'{"model": "tiny-llama", "prompt": ', 400, None),
    ("body-not-object", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("missing-prompt", "/v1/completions", without(completion(), "prompt"), 400, "prompt"),
    ("missing-model", "/v1/completions", without(completion(), "model"), 400, "model"),
    ("unknown-model", "/v1/completions", completion(model="gpt-17"), 404, "model"),
    ("max-tokens-string", "/v1/completions", completion(max_tokens="ten"), 400, "max_tokens"),
    ("max-tokens-zero", "/v1/completions", completion(max_tokens=0), 400, "max_tokens"),
    ("temperature-negative", "/v1/completions", completion(temperature=-0.5), 400, "temperature"),
    ("top-p-over-one", "/v1/completions", completion(top_p=1.5), 400, "top_p"),
    ("top-k-below-minus-one", "/v1/completions", completion(top_k=-2), 400, "top_k"),
    ("n-zero", "/v1/completions", completion(n=0), 400, "n"),
    ("presence-penalty-range", "/v1/completions", completion(presence_penalty=3.0), 400, "presence_penalty"),
    ("seed-float", "/v1/completions", completion(seed=1.5), 400, "seed"),
    ("stop-wrong-type", "/v1/completions", completion(stop=5), 400, "stop"),
    ("prompt-wrong-type", "/v1/completions", completion(prompt={"text": "hi"}), 400, "prompt"),
    ("prompt-empty", "/v1/completions", completion(prompt=""), 400, "prompt"),
    ("prompt-over-context", "/v1/completions", completion(prompt=[5] * (MAX_MODEL_LEN + 10)), 400, "prompt"),
    ("token-id-out-of-vocab", "/v1/completions", completion(prompt=[1, 2, 10**6]), 400, "prompt"),
    ("logprobs-over-limit", "/v1/completions", completion(logprobs=50), 400, "logprobs"),
    ("stream-options-without-stream", "/v1/completions", completion(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("logit-bias-not-a-token-id", "/v1/completions", completion(logit_bias={"five": 1.0}), 400, "logit_bias"),
    ("cache-salt-empty", "/v1/completions", completion(cache_salt=""), 400, "cache_salt"),
    ("cache-salt-number", "/v1/completions", completion(cache_salt=5), 400, "cache_salt"),
    ("chat-cache-salt-empty", "/v1/chat/completions", chat(cache_salt=""), 400, "cache_salt"),
    ("chat-cache-salt-list", "/v1/chat/completions", chat(cache_salt=["a"]), 400, "cache_salt"),
    ("messages-missing", "/v1/chat/completions", without(chat(), "messages"), 400, "messages"),
    ("messages-empty", "/v1/chat/completions", chat(messages=[]), 400, "messages"),
    ("message-bad-role", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages.0.role"),
    ("message-content-number", "/v1/chat/completions", chat(messages=[{"role": "user", "content": 7}]), 400,
     "messages.0.content"),
    ("chat-unknown-model", "/v1/chat/completions", chat(model="nope"), 404, "model"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat-over-context", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "fox " * MAX_MODEL_LEN}]), 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_input_is_a_400_naming_the_field(live, path, body, status, param):
    response = live.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if param:
        assert param.split(".")[0] in error["message"]


# Gemma 2's template as google/gemma-2-*-it ships it (abridged to its checks and turns): it
# refuses a system message with the template's own exception.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


def test_a_template_refusing_the_messages_is_a_400_with_its_own_message(live, monkeypatch):
    # The server renders with its own copy of the tokenizer, so the template is swapped on the class.
    monkeypatch.setattr(type(live.engine.tokenizer), "get_chat_template", lambda self, *_: GEMMA2_TEMPLATE)
    refused = live.post("/v1/chat/completions", chat(messages=[{"role": "system", "content": "Be brief."}, *CHAT]))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "messages" and "System role not supported" in error["message"]
    served = live.post("/v1/chat/completions", chat(messages=CHAT, max_tokens=2))
    assert served.status_code == 200, served.text


def test_server_is_healthy_after_bad_input(live):
    for _, path, body, _, _ in BAD_REQUESTS:
        live.post(path, body)
    live.wait_idle()
    assert httpx.get(f"{live.url}/health").status_code == 200
    out = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_transport_errors_have_openai_bodies(live):
    too_big = live.post("/v1/completions", completion(prompt="x" * (MAX_REQUEST_BYTES + 1)))
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    missing = httpx.get(f"{live.url}/v1/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong_method = httpx.get(f"{live.url}/v1/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_openai_client_raises_bad_request(live):
    with pytest.raises(openai.BadRequestError) as info:
        live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=9)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"


# ---- faults ------------------------------------------------------------------------------------
def slow_steps(monkeypatch, engine, seconds: float) -> None:
    real_execute = engine.runner.dispatch

    def slow(batch):
        time.sleep(seconds)
        return real_execute(batch)

    monkeypatch.setattr(engine.runner, "dispatch", slow)


def test_client_disconnect_mid_stream_returns_its_pages(live, monkeypatch):
    slow_steps(monkeypatch, live.engine, 0.01)  # 200 tokens would take 2 s: the disconnect comes first
    before = live.metrics()
    pages_before = live.async_engine.stats().kv_pages_used
    body = completion(max_tokens=200, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                assert live.async_engine.stats().kv_pages_used > pages_before
                break
    live.wait_idle()
    after = live.metrics()
    assert live.async_engine.stats().kv_pages_used == pages_before
    aborted = after['orca_requests_total{finish_reason="abort"}'] - before['orca_requests_total{finish_reason="abort"}']
    assert aborted >= 1


def test_disconnect_of_a_non_streamed_request_aborts_it(live, monkeypatch):
    slow_steps(monkeypatch, live.engine, 0.01)
    before = live.metrics()['orca_requests_total{finish_reason="abort"}']
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.5 s of a 2 s generation
        live.post("/v1/completions", completion(max_tokens=200, ignore_eos=True), timeout=0.5)
    live.wait_idle()
    assert live.metrics()['orca_requests_total{finish_reason="abort"}'] == before + 1


def test_failed_step_is_a_500_and_the_server_recovers(live, monkeypatch):
    real_execute = live.engine.runner.dispatch
    calls = {"n": 0}

    def fail_first(batch):
        calls["n"] += 1
        if calls["n"] <= 2:  # the non-streamed request's step, then the streamed one's
            raise RuntimeError("injected device fault")
        return real_execute(batch)

    monkeypatch.setattr(live.engine.runner, "dispatch", fail_first)
    failed = live.post("/v1/completions", completion())
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error"
    assert "injected device fault" in failed.json()["error"]["message"]
    with pytest.raises(openai.APIError, match="injected device fault"):
        list(live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stream=True))
    live.wait_idle()
    ok = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")
    assert live.metrics()['orca_requests_total{finish_reason="error"}'] >= 2


def test_full_waiting_queue_is_a_503_with_retry_after(live, monkeypatch):
    gate = threading.Event()
    real_step = live.engine.step

    def gated_step():
        gate.wait(10)
        return real_step()

    monkeypatch.setattr(live.engine, "step", gated_step)
    monkeypatch.setattr(live.async_engine, "max_waiting_requests", 1)
    first = {}
    thread = threading.Thread(target=lambda: first.update(r=live.post("/v1/completions", completion())))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while live.async_engine.stats().num_waiting < 1:  # queued, its step held at the gate
            assert time.monotonic() < deadline
            time.sleep(0.01)
        rejected = live.post("/v1/completions", completion())
        assert rejected.status_code == 503
        assert rejected.headers["Retry-After"] == "1"
        assert rejected.json()["error"]["code"] == "queue_full"
    finally:
        gate.set()
        thread.join(30)
    assert first["r"].status_code == 200
    assert live.metrics()['orca_requests_rejected_total{reason="queue_full"}'] >= 1


# ---- compiles and load -----------------------------------------------------------------------
def test_serving_mixed_requests_compiles_nothing(live):
    client = live.client()
    with no_compiles("serving mixed requests"):
        client.completions.create(model=MODEL, prompt=PROMPT * 12, max_tokens=10, temperature=0)  # chunked prefill
        client.completions.create(model=MODEL, prompt=[PROMPT, "Paris"], max_tokens=6, n=2, temperature=0.8,
                                  top_p=0.9, seed=1, logprobs=2, presence_penalty=0.5, frequency_penalty=0.5)
        list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, stream=True,
                                            extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2}))
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=3)


def test_load_200_requests_at_32_concurrent(live, capsys):
    """Bounded load on loopback: every request completes, no page leaks, /metrics agrees."""
    total, concurrency = 200, 32
    rng = random.Random(0)
    words = "the quick brown fox jumps over the lazy dog paris berlin capital batching".split()
    jobs = [(rng.random() < 0.5, " ".join(rng.choices(words, k=rng.randint(2, 40))), rng.randint(2, 24),
             rng.random() < 0.3) for _ in range(total)]
    before = live.metrics()

    async def one(client: httpx.AsyncClient, sem, job):
        is_chat, prompt, max_tokens, stream = job
        body = ({"model": MODEL, "messages": [{"role": "user", "content": prompt}]} if is_chat
                else {"model": MODEL, "prompt": prompt})
        body.update(max_tokens=max_tokens, temperature=0.7, stream=stream)
        if stream:
            body["stream_options"] = {"include_usage": True}
        path = "/v1/chat/completions" if is_chat else "/v1/completions"
        async with sem:
            started = time.perf_counter()
            if stream:
                usage = None
                async with client.stream("POST", path, json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            usage = json.loads(line[6:]).get("usage") or usage
            else:
                response = await client.post(path, json=body)
                assert response.status_code == 200, response.text
                usage = response.json()["usage"]
            return time.perf_counter() - started, usage

    async def main():
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=live.url, timeout=120, limits=limits) as client:
            started = time.perf_counter()
            results = await asyncio.wait_for(asyncio.gather(*(one(client, sem, j) for j in jobs)), timeout=300)
            return results, time.perf_counter() - started

    results, wall = asyncio.run(main())
    latencies = sorted(r[0] for r in results)
    generated = sum(r[1]["completion_tokens"] for r in results)
    prompt_tokens = sum(r[1]["prompt_tokens"] for r in results)
    p50, p99 = statistics.median(latencies), latencies[int(0.99 * (len(latencies) - 1))]
    with capsys.disabled():  # shown in the CI log, not captured
        print(f"\nload: {total} requests, {concurrency} concurrent, {wall:.2f} s, {total / wall:.1f} req/s, "
              f"{generated / wall:.0f} generated tok/s; latency p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")
    assert len(results) == total
    live.wait_idle()
    after = live.metrics()

    def delta(name):
        return after[name] - before[name]

    finished = sum(delta(f'orca_requests_total{{finish_reason="{r}"}}') for r in ("stop", "length", "abort", "error"))
    assert finished == total
    assert delta('orca_requests_total{finish_reason="abort"}') == 0 == delta('orca_requests_total{finish_reason="error"}')
    assert delta("orca_generation_tokens_total") == generated
    assert delta("orca_prompt_tokens_total") == prompt_tokens
    assert delta("orca_e2e_request_latency_seconds_count") == total
    assert delta("orca_time_to_first_token_seconds_count") == total
    assert after["orca_num_requests_running"] == 0 and after["orca_num_requests_waiting"] == 0
    assert after["orca_kv_pages_used"] == 0 and after["orca_kv_cache_usage_ratio"] == 0
