"""Structured outputs and tool calling through the OpenAI-compatible server, in process on
127.0.0.1, driven by the official `openai` client and by raw HTTP.

Structured outputs in every spelling (response_format json_schema / json_object, vLLM's
structured_outputs, the legacy guided_* fields) on both endpoints, streamed and not, with n > 1;
every reply is checked against its schema (jsonschema), regex or grammar. Tools: "required"
and named calls whose arguments validate, streamed calls that reassemble to the non-streamed
ones, the hermes parser behind tool_choice "auto" (a regex forces the random model to write a
call), tool history, and the 400s for bad constraints and tools, each naming the client's field.

One engine (the tiny random Llama) serves two apps on one uvicorn server: the main one started
with --enable-auto-tool-choice --tool-call-parser hermes, and under /plain one without them
(same engine thread, so no second compile). Every test leaves the engine idle with all KV
pages back in the pool.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import jsonschema
import llguidance
import openai
import pytest

from orca_jax.engine.async_engine import AsyncLLMEngine
from orca_jax.entrypoints.chat_template import apply_chat_template
from orca_jax.worker.compile_guard import no_compiles
from orca_jax.engine.engine import LLMEngine
from orca_jax.structured.guided_decoding import grammar_text
from orca_jax.entrypoints.metrics import ServerMetrics
from orca_jax.entrypoints.server import ServerSettings, build_app, create_app
from orca_jax.structured.structured_outputs import StructuredOutputsParams, closed_objects

MODEL = "tiny-llama"
# Tools are described in a system message (the tiny template knows no tools): two tools and a
# tool history come to ~900 tokens of the tiny byte-level tokenizer.
MAX_MODEL_LEN = 1024
PLAIN = "/plain"  # the app without auto tool choice
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Paris is the capital of"}]

# A schema a random model completes in a few dozen tokens: enums, bounded integers, booleans,
# short patterns, bounded arrays. No additionalProperties: strict=true closes it.
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Berlin", "Rome"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 999},
        "capital": {"type": "boolean"},
        "code": {"type": "string", "pattern": "^[A-Z]{2,3}$"},
        "tags": {"type": "array", "items": {"enum": ["old", "new"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "population", "capital", "code", "tags"],
}
CLOSED_CITY_SCHEMA = closed_objects(CITY_SCHEMA)
PHONE = "[0-9]{3}-[0-9]{4}"
SUMS_LARK = 'start: "(" NUM ("+" NUM)? ("+" NUM)? ")"\nNUM: /[0-9]{1,2}/\n'
SUMS = re.compile(r"\([0-9]{1,2}(\+[0-9]{1,2}){0,2}\)")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin"]},
                                                     "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
ALARM = {"type": "function", "function": {
    "name": "set_alarm", "description": "Set an alarm.", "strict": True,
    "parameters": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                                     "loud": {"type": "boolean"}},
                   "required": ["hour", "loud"]}}}
TOOLS = [WEATHER, ALARM]
TOOL_SCHEMAS = {t["function"]["name"]: closed_objects(t["function"]["parameters"]) for t in TOOLS}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'


def escaped(text: str) -> str:
    """A regex matching exactly `text` (Rust regex syntax; newlines kept literal)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


@dataclass
class LiveServer:
    url: str
    engine: LLMEngine
    async_engine: AsyncLLMEngine
    wait_idle: Callable[[], None]  # until nothing runs or waits and every KV page is free

    def client(self, prefix: str = "") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}{prefix}/v1", api_key="unused", max_retries=0, timeout=120)

    def post(self, path: str, body, timeout: float = 120) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", content=json.dumps(body), timeout=timeout,
                          headers={"Content-Type": "application/json"})


def two_apps(main, other, prefix: str):
    """One ASGI app: paths under `prefix` go (without it) to `other`, all else, and the
    lifespan, to `main`. `other` must share main's AsyncLLMEngine (its lifespan never runs)."""
    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(prefix + "/"):
            path = scope["path"][len(prefix):]
            scope = dict(scope, path=path, raw_path=path.encode())
            return await other(scope, receive, send)
        return await main(scope, receive, send)
    return app


@pytest.fixture(scope="module")
def live(tiny_llama_factory, serve_in_thread, server_idle_waiter):
    engine = LLMEngine(model=str(tiny_llama_factory(max_position_embeddings=MAX_MODEL_LEN)), max_num_seqs=8,
                       max_num_batched_tokens=32, page_size=16, num_pages=640, max_model_len=MAX_MODEL_LEN,
                       min_token_bucket=32)  # one step program
    settings = ServerSettings(MODEL, enable_auto_tool_choice=True, tool_call_parser="hermes")
    async_engine, app = build_app(engine, settings, max_waiting_requests=64)
    plain = create_app(async_engine, ServerSettings(MODEL), ServerMetrics(lambda: async_engine.stats()))
    with serve_in_thread(two_apps(app, plain, PLAIN)) as url:
        yield LiveServer(url, engine, async_engine, server_idle_waiter(async_engine))


