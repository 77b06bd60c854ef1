"""Hostile requests against the server: each fails alone, with a 4xx naming the field.

Every bad request here is sent while a well-formed streamed request is running (its steps are
slowed so that it spans the bad one); that stream must finish with exactly the tokens it gets
alone. Values that are extreme but valid (a top_k of 10**12, a seed of 10**30) must be served,
in the same steps as the stream, without disturbing it.

One server (the tiny random Llama, max_model_len 128, an API key) serves the module; every test
leaves it idle with all KV pages back in the pool.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest

from orca_jax.engine.async_engine import AsyncLLMEngine
from orca_jax.engine.engine import LLMEngine
from orca_jax.entrypoints.server import ServerSettings, build_app

MODEL = "tiny-llama"
API_KEY = "test-key"
MAX_MODEL_LEN = 128
MAX_WAITING = 64
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Paris is the capital of"}]
STREAM_TOKENS = 30


@dataclass
class Server:
    url: str
    engine: LLMEngine
    async_engine: AsyncLLMEngine
    wait_idle: Callable[[], None]  # until nothing runs or waits and every KV page is free

    def post(self, path: str, body, *, auth: str = f"Bearer {API_KEY}", timeout: float = 60) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=content, timeout=timeout,
                          headers={"Content-Type": "application/json", "Authorization": auth})


@pytest.fixture(scope="module")
def server(tiny_engine_factory, serve_in_thread, server_idle_waiter):
    engine = tiny_engine_factory(max_num_seqs=8, max_num_batched_tokens=32, page_size=8, num_pages=128,
                                 max_model_len=MAX_MODEL_LEN)
    # The default body limit (1 MiB), so that big hostile bodies reach the parser.
    async_engine, app = build_app(engine, ServerSettings(MODEL, api_key=API_KEY), max_waiting_requests=MAX_WAITING)
    with serve_in_thread(app) as url:
        yield Server(url, engine, async_engine, server_idle_waiter(async_engine))


@pytest.fixture(autouse=True)
def server_left_idle(server):
    yield
    server.wait_idle()
    assert not server.engine.requests, list(server.engine.requests)


def stream_body() -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}


@pytest.fixture(scope="module")
def stream_reference(server) -> str:
    """The stream's text when it runs alone."""
    body = dict(stream_body(), stream=False)
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


class BackgroundStream:
    """A well-formed streamed completion on a thread; `started` is set at its first token."""

    def __init__(self, server: Server):
        self.server = server
        self.started = threading.Event()
        self.events: list[dict] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            headers = {"Authorization": f"Bearer {API_KEY}"}
            with httpx.stream("POST", f"{self.server.url}/v1/completions", json=stream_body(), headers=headers,
                              timeout=60) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.events.append(json.loads(line[len("data: "):]))
                        self.started.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.started.set()

    def text(self) -> str:
        assert self.error is None, self.error
        assert not [e for e in self.events if "error" in e], self.events
        return "".join(e["choices"][0]["text"] for e in self.events)

    def finish_reason(self) -> str | None:
        return self.events[-1]["choices"][0]["finish_reason"] if self.events else None


@pytest.fixture
def concurrent_stream(server, stream_reference, monkeypatch):
    """A stream that runs while the test sends its request, and must end undisturbed."""
    real_execute = server.engine.runner.dispatch

    def slow(batch):  # 30 steps of 10 ms: the stream spans the test's request
        time.sleep(0.01)
        return real_execute(batch)

    monkeypatch.setattr(server.engine.runner, "dispatch", slow)
    stream = BackgroundStream(server)
    stream.thread.start()
    assert stream.started.wait(30)
    yield stream
    stream.thread.join(60)
    assert not stream.thread.is_alive()
    assert stream.text() == stream_reference, "the well-formed stream was disturbed"
    assert stream.finish_reason() == "length"


def assert_openai_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    if param:
        assert param.split(".")[0] in error["message"], error
    if code is not None:
        assert error["code"] == code, error
    return error


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}


