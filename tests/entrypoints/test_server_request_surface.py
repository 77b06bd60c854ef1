"""vLLM's request fields beyond OpenAI's, chat rendering options, and the small endpoints, on
the tiny random Llama through the server: each field changes the output the way it says (a
server that dropped it would fail the test), and each bad value is a 400 naming the field.

One server serves the module, started with a chat template of its own (--chat-template), a
default template variable (--default-chat-template-kwargs), request id headers and request
logging, so those are under test too.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from orca_jax.entrypoints.server import ServerSettings, build_app

MODEL = "tiny-llama"
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Paris is the capital of"}]
# The tiny tokenizer's own template, plus a variable the server sets by default.
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}{% if shout %}HEY {% endif %}")


@pytest.fixture(scope="module")
def live(tiny_engine_factory, serve_in_thread, server_idle_waiter):
    engine = tiny_engine_factory()
    settings = ServerSettings(MODEL, chat_template=TEMPLATE, default_chat_template_kwargs={"shout": True},
                              enable_request_id_headers=True, enable_log_requests=True, max_log_len=9)
    async_engine, app = build_app(engine, settings)
    with serve_in_thread(app) as url:
        yield url, engine, server_idle_waiter(async_engine)


@pytest.fixture(autouse=True)
def server_left_idle(live):
    yield
    live[2]()
    assert live[1].allocator.num_used == 0


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live[0]}{path}", content=json.dumps(body), timeout=60,
                      headers={"Content-Type": "application/json"})


def complete(live, **fields) -> dict:
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0) | fields
    response = post(live, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def refused(live, path: str, body: dict) -> dict:
    response = post(live, path, body)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def tokenize(live, **body) -> list[int]:
    response = post(live, "/tokenize", body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


# ---- sampling fields ---------------------------------------------------------------------------
def test_min_tokens_keeps_a_stop_token_from_ending_the_reply(live):
    first = complete(live, max_tokens=1)["choices"][0]["text"]
    stop_id = tokenize(live, prompt=first, add_special_tokens=False)[0]
    stopped = complete(live, stop_token_ids=[stop_id])
    assert stopped["usage"]["completion_tokens"] == 1
    held = complete(live, stop_token_ids=[stop_id], min_tokens=5)
    assert held["usage"]["completion_tokens"] >= 5


def test_allowed_token_ids_bound_every_token(live):
    allowed = tokenize(live, prompt=" over the lazy dog", add_special_tokens=False)
    out = complete(live, allowed_token_ids=allowed, logprobs=0, temperature=1.0, seed=4, ignore_eos=True)
    texts = {live[1].tokenizer.decode([t]) for t in allowed}
    tokens = out["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 8 and set(tokens) <= texts, (tokens, texts)


def test_bad_words_change_the_reply(live):
    free = complete(live, ignore_eos=True)["choices"][0]["text"]
    word = free.split()[0]
    banned = complete(live, ignore_eos=True, bad_words=[word])["choices"][0]["text"]
    assert banned != free and not banned.lstrip().startswith(word), (word, free, banned)


def test_logit_bias_forces_or_bans_tokens_on_both_endpoints(live):
    word = tokenize(live, prompt=" lazy", add_special_tokens=False)[0]
    forced = complete(live, logit_bias={str(word): 100}, ignore_eos=True)
    assert forced["choices"][0]["text"] == live[1].tokenizer.decode([word] * 8)
    free = complete(live, ignore_eos=True)["choices"][0]["text"]
    first = tokenize(live, prompt=free, add_special_tokens=False)[0]
    banned = complete(live, logit_bias={str(first): -100}, ignore_eos=True)["choices"][0]["text"]
    assert tokenize(live, prompt=banned, add_special_tokens=False)[0] != first, (free, banned)
    chat = post(live, "/v1/chat/completions", dict(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                                   ignore_eos=True, logit_bias={str(word): 100}))
    assert chat.json()["choices"][0]["message"]["content"] == live[1].tokenizer.decode([word] * 4)


def test_skip_special_tokens_false_keeps_them_in_the_text(live):
    bos = live[1].tokenizer.bos_token_id
    fields = dict(allowed_token_ids=[bos], max_tokens=3, ignore_eos=True)
    assert complete(live, **fields)["choices"][0]["text"] == ""
    assert complete(live, skip_special_tokens=False, **fields)["choices"][0]["text"] == "<s>" * 3


def test_truncate_prompt_tokens_keeps_the_end_of_the_prompt(live):
    ids = tokenize(live, prompt="The quick brown fox jumps over the lazy dog")
    out = complete(live, prompt=ids, truncate_prompt_tokens=3)
    assert out["usage"]["prompt_tokens"] == 3
    assert out["choices"][0]["text"] == complete(live, prompt=ids[-3:])["choices"][0]["text"]


def test_continuous_usage_stats_put_usage_in_every_chunk(live):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True, ignore_eos=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = []
    with httpx.stream("POST", f"{live[0]}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    assert chunks and all("usage" in c for c in chunks)
    completion_counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion_counts == sorted(completion_counts) and completion_counts[-1] == 4


def test_prompt_logprobs_on_both_endpoints(live):
    ids = tokenize(live, prompt=PROMPT)
    out = complete(live, prompt_logprobs=2, max_tokens=1)["choices"][0]["prompt_logprobs"]
    assert len(out) == len(ids) and out[0] is None
    for position, entry in enumerate(out[1:], start=1):
        assert str(ids[position]) in entry and len(entry) <= 3
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert ranks == [1, 2]
    echoed = complete(live, echo=True, logprobs=1, max_tokens=1)["choices"][0]["logprobs"]
    assert echoed["token_logprobs"][0] is None
    assert echoed["token_logprobs"][1:len(ids)] == [out[p][str(ids[p])]["logprob"] for p in range(1, len(ids))]
    chat = post(live, "/v1/chat/completions", dict(model=MODEL, messages=CHAT, max_tokens=1, prompt_logprobs=0))
    prompt = chat.json()["prompt_logprobs"]
    assert len(prompt) == chat.json()["usage"]["prompt_tokens"] and prompt[0] is None


@pytest.mark.parametrize("field, value", [
    ("min_tokens", -1), ("min_tokens", 99), ("bad_words", [" "]), ("allowed_token_ids", []),
    ("allowed_token_ids", [10 ** 6]), ("truncate_prompt_tokens", 0), ("spaces_between_special_tokens", False),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21), ("use_beam_search", True), ("priority", 3),
    ("logit_bias", {"x": 10}), ("logit_bias", {"5": "much"}), ("logit_bias", {str(10 ** 6): 1}),
    ("logit_bias", {str(t): 1 for t in range(301)}),
])
def test_bad_or_unsupported_values_are_refused_naming_the_field(live, field, value):
    for path, body in (("/v1/completions", dict(model=MODEL, prompt=PROMPT, max_tokens=8)),
                       ("/v1/chat/completions", dict(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=8))):
        error = refused(live, path, body | {field: value})
        assert error["param"] == field or error["param"].startswith(field + "."), (path, error)


# ---- chat rendering ----------------------------------------------------------------------------


def chat_prompt(live, **fields) -> str:
    return live[1].tokenizer.decode(tokenize(live, messages=fields.pop("messages", CHAT), **fields))


def test_the_servers_template_and_default_kwargs_render_the_prompt(live):
    assert chat_prompt(live) == "<s>user: Paris is the capital of</s><s>assistant: HEY "
    assert chat_prompt(live, chat_template_kwargs={"shout": False}).endswith("<s>assistant: ")
    assert chat_prompt(live, add_generation_prompt=False) == "<s>user: Paris is the capital of</s>HEY "
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert chat_prompt(live, chat_template=own) == "[Paris is the capital of]"


def test_chat_fields_reach_the_engines_prompt(live):
    def prompt_tokens(**fields) -> int:
        response = post(live, "/v1/chat/completions", dict(model=MODEL, messages=CHAT, max_tokens=1) | fields)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    base = prompt_tokens()
    assert base == len(tokenize(live, messages=CHAT))
    assert prompt_tokens(chat_template_kwargs={"shout": False}) < base
    assert prompt_tokens(add_generation_prompt=False) < base


def test_continue_final_message_ends_the_prompt_inside_it(live):
    messages = CHAT + [{"role": "assistant", "content": "Once upon"}]
    assert chat_prompt(live, messages=messages, add_generation_prompt=False,
                       continue_final_message=True).endswith("<s>assistant: Once upon")
    body = dict(model=MODEL, messages=messages, continue_final_message=True, max_tokens=2)
    assert refused(live, "/v1/chat/completions", body)["param"] == "continue_final_message"


def test_a_tool_message_needs_its_call_id(live):
    messages = CHAT + [{"role": "tool", "content": "42"}]
    error = refused(live, "/v1/chat/completions", dict(model=MODEL, messages=messages, max_tokens=2))
    assert error["param"] == "messages.1.tool_call_id"


# ---- a constraint the matcher gives up on -------------------------------------------------------
def test_a_failed_constraint_is_an_error_not_a_stop(live):
    grammar = "start: " + " | ".join(f'"w{i:04d}"' for i in range(2500))
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, structured_outputs={"grammar": grammar})
    error = refused(live, "/v1/completions", body)
    assert error["code"] == "constraint_failed"
    events = []
    with httpx.stream("POST", f"{live[0]}/v1/completions", json=body | {"stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    assert events[-1]["error"]["code"] == "constraint_failed"
    assert not any(c.get("finish_reason") == "stop" for e in events for c in e.get("choices", []))


# ---- endpoints ---------------------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip(live):
    response = post(live, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert response["tokens"] == live[1].tokenizer.encode(PROMPT)
    assert response["count"] == len(response["tokens"]) and response["max_model_len"] == live[1].config.max_model_len
    assert len(response["token_strs"]) == response["count"]
    assert post(live, "/detokenize", {"tokens": response["tokens"]}).json() == {"prompt": live[1].tokenizer.decode(
        response["tokens"])}
    assert refused(live, "/detokenize", {"tokens": [10 ** 6]})["param"] == "tokens"
    assert refused(live, "/tokenize", {"model": MODEL})["param"] == "prompt"
    assert post(live, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404


def test_version_ping_and_one_model(live):
    url = live[0]
    assert httpx.get(f"{url}/version").json()["version"]
    assert httpx.get(f"{url}/ping").status_code == 200 and httpx.post(f"{url}/ping").status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_cors_answers_a_browsers_preflight_only_when_asked(live):
    """--allowed-origins: the allowed origin gets CORS headers (a preflight needs no API key);
    without the flag no CORS header is sent at all. The apps are built over the module's
    engine but never started: the middleware answers before any engine work."""
    from starlette.testclient import TestClient

    engine = live[1]
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    _, app = build_app(engine, ServerSettings(MODEL, api_key="k", allowed_origins=["https://app.example"]))
    response = TestClient(app).options("/v1/completions", headers=preflight)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    _, plain = build_app(engine, ServerSettings(MODEL))
    assert "access-control-allow-origin" not in TestClient(plain).options("/v1/completions",
                                                                          headers=preflight).headers


def test_a_clients_request_id_names_the_request_and_comes_back(live, caplog):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    with caplog.at_level("INFO", logger="orca_jax.entrypoints.openai_serving"):
        response = httpx.post(f"{live[0]}/v1/completions", json=body, headers={"X-Request-Id": "trace-42"}, timeout=60)
    assert response.status_code == 200 and response.headers["x-request-id"] == "trace-42"
    assert response.json()["id"] == "cmpl-trace-42"
    with httpx.stream("POST", f"{live[0]}/v1/chat/completions", headers={"X-Request-Id": "trace-43"}, timeout=60,
                      json=dict(model=MODEL, messages=CHAT, max_tokens=2, stream=True)) as streamed:
        assert streamed.headers["x-request-id"] == "trace-43"
        assert any('"id": "chatcmpl-trace-43"' in line for line in streamed.iter_lines())
    bad = httpx.post(f"{live[0]}/v1/completions", json=body, headers={"X-Request-Id": "a b"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
    # --enable-log-requests: the id, the lengths, the parameters; --max-log-len 9: 9 characters of the prompt.
    (line,) = [r.getMessage() for r in caplog.records if "cmpl-trace-42" in r.getMessage()]
    assert "max_tokens': 2" in line and repr(PROMPT[:9]) in line and PROMPT not in line