@pytest.fixture(autouse=True)
def server_left_idle(live):
    yield
    live.wait_idle()


def grammar_accepts(engine: LLMEngine, constraint: StructuredOutputsParams, text: str) -> bool:
    """Whether `text` is a prefix of something the constraint allows (any tokenization of it)."""
    tokenizer = engine.grammars.llg_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(constraint))
    tokens = tokenizer.tokenize_str(text)
    return matcher.validate_tokens(tokens) == len(tokens) and not matcher.is_error()


def generate(live, endpoint: str, **kw) -> list[tuple[str, str]]:
    """(text, finish_reason) of every choice, in index order, through the openai client."""
    client = live.client()
    if endpoint == "chat":
        out = client.chat.completions.create(model=MODEL, messages=CHAT, **kw)
        return [(c.message.content, c.finish_reason) for c in sorted(out.choices, key=lambda c: c.index)]
    out = client.completions.create(model=MODEL, prompt=PROMPT, **kw)
    return [(c.text, c.finish_reason) for c in sorted(out.choices, key=lambda c: c.index)]


def json_schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


# ---- structured outputs ------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_json_schema_replies_validate_with_the_default_separators(live, endpoint):
    kw = {"response_format": json_schema_format(CITY_SCHEMA)}
    if endpoint == "completions":
        kw = {"extra_body": kw}
    choices = generate(live, endpoint, max_tokens=200, n=3, temperature=1.0, seed=11, **kw)
    assert len(choices) == 3
    for text, finish in choices:
        assert finish == "stop", text
        value = json.loads(text)
        jsonschema.validate(value, CLOSED_CITY_SCHEMA)
        # ", " and ": " and no other whitespace: exactly what json.dumps writes.
        assert text == json.dumps(value, ensure_ascii=False)
    assert len({text for text, _ in choices}) > 1, "n=3 at temperature 1 samples distinct objects"


def test_json_schema_over_several_prompts_and_samples(live):
    out = live.client().completions.create(model=MODEL, prompt=[PROMPT, "Paris is"], max_tokens=200, n=2,
                                           temperature=0.8, seed=5,
                                           extra_body={"guided_json": json.dumps(CLOSED_CITY_SCHEMA)})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    for c in out.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), CLOSED_CITY_SCHEMA)


def test_structured_outputs_json_compact_and_closed_on_request(live):
    """disable_any_whitespace writes {"a":1}; disable_additional_properties closes the objects
    (the schema itself leaves additionalProperties open)."""
    so = {"json": CITY_SCHEMA, "disable_any_whitespace": True, "disable_additional_properties": True}
    for text, finish in generate(live, "chat", max_tokens=200, n=2, temperature=1.0, seed=2,
                                 extra_body={"structured_outputs": so}):
        assert finish == "stop"
        value = json.loads(text)
        jsonschema.validate(value, CLOSED_CITY_SCHEMA)
        assert text == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_json_object_reply_is_an_object_or_its_prefix(live, endpoint):
    """Any JSON object: a random model may write a string key until max_tokens, so a reply cut
    at the length is checked as a prefix the grammar still accepts; a finished one parses."""
    kw = {"response_format": {"type": "json_object"}}
    if endpoint == "completions":
        kw = {"extra_body": kw}
    constraint = StructuredOutputsParams(json_object=True)
    choices = generate(live, endpoint, max_tokens=40, n=4, temperature=1.0, seed=4, **kw)
    for text, finish in choices:
        assert text.startswith("{")
        assert grammar_accepts(live.engine, constraint, text), text
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert finish == "length"
    # Not grammar_accepts-vacuous: the same check refuses text outside the grammar.
    assert not grammar_accepts(live.engine, constraint, "[1]")


def test_closed_json_object_is_the_empty_object(live):
    closed = generate(live, "completions", max_tokens=50,
                      extra_body={"structured_outputs": {"json_object": True, "disable_additional_properties": True}})
    assert closed == [("{}", "stop")]  # a closed object without properties has one value


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("field", ["guided_regex", "structured_outputs"])
def test_regex(live, endpoint, field):
    body = {"guided_regex": PHONE} if field == "guided_regex" else {"structured_outputs": {"regex": PHONE}}
    choices = generate(live, endpoint, max_tokens=50, n=2, temperature=1.0, seed=3, extra_body=body)
    for text, finish in choices:
        assert re.fullmatch(PHONE, text), text
        assert finish == "stop"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_choice(live, endpoint):
    options = ["alpha", "beta", "gamma delta"]
    choices = generate(live, endpoint, max_tokens=50, n=6, temperature=1.5, seed=1,
                       extra_body={"guided_choice": options})
    assert all(text in options and finish == "stop" for text, finish in choices), choices
    so = generate(live, endpoint, max_tokens=50, extra_body={"structured_outputs": {"choice": options}})
    assert so[0][0] in options and so[0][1] == "stop"