def raw_completion(fragment: str) -> bytes:
    """A body with one field written as raw JSON text (values json.dumps cannot produce)."""
    return ('{"model": "%s", "prompt": "%s", "max_tokens": 4, %s}' % (MODEL, PROMPT, fragment)).encode()


HOSTILE = [
    # (id, path, body, status, param, code)
    ("prompt-negative-id", "/v1/completions", completion(prompt=[-1]), 400, "prompt", None),
    ("prompt-negative-id-in-second-list", "/v1/completions", completion(prompt=[[1, 2], [3, -5]]), 400, "prompt",
     None),
    ("prompt-id-2-to-the-32", "/v1/completions", completion(prompt=[4294967296]), 400, "prompt", None),
    ("prompt-id-10-to-the-30", "/v1/completions", completion(prompt=[10**30]), 400, "prompt", None),
    ("prompt-id-bool", "/v1/completions", completion(prompt=[True]), 400, "prompt", None),
    ("nested-brackets", "/v1/completions", b"[" * 200_000, 400, None, "invalid_json"),
    ("nested-prompt", "/v1/completions", raw_completion('"x": ' + "[" * 100 + "]" * 100), 400, "x", "invalid_json"),
    ("integer-of-5000-digits", "/v1/completions", raw_completion('"seed": ' + "9" * 5000), 400, None, "invalid_json"),
    ("nan-literal", "/v1/completions", raw_completion('"temperature": NaN'), 400, None, "invalid_json"),
    ("temperature-overflows-to-inf", "/v1/completions", raw_completion('"temperature": 1e400'), 400, "temperature",
     None),
    ("max-tokens-past-context", "/v1/completions", completion(max_tokens=100_000), 400, "max_tokens",
     "context_length_exceeded"),
    ("max-tokens-one-past-context", "/v1/completions", completion(prompt=[5] * 100, max_tokens=29), 400,
     "max_tokens", "context_length_exceeded"),
    ("chat-max-tokens-past-context", "/v1/chat/completions", chat(max_tokens=100_000), 400, "max_tokens",
     "context_length_exceeded"),
    ("chat-max-completion-tokens-past-context", "/v1/chat/completions",
     chat(max_tokens=None, max_completion_tokens=100_000), 400, "max_completion_tokens", "context_length_exceeded"),
    ("chat-max-completion-tokens-zero", "/v1/chat/completions", chat(max_tokens=None, max_completion_tokens=0), 400,
     "max_completion_tokens", None),
    ("prompt-lone-surrogate", "/v1/completions", raw_completion('"prompt": "Hi \\ud800 there"'), 400, "prompt",
     None),
    ("chat-lone-surrogate", "/v1/chat/completions",
     ('{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % MODEL).encode(), 400,
     "messages.0.content", None),
    ("image-content-part", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                  {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     400, "messages.0.content.1", None),
    ("unknown-content-part", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "hologram"}]}]), 400, "messages.0.content.0.type", None),
    ("user-message-without-content", "/v1/chat/completions", chat(messages=[{"role": "user"}]), 400,
     "messages.0.content", "missing_required_parameter"),
    ("user-message-with-empty-parts", "/v1/chat/completions", chat(messages=[{"role": "user", "content": []}]), 400,
     "messages.0.content", "missing_required_parameter"),
    ("tool-choice-without-tools", "/v1/chat/completions", chat(tool_choice="auto"), 400, "tool_choice", None),
    ("repetition-penalty-1e300", "/v1/completions", completion(repetition_penalty=1e300), 400, "repetition_penalty",
     None),
    ("repetition-penalty-tiny", "/v1/completions", completion(repetition_penalty=1e-300), 400, "repetition_penalty",
     None),
    ("temperature-over-two", "/v1/completions", completion(temperature=2.5), 400, "temperature", None),
    ("min-p-over-one", "/v1/completions", completion(min_p=1.5), 400, "min_p", None),
    ("logprobs-huge", "/v1/completions", completion(logprobs=10**12), 400, "logprobs", None),
    ("chat-top-logprobs-huge", "/v1/chat/completions", chat(logprobs=True, top_logprobs=10**12), 400,
     "top_logprobs", None),
    ("chat-top-logprobs-negative", "/v1/chat/completions", chat(logprobs=True, top_logprobs=-1), 400,
     "top_logprobs", None),
    ("n-huge", "/v1/completions", completion(n=10**12), 400, "n", None),
    ("stop-token-ids-negative", "/v1/completions", completion(stop_token_ids=[-3]), 400, "stop_token_ids", None),
    ("stop-empty-string", "/v1/completions", completion(stop=["ok", ""]), 400, "stop", None),
    ("unknown-model", "/v1/completions", completion(model="gpt-17"), 404, "model", "model_not_found"),
    ("chat-unknown-model", "/v1/chat/completions", chat(model="nope"), 404, "model", "model_not_found"),
    ("too-many-prompts", "/v1/completions", completion(prompt=["hi"] * (MAX_WAITING + 1)), 400, "prompt",
     "too_many_prompts"),
    ("one-bad-prompt-of-forty", "/v1/completions", completion(prompt=[[3, 4]] * 39 + [[3, 10**6]]), 400, "prompt",
     None),
]