def test_choice_cut_by_max_tokens_is_a_prefix(live):
    long_choice = "abcdefghijklmnopqrstuvwxyz0123456789"
    ((text, finish),) = generate(live, "completions", max_tokens=2, extra_body={"guided_choice": [long_choice]})
    assert finish == "length"
    assert text and long_choice.startswith(text) and text != long_choice


def test_complete_grammar_stops_without_spending_a_token_on_eos(live):
    """ignore_eos does not make a finished grammar go on: the reply is exactly the choice's
    tokens, and finishes "stop"."""
    out = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=50, logprobs=0,
                                           extra_body={"guided_choice": ["capital"], "ignore_eos": True})
    choice = out.choices[0]
    assert choice.text == "capital" and choice.finish_reason == "stop"
    assert "".join(choice.logprobs.tokens) == "capital"
    assert out.usage.completion_tokens == len(choice.logprobs.tokens)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_lark_grammar(live, endpoint):
    choices = generate(live, endpoint, max_tokens=60, n=3, temperature=1.0, seed=8,
                       extra_body={"guided_grammar": SUMS_LARK})
    for text, finish in choices:
        assert SUMS.fullmatch(text), text
        assert finish == "stop"
    so = generate(live, endpoint, max_tokens=60, extra_body={"structured_outputs": {"grammar": SUMS_LARK}})
    assert SUMS.fullmatch(so[0][0]) and so[0][1] == "stop"


def test_gbnf_grammar(live):
    gbnf = 'root ::= answer " " answer\nanswer ::= "yes" | "no"\n'
    for text, finish in generate(live, "completions", max_tokens=20, n=4, temperature=1.5, seed=6,
                                 extra_body={"guided_grammar": gbnf}):
        assert re.fullmatch("(yes|no) (yes|no)", text) and finish == "stop", text


def test_stop_string_ends_a_constrained_reply_early(live):
    whole = generate(live, "completions", max_tokens=200, temperature=0, extra_body={"guided_json": CLOSED_CITY_SCHEMA})
    ((cut, finish),) = generate(live, "completions", max_tokens=200, temperature=0, stop=[","],
                                extra_body={"guided_json": CLOSED_CITY_SCHEMA})
    assert finish == "stop"
    assert cut == whole[0][0][:whole[0][0].index(",")]


def test_text_response_format_is_unconstrained(live):
    free = generate(live, "chat", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    text = generate(live, "chat", max_tokens=12, temperature=0, response_format={"type": "text"},
                    extra_body={"ignore_eos": True})
    assert text == free and free[0][1] == "length"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_json_schema_reassembles_to_the_non_streamed_reply(live, endpoint):
    client = live.client()
    rf = json_schema_format(CITY_SCHEMA)
    if endpoint == "chat":
        whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, temperature=0,
                                               response_format=rf).choices[0].message.content
        chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, temperature=0,
                                                     response_format=rf, stream=True,
                                                     stream_options={"include_usage": True}))
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    else:
        whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0,
                                          extra_body={"response_format": rf}).choices[0].text
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"response_format": rf}))
        pieces = [c.choices[0].text for c in chunks if c.choices]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    text = "".join(pieces)
    assert len([p for p in pieces if p]) > 3, "streamed in pieces"
    assert text == whole
    jsonschema.validate(json.loads(text), CLOSED_CITY_SCHEMA)
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens > 0


def test_streamed_json_schema_with_n_two(live):
    chunks = list(live.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=200, n=2, temperature=1.0, seed=9, stream=True,
        response_format=json_schema_format(CITY_SCHEMA)))
    texts, finishes = {0: "", 1: ""}, {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), CLOSED_CITY_SCHEMA)


# ---- bad constraints and tools -----------------------------------------------------------------
def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}


UNENFORCEABLE = {"type": "function", "function": {"name": "broken", "parameters": {"type": "bogus"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

BAD_REQUESTS = [
    # (id, path, body, param)
    ("rf-invalid-schema", "/v1/completions",
     completion(response_format=json_schema_format({"type": "bogus"})), "response_format.json_schema.schema"),
    ("rf-invalid-schema-chat", "/v1/chat/completions",
     chat(response_format=json_schema_format({"type": "bogus"})), "response_format.json_schema.schema"),
    ("rf-schema-not-object", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}),
     "response_format.json_schema.schema"),
    ("rf-unknown-type", "/v1/chat/completions", chat(response_format={"type": "xml"}), "response_format.type"),
    ("rf-json-schema-missing", "/v1/completions", completion(response_format={"type": "json_schema"}),
     "response_format.json_schema"),
    ("rf-json-schema-unnamed", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"schema": CITY_SCHEMA}}),
     "response_format.json_schema.name"),
    ("rf-strict-not-bool", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}),
     "response_format.json_schema.strict"),
    ("rf-not-object", "/v1/chat/completions", chat(response_format="json"), "response_format"),
    ("guided-regex-invalid", "/v1/completions", completion(guided_regex="(("), "guided_regex"),
    ("guided-regex-invalid-chat", "/v1/chat/completions", chat(guided_regex="[0-9"), "guided_regex"),
    ("so-regex-invalid", "/v1/completions", completion(structured_outputs={"regex": "(("}),
     "structured_outputs.regex"),
    ("so-regex-empty", "/v1/completions", completion(structured_outputs={"regex": ""}), "structured_outputs.regex"),
    ("so-json-invalid", "/v1/chat/completions", chat(structured_outputs={"json": {"type": "bogus"}}),
     "structured_outputs.json"),
    ("so-json-not-schema", "/v1/chat/completions", chat(structured_outputs={"json": 5}), "structured_outputs.json"),
    ("so-grammar-invalid", "/v1/completions", completion(structured_outputs={"grammar": "start: undefined_rule"}),
     "structured_outputs.grammar"),
    ("so-choice-empty", "/v1/completions", completion(structured_outputs={"choice": []}), "structured_outputs.choice"),
    ("so-unknown-key", "/v1/completions", completion(structured_outputs={"yaml": "a: 1"}), "structured_outputs"),
    ("so-two-constraints", "/v1/completions", completion(structured_outputs={"regex": "a", "choice": ["a"]}),
     "structured_outputs"),
    ("so-no-constraint", "/v1/completions", completion(structured_outputs={"disable_any_whitespace": True}),
     "structured_outputs"),
    ("so-flag-not-bool", "/v1/completions",
     completion(structured_outputs={"json_object": True, "disable_any_whitespace": "yes"}),
     "structured_outputs.disable_any_whitespace"),
    ("so-not-object", "/v1/completions", completion(structured_outputs="json"), "structured_outputs"),
    ("guided-json-not-json", "/v1/completions", completion(guided_json="{not json"), "guided_json"),
    ("guided-json-invalid-schema", "/v1/chat/completions", chat(guided_json={"type": "bogus"}), "guided_json"),
    ("guided-grammar-invalid", "/v1/chat/completions", chat(guided_grammar="start: undefined_rule"),
     "guided_grammar"),
    ("guided-choice-empty", "/v1/completions", completion(guided_choice=[]), "guided_choice"),
    ("guided-choice-not-strings", "/v1/completions", completion(guided_choice=[1, 2]), "guided_choice.0"),
    ("guided-whitespace-pattern", "/v1/completions", completion(guided_json=CITY_SCHEMA,
                                                               guided_whitespace_pattern=" *"),
     "guided_whitespace_pattern"),
    ("two-guided", "/v1/completions", completion(guided_regex="a", guided_choice=["a"]), "guided_choice"),
    ("rf-and-guided", "/v1/chat/completions", chat(response_format={"type": "json_object"}, guided_regex="a"),
     "guided_regex"),
    ("rf-and-structured", "/v1/chat/completions",
     chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "structured_outputs"),
    # tools
    ("tool-without-name", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"description": "x"}}]),
     "tools.0.function.name"),
    ("tool-bad-name", "/v1/chat/completions",
     chat(tools=[WEATHER, {"type": "function", "function": {"name": "two words"}}]), "tools.1.function.name"),
    ("tool-parameters-not-object", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]), "tools.0.function.parameters"),
    ("tool-not-function", "/v1/chat/completions",
     chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools.0.type"),
    ("tool-names-repeated", "/v1/chat/completions", chat(tools=[WEATHER, WEATHER]), "tools"),
    ("tool-choice-unknown-function", "/v1/chat/completions",
     chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    ("tool-choice-unknown-word", "/v1/chat/completions", chat(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    ("tool-choice-without-tools", "/v1/chat/completions", chat(tool_choice="required"), "tool_choice"),
    ("tool-unenforceable-required", "/v1/chat/completions", chat(tools=[WEATHER, UNENFORCEABLE],
                                                                  tool_choice="required"),
     "tools.1.function.parameters"),
    ("tool-unenforceable-named", "/v1/chat/completions",
     chat(tools=[UNENFORCEABLE], tool_choice={"type": "function", "function": {"name": "broken"}}),
     "tools.0.function.parameters"),
    ("tool-required-and-response-format", "/v1/chat/completions",
     chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    ("tool-named-and-guided", "/v1/chat/completions",
     chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "set_alarm"}}, guided_regex="a"),
     "guided_regex"),
    ("functions-deprecated", "/v1/chat/completions", chat(functions=[{"name": "f"}]), "functions"),
    ("tool-calls-on-user-message", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "hi", "tool_calls": [CALL]}]), "messages.0.tool_calls"),
    ("tool-message-without-content", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_1"}]),
     "messages.1.content"),
    ("tool-call-arguments-not-text", "/v1/chat/completions",
     chat(messages=[{"role": "assistant", "tool_calls": [dict(CALL, function={"name": "f", "arguments": {}})]}]),
     "messages.0.tool_calls.0.function.arguments"),
]