@pytest.mark.parametrize("path,body,status,param,code", [case[1:] for case in HOSTILE],
                         ids=[case[0] for case in HOSTILE])
def test_hostile_request_fails_alone_naming_the_field(server, concurrent_stream, path, body, status, param, code):
    assert_openai_error(server.post(path, body), status, param, code)


def test_messages_say_what_is_wrong(server):
    image = HOSTILE[[c[0] for c in HOSTILE].index("image-content-part")]
    error = assert_openai_error(server.post(image[1], image[2]), 400, "messages.0.content.1")
    assert "image content is not supported by this text-only model" in error["message"]
    surrogate = server.post("/v1/completions", raw_completion('"prompt": "Hi \\ud800"'))
    message = assert_openai_error(surrogate, 400, "prompt")["message"]
    assert "not valid Unicode" in message and "TextEncodeInput" not in message
    long_prompt = server.post("/v1/completions", completion(prompt=[5] * 100, max_tokens=100))
    assert "at most 28 tokens" in assert_openai_error(long_prompt, 400, "max_tokens")["message"]
    chat_too_long = server.post("/v1/chat/completions", chat(messages=[{"role": "user", "content": "fox " * 200}]))
    assert "chat template" in assert_openai_error(chat_too_long, 400, "messages", "context_length_exceeded")["message"]


# ---- extreme but valid values: served, in the same steps as the stream ------------------------------
VALID_EXTREMES = [
    ("top-k-10-to-the-12", dict(top_k=10**12, temperature=1, seed=1), dict(top_k=-1, temperature=1, seed=1)),
    ("seed-10-to-the-30", dict(temperature=1, seed=10**30), None),
    ("seed-negative", dict(temperature=1, seed=-7), None),
    ("temperature-1e-300-is-served-as-0.01", dict(temperature=1e-300, seed=5), dict(temperature=0.01, seed=5)),
    ("top-p-1e-300-keeps-the-top-token", dict(temperature=1, top_p=1e-300, seed=3), dict(temperature=0)),
    ("stop-token-id-past-the-vocabulary", dict(temperature=0, stop_token_ids=[10**30]), dict(temperature=0)),
]


@pytest.mark.parametrize("fields,same_as", [c[1:] for c in VALID_EXTREMES], ids=[c[0] for c in VALID_EXTREMES])
def test_extreme_valid_values_are_served_without_harm(server, concurrent_stream, fields, same_as):
    body = completion(max_tokens=8, ignore_eos=True, **fields)
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length" and response.json()["usage"]["completion_tokens"] == 8
    if same_as is not None:  # the value means what the named ordinary value means
        ordinary = server.post("/v1/completions", completion(max_tokens=8, ignore_eos=True, **same_as))
        assert ordinary.json()["choices"][0]["text"] == choice["text"]