@pytest.mark.parametrize("path,body,param", [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_constraint_or_tool_is_a_400_naming_the_field(live, path, body, param):
    response = live.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_openai_client_sees_the_field_of_a_bad_schema(live):
    with pytest.raises(openai.BadRequestError) as info:
        live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                              response_format=json_schema_format({"type": "bogus"}))
    assert info.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as info:
        live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"guided_regex": "(("})
    assert info.value.body["param"] == "guided_regex"


def test_auto_tool_choice_needs_the_server_flags(live):
    with pytest.raises(openai.BadRequestError) as info:
        live.client(PLAIN).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, tools=TOOLS,
                                                   tool_choice="auto")
    assert info.value.status_code == 400 and info.value.body["param"] == "tool_choice"
    # The same request is fine on the server started with them.
    ok = live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, tools=TOOLS,
                                               tool_choice="auto")
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_unenforceable_parameters_are_fine_when_nothing_enforces_them(live):
    """A tool schema llguidance cannot compile is only an error for required / named calls."""
    for choice in ("none", "auto"):
        out = live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, tools=[UNENFORCEABLE],
                                                    tool_choice=choice)
        assert out.choices[0].finish_reason in ("length", "stop")


def test_server_is_healthy_after_bad_requests(live):
    for _, path, body, _ in BAD_REQUESTS:
        assert live.post(path, body).status_code == 400
    live.wait_idle()
    ((text, finish),) = generate(live, "completions", max_tokens=50, extra_body={"guided_regex": PHONE})
    assert re.fullmatch(PHONE, text) and finish == "stop"


# ---- tools -------------------------------------------------------------------------------------
def assert_valid_calls(calls, names=None) -> list[tuple[str, dict]]:
    """Each call has an id, the function type, a known name and arguments that validate."""
    assert calls, "no tool calls"
    ids = [call.id for call in calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    parsed = []
    for call in calls:
        assert call.type == "function"
        assert call.function.name in (names or TOOL_SCHEMAS)
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, TOOL_SCHEMAS[call.function.name])
        parsed.append((call.function.name, arguments))
    return parsed


def tool_chat(live, prefix: str = "", **kw):
    kw.setdefault("messages", CHAT)
    kw.setdefault("max_tokens", 120)
    return live.client(prefix).chat.completions.create(model=MODEL, **kw)


def test_required_tool_call(live):
    out = tool_chat(live, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=4, temperature=1.5,
                    seed=12)
    names = set()
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and choice.message.role == "assistant"
        (call,) = assert_valid_calls(choice.message.tool_calls)  # one call: parallel_tool_calls is false
        names.add(call[0])
    assert names == {"get_weather", "set_alarm"}, "at temperature 1.5 both tools are called"


def test_required_parallel_tool_calls_all_validate(live):
    out = tool_chat(live, tools=TOOLS, tool_choice="required", n=3, temperature=1.0, seed=21, max_tokens=150)
    for choice in out.choices:
        assert choice.finish_reason in ("tool_calls", "length")  # more calls may run into max_tokens
        assert choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)


def test_named_tool_call(live):
    named = {"type": "function", "function": {"name": "set_alarm"}}
    out = tool_chat(live, tools=TOOLS, tool_choice=named, n=3, temperature=1.0, seed=4)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = assert_valid_calls(choice.message.tool_calls, names=["set_alarm"])
        assert set(call[1]) == {"hour", "loud"}


def test_tool_without_parameters_named(live):
    ping = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}},
                                             "strict": True}}
    out = tool_chat(live, tools=[ping], tool_choice={"type": "function", "function": {"name": "ping"}})
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "ping" and json.loads(call.function.arguments) == {}
    assert out.choices[0].finish_reason == "tool_calls"


def stream_tool_chat(live, prefix: str = "", **kw) -> tuple[str, list[dict], str, list]:
    """Streamed chat: (content, calls in index order as {id, name, arguments}, finish_reason,
    the tool-call deltas as sent)."""
    content, calls, finish, deltas = "", {}, None, []
    for chunk in tool_chat(live, prefix, stream=True, **kw):
        if not chunk.choices:
            continue
        (choice,) = chunk.choices
        assert finish is None, "nothing after the finish reason"
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            deltas.append(delta)
            if delta.index not in calls:  # the call's first delta: everything but the arguments
                assert delta.id.startswith("call_") and delta.type == "function"
                assert delta.function.name and delta.function.arguments == ""
                assert delta.index == len(calls), "calls are announced in order"
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments
        if choice.finish_reason is not None:
            finish = choice.finish_reason
            assert choice.delta.content in (None, "") and not choice.delta.tool_calls
    return content, [calls[i] for i in sorted(calls)], finish, deltas


def as_pairs(calls) -> list[tuple[str, str]]:
    return [(c["name"], c["arguments"]) if isinstance(c, dict) else (c.function.name, c.function.arguments)
            for c in calls]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_streamed_tool_call_reassembles_to_the_non_streamed_one(live, tool_choice):
    kw = dict(tools=TOOLS, tool_choice=tool_choice, temperature=0)
    whole = tool_chat(live, **kw).choices[0]
    content, calls, finish, deltas = stream_tool_chat(live, **kw)
    assert whole.finish_reason == finish == "tool_calls"
    assert content == "" and whole.message.content is None
    assert as_pairs(calls) == as_pairs(whole.message.tool_calls)
    assert {c["id"] for c in calls}.isdisjoint(c.id for c in whole.message.tool_calls)  # ids are per response
    assert len(deltas) > 3, "the arguments arrive in fragments"
    assert_valid_calls(whole.message.tool_calls)


def test_hermes_auto_parses_a_call(live):
    out = tool_chat(live, tools=TOOLS, tool_choice="auto", extra_body={"guided_regex": escaped(HERMES_CALL)})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}


def test_hermes_auto_is_the_default_with_the_server_flags(live):
    out = tool_chat(live, tools=TOOLS, extra_body={"guided_regex": escaped(HERMES_CALL)})
    assert out.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather"]


def test_hermes_auto_content_and_calls(live):
    second = HERMES_CALL.replace("get_weather", "set_alarm").replace('{"city": "Paris", "unit": "C"}',
                                                                     '{"hour": 7, "loud": true}')
    text = "Sure. " + HERMES_CALL + "\n" + second
    kw = dict(tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=300,
              extra_body={"guided_regex": escaped(text)})
    whole = tool_chat(live, **kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("set_alarm", {"hour": 7, "loud": True})]
    content, calls, finish, _ = stream_tool_chat(live, **kw)
    assert finish == "tool_calls"
    assert content == "Sure."
    assert as_pairs(calls) == as_pairs(whole.message.tool_calls)


def test_hermes_auto_plain_text_is_content(live):
    out = tool_chat(live, tools=TOOLS, tool_choice="auto", extra_body={"guided_regex": "Hello, world"})
    assert out.choices[0].message.content == "Hello, world"
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    content, calls, finish, _ = stream_tool_chat(live, tools=TOOLS, tool_choice="auto",
                                                 extra_body={"guided_regex": "Hello, world"})
    assert (content, calls, finish) == ("Hello, world", [], "stop")


def test_hermes_auto_cut_short_is_content(live):
    """A call that max_tokens cuts off is not a call: the text comes back as content."""
    out = tool_chat(live, tools=TOOLS, tool_choice="auto", max_tokens=6,
                    extra_body={"guided_regex": escaped(HERMES_CALL)})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content and HERMES_CALL.startswith(choice.message.content)


def test_tool_choice_none_and_plain_server_return_text(live):
    """tool_choice "none", and a server without auto tool choice given no tool_choice, leave
    a call-shaped reply as text."""
    for prefix, choice in (("", "none"), (PLAIN, None), (PLAIN, "none")):
        kw = {} if choice is None else {"tool_choice": choice}
        out = tool_chat(live, prefix, tools=TOOLS, extra_body={"guided_regex": escaped(HERMES_CALL)}, **kw).choices[0]
        assert out.message.content == HERMES_CALL and out.message.tool_calls is None
        assert out.finish_reason == "stop"