def test_chat_without_max_tokens_fills_the_context(server):
    response = server.post("/v1/chat/completions", chat(max_tokens=None, ignore_eos=True))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
    assert response.json()["choices"][0]["finish_reason"] == "length"


# ---- echo on chat (vLLM's rule) --------------------------------------------------------------------
def test_chat_echo_prepends_the_assistants_last_message(server):
    messages = CHAT + [{"role": "assistant", "content": "It is"}]
    plain = server.post("/v1/chat/completions", chat(messages=messages, temperature=0)).json()
    echoed = server.post("/v1/chat/completions", chat(messages=messages, temperature=0, echo=True)).json()
    reply = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "It is" + reply
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json=chat(messages=messages, temperature=0, echo=True, stream=True), timeout=60) as response:
        deltas = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas) == "It is" + reply
    # A last message from the user is not echoed.
    user_last = server.post("/v1/chat/completions", chat(temperature=0, echo=True)).json()
    assert user_last["choices"][0]["message"]["content"] == server.post(
        "/v1/chat/completions", chat(temperature=0)).json()["choices"][0]["message"]["content"]


# ---- transport -----------------------------------------------------------------------------------
def test_head_health_is_200(server):
    assert httpx.head(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("header", [f"Bearer {API_KEY}", f"bearer {API_KEY}", f"BEARER  {API_KEY}"])
def test_bearer_scheme_in_any_case_is_accepted(server, header):
    assert server.post("/v1/completions", completion(), auth=header).status_code == 200


@pytest.mark.parametrize("header", ["", API_KEY, f"Basic {API_KEY}", "Bearer wrong", f"Bearer {API_KEY}x"])
def test_wrong_key_is_a_401(server, header):
    response = server.post("/v1/completions", completion(), auth=header)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


# ---- many prompts in one request ---------------------------------------------------------------------
def test_many_prompts_are_admitted_in_one_go(server, monkeypatch):
    groups = []
    real_add = server.engine.add_requests

    def spy(requests):
        groups.append(len(requests))
        return real_add(requests)

    monkeypatch.setattr(server.engine, "add_requests", spy)
    steps_before = server.engine.num_steps
    prompts = [[3 + i % 50, 7] for i in range(MAX_WAITING)]
    response = server.post("/v1/completions", completion(prompt=prompts, max_tokens=1))
    assert response.status_code == 200, response.text
    assert sorted(c["index"] for c in response.json()["choices"]) == list(range(MAX_WAITING))
    assert groups == [MAX_WAITING], "one inbox operation for the whole request"
    # 64 prompts of 2 tokens and 1 output token each, 8 at a time: admission took no step of its own.
    assert server.engine.num_steps - steps_before <= MAX_WAITING // 8 + 2


def test_the_issues_1100_prompt_request_is_admitted_whole_under_the_default_limit(tiny_engine_factory,
                                                                                   serve_in_thread):
    """The request that took 54 s to admit (one engine step per prompt) goes in as one group
    under the server's default queue limit, and every prompt gets its choice."""
    engine = tiny_engine_factory(max_num_seqs=32, max_num_batched_tokens=64, page_size=8, num_pages=128,
                                 max_model_len=MAX_MODEL_LEN)
    async_engine, app = build_app(engine, ServerSettings(MODEL))  # default max_waiting_requests
    prompts = [[3 + i % 50, 7] for i in range(1100)]
    with serve_in_thread(app) as url:
        response = httpx.post(f"{url}/v1/completions", timeout=120,
                              json={"model": MODEL, "prompt": prompts, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    assert sorted(c["index"] for c in response.json()["choices"]) == list(range(1100))
    # 2 prompt tokens + 1 output each, 32 sequences a step: no step is spent on admission alone.
    assert engine.num_steps <= 1100 // 32 + 4
    assert engine.allocator.num_used == 0