def test_plain_server_serves_required_calls(live):
    out = tool_chat(live, PLAIN, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert out.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(out.choices[0].message.tool_calls)


def test_tool_history_is_accepted_and_rendered(live):
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [dict(CALL, function={
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'})]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "assistant", "content": "It is sunny.", "tool_calls": [dict(CALL, id="call_2", function={
            "name": "set_alarm", "arguments": '{"hour": 7, "loud": false}'})]},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "alarm set"}]},
        {"role": "user", "content": "Thanks"},
    ]
    response = live.post("/v1/chat/completions", {"model": MODEL, "messages": history, "tools": TOOLS,
                                                  "max_tokens": 5, "temperature": 0})
    assert response.status_code == 200, response.text
    # The server rendered the tools and the history into the prompt: its length is the one the
    # template (tools in the system message, calls and answers as text) gives.
    as_sent = copy.deepcopy(history)
    as_sent[2]["content"] = ""
    as_sent[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "C"}
    as_sent[4]["tool_calls"][0]["function"]["arguments"] = {"hour": 7, "loud": False}
    as_sent[5]["content"] = "alarm set"
    tools = [{"type": "function", "function": {k: t["function"][k] for k in ("name", "description", "parameters")}}
             for t in TOOLS]
    expected = apply_chat_template(live.engine.tokenizer, as_sent, tools=tools, call_format="hermes")
    assert response.json()["usage"]["prompt_tokens"] == len(expected)
    without_tools = live.post("/v1/chat/completions", {"model": MODEL, "messages": history, "max_tokens": 5})
    assert without_tools.status_code == 200, without_tools.text
    assert without_tools.json()["usage"]["prompt_tokens"] < len(expected)
    # A required call after the history.
    out = tool_chat(live, messages=history, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert out.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(out.choices[0].message.tool_calls)


def test_streamed_required_calls_with_n_two(live):
    chunks = list(tool_chat(live, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2,
                            temperature=1.0, seed=30, stream=True))
    arguments, names, finishes = {0: "", 1: ""}, {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0  # one call per choice
                if delta.function.name:
                    names[choice.index] = delta.function.name
                arguments[choice.index] += delta.function.arguments or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    for i in (0, 1):
        jsonschema.validate(json.loads(arguments[i]), TOOL_SCHEMAS[names[i]])


def test_streamed_hermes_calls_with_n_two(live):
    chunks = list(tool_chat(live, tools=TOOLS, n=2, temperature=1.0, seed=5, stream=True,
                            extra_body={"guided_regex": escaped(HERMES_CALL)}))
    calls, finishes = {0: {}, 1: {}}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                call = calls[choice.index].setdefault(delta.index, {"name": delta.function.name, "arguments": ""})
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    for by_index in calls.values():
        assert [(c["name"], json.loads(c["arguments"])) for c in by_index.values()] == [
            ("get_weather", {"city": "Paris", "unit": "C"})]


def test_chat_logprobs_of_a_constrained_reply(live):
    out = live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, temperature=0,
                                                logprobs=True, top_logprobs=2,
                                                response_format=json_schema_format(CITY_SCHEMA))
    choice = out.choices[0]
    jsonschema.validate(json.loads(choice.message.content), CLOSED_CITY_SCHEMA)
    tokens = choice.logprobs.content
    assert "".join(t.token for t in tokens) == choice.message.content
    assert len(tokens) == out.usage.completion_tokens
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)


# ---- concurrency, faults, compiles ---------------------------------------------------------------
def test_constrained_and_free_requests_side_by_side(live):
    """Constrained, free and refused requests at once: the free ones give exactly their solo
    (greedy) text, the constrained ones match their constraints, the refused ones are 400s."""
    free_bodies = [completion(prompt=p, max_tokens=12, temperature=0, ignore_eos=True)
                   for p in (PROMPT, "Paris is", "def add(a, b):", "0123456789")]
    solo = [live.post("/v1/completions", b).json()["choices"][0]["text"] for b in free_bodies]
    constrained = [
        completion(max_tokens=200, temperature=0.7, seed=1, response_format=json_schema_format(CITY_SCHEMA)),
        completion(max_tokens=50, guided_regex=PHONE, temperature=1.0, seed=2),
        chat(max_tokens=50, guided_choice=["left", "right"], n=2, temperature=1.0, seed=3),
        chat(max_tokens=120, tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
        # a schema not seen before: its grammar compiles while the others run
        chat(max_tokens=100, guided_json={"type": "object", "properties": {"ok": {"type": "boolean"}},
                                          "required": ["ok"], "additionalProperties": False}),
    ]
    refused = [completion(guided_regex="(("), chat(response_format=json_schema_format({"type": "bogus"})),
               chat(tools=[UNENFORCEABLE], tool_choice="required")]

    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
            async def post(body):
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                return await client.post(path, json=body)
            return await asyncio.gather(*(post(b) for b in free_bodies + constrained + refused))

    responses = asyncio.run(main())
    free, cons, bad = (responses[:4], responses[4:9], responses[9:])
    assert [r.json()["choices"][0]["text"] for r in free] == solo
    assert all(r.status_code == 200 for r in cons), [r.text for r in cons]
    jsonschema.validate(json.loads(cons[0].json()["choices"][0]["text"]), CLOSED_CITY_SCHEMA)
    assert re.fullmatch(PHONE, cons[1].json()["choices"][0]["text"])
    assert {c["message"]["content"] for c in cons[2].json()["choices"]} <= {"left", "right"}
    tool_call = cons[3].json()["choices"][0]["message"]["tool_calls"][0]["function"]
    jsonschema.validate(json.loads(tool_call["arguments"]), TOOL_SCHEMAS[tool_call["name"]])
    assert json.loads(cons[4].json()["choices"][0]["message"]["content"]) in ({"ok": True}, {"ok": False})
    assert [r.status_code for r in bad] == [400, 400, 400]
    assert [r.json()["error"]["param"] for r in bad] == ["guided_regex", "response_format.json_schema.schema",
                                                         "tools.0.function.parameters"]


def test_a_grammar_that_names_tokens_outside_the_vocabulary_is_refused_alone(live):
    """A grammar that parses but names a token past the vocabulary: the server checks grammars
    against the vocabulary (built at start), so it is a 400 naming the field, streamed or not,
    and requests beside it are served as if it were not there. (A grammar that fails later,
    inside the engine, fails its request alone: tests/structured/test_guided_decoding.py.)"""
    live.engine.grammars.llg_tokenizer()  # built at start, in the background: waits if it is not done yet
    broken = 'start: "a" <[99999]>'
    free = completion(max_tokens=10, temperature=0, ignore_eos=True)
    solo = live.post("/v1/completions", free).json()["choices"][0]["text"]

    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
            return await asyncio.gather(
                client.post("/v1/completions", json=completion(guided_grammar=broken)),
                client.post("/v1/chat/completions", json=chat(guided_grammar=broken, stream=True)),
                *(client.post("/v1/completions", json=free) for _ in range(3)),
                client.post("/v1/completions", json=completion(max_tokens=50, guided_regex=PHONE)))

    failed, failed_stream, *served, regex = asyncio.run(main())
    for response in (failed, failed_stream):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "guided_grammar" and "99999" in error["message"]
    assert [r.json()["choices"][0]["text"] for r in served] == [solo] * 3
    assert re.fullmatch(PHONE, regex.json()["choices"][0]["text"])


def test_disconnect_mid_constrained_stream_returns_its_pages(live):
    """A client that leaves a constrained stream: the request is aborted, its pages return,
    and the next constrained request is served."""
    schema = {"type": "object", "properties": {"words": {"type": "array", "items": {"enum": ["fox", "dog"]},
                                                         "minItems": 150}}, "required": ["words"]}
    body = chat(max_tokens=400, stream=True, guided_json=schema)
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data:")
            if seen == 5:
                assert live.async_engine.stats().kv_pages_used > 0
                break
    live.wait_idle()
    ((text, finish),) = generate(live, "chat", max_tokens=50, extra_body={"guided_regex": PHONE})
    assert re.fullmatch(PHONE, text) and finish == "stop"


def test_serving_constrained_requests_compiles_nothing(live):
    """After warm-up, constrained rows (every kind, streamed, n > 1, tools) mixed with free
    ones in the same steps compile nothing."""
    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
            bodies = [
                ("/v1/completions", completion(max_tokens=10, temperature=0.8, seed=1)),
                ("/v1/completions", completion(max_tokens=200, n=2, temperature=1.0, seed=2,
                                               response_format=json_schema_format(CITY_SCHEMA))),
                ("/v1/completions", completion(prompt=PROMPT * 12, max_tokens=30, guided_regex=PHONE)),
                ("/v1/chat/completions", chat(max_tokens=60, guided_grammar=SUMS_LARK, logprobs=True,
                                              top_logprobs=2)),
                ("/v1/chat/completions", chat(max_tokens=30, stream=True, guided_choice=["a", "b"])),
                ("/v1/chat/completions", chat(max_tokens=120, tools=TOOLS, tool_choice="required", stream=True)),
                ("/v1/chat/completions", chat(max_tokens=120, tools=TOOLS, tool_choice="auto",
                                              guided_regex=escaped(HERMES_CALL))),
                ("/v1/chat/completions", chat(max_tokens=8, top_k=5, min_p=0.05, repetition_penalty=1.2)),
            ]
            return await asyncio.gather(*(client.post(path, json=body) for path, body in bodies))

    with no_compiles("serving constrained requests"):
        responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * len(responses), [r.text for r in responses]
