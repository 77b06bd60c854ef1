"""Structured outputs and tool calling on the real default model (SmolLM2-135M-Instruct),
served in process and driven by the official `openai` client: 30 concurrent json_schema chat
requests over six schemas (nested objects, bounded arrays, enums, bounded integers and
numbers, strict and explicitly closed), regex and choice, and tool_choice="required" over three
strict tools, streamed and not. Every reply is checked against its schema with jsonschema.

The model is real, so this also shows that its grammar (a 49k-token vocabulary) is enforced at
serving speed: each reply has to finish by its grammar ("stop"), well inside max_tokens.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from orca_jax.engine.engine import LLMEngine
from orca_jax.entrypoints.server import ServerSettings, build_app
from orca_jax.structured.structured_outputs import closed_objects

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAX_TOKENS = 150
WORKERS = 8  # the client's concurrency: one full batch of the engine (max_num_seqs=8)


def strict(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# (response_format, the schema the reply must satisfy, a question for the i-th request)
SCHEMAS = [
    (strict("person", {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "favorite_color": {"enum": ["red", "green", "blue"]}},
        "required": ["name", "age", "favorite_color"]}),
     "Describe a fictional person number {i} as JSON."),
    (strict("city", {
        "type": "object",
        "properties": {"city": {"type": "object",
                                "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                                               "country": {"enum": ["France", "Germany", "Italy", "Spain"]}},
                                "required": ["name", "country"]},
                       "population_millions": {"type": "integer", "minimum": 0, "maximum": 40}},
        "required": ["city", "population_millions"]}),
     "Give a European city (example {i}) as JSON."),
    (strict("palette", {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]},
                                  "minItems": 2, "maxItems": 3},
                       "count": {"type": "integer", "minimum": 2, "maximum": 3}},
        "required": ["colors", "count"]}),
     "Pick two or three colors for palette {i}."),
    (strict("weather", {
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -40, "maximum": 50},
                       "unit": {"enum": ["celsius", "fahrenheit"]},
                       "raining": {"type": "boolean"}},
        "required": ["temperature", "unit", "raining"]}),
     "Report the weather for day {i} as JSON."),
    (strict("order", {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2,
                                 "items": {"type": "object",
                                           "properties": {"product": {"type": "string", "minLength": 1,
                                                                      "maxLength": 12},
                                                          "quantity": {"type": "integer", "minimum": 1,
                                                                       "maximum": 9}},
                                           "required": ["product", "quantity"]}},
                       "express": {"type": "boolean"}},
        "required": ["items", "express"]}),
     "Write grocery order number {i} as JSON."),
    # Not strict: closed by the schema itself, with an optional property.
    ({"type": "json_schema", "json_schema": {"name": "review", "schema": {
        "type": "object",
        "properties": {"rating": {"type": "integer", "minimum": 1, "maximum": 5},
                       "summary": {"type": "string", "minLength": 1, "maxLength": 24},
                       "recommend": {"type": "boolean"}},
        "required": ["rating", "summary"], "additionalProperties": False}}},
     "Review movie number {i} in JSON."),
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.", "strict": True,
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "set_alarm", "description": "Set an alarm at a time of day.", "strict": True,
        "parameters": {"type": "object",
                       "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                      "minute": {"type": "integer", "minimum": 0, "maximum": 59}},
                       "required": ["hour", "minute"]}}},
    {"type": "function", "function": {
        "name": "web_search", "description": "Search the web.", "strict": True,
        "parameters": {"type": "object",
                       "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 30}},
                       "required": ["query"]}}},
]
TOOL_SCHEMAS = {t["function"]["name"]: closed_objects(t["function"]["parameters"]) for t in TOOLS}


@pytest.fixture(scope="module")
def served(serve_in_thread, server_idle_waiter, default_model_engine_settings):
    """(openai client, wait_idle) of the default model served on 127.0.0.1."""
    engine = LLMEngine(**default_model_engine_settings)
    async_engine, app = build_app(engine, ServerSettings(MODEL))
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        yield client, server_idle_waiter(async_engine)


@pytest.fixture(autouse=True)
def server_left_idle(served):
    yield
    served[1]()


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def concurrently(fn, jobs) -> list:
    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(fn, jobs))


def test_thirty_concurrent_json_schema_replies_validate(served):
    client = served[0]
    jobs = [(i, *SCHEMAS[i % len(SCHEMAS)]) for i in range(30)]
    threads = set()

    def one(job):
        i, response_format, question = job
        threads.add(threading.get_ident())
        out = client.chat.completions.create(model=MODEL, messages=ask(question.format(i=i)), max_tokens=MAX_TOKENS,
                                             temperature=0.7, seed=i, response_format=response_format)
        return out.choices[0]

    replies = concurrently(one, jobs)
    assert len(threads) > 1, "sent concurrently"
    for (i, response_format, _), choice in zip(jobs, replies):
        text = choice.message.content
        assert choice.finish_reason == "stop", f"request {i}: {text!r}"
        schema = response_format["json_schema"]["schema"]
        jsonschema.validate(json.loads(text), closed_objects(schema))
        assert "\n" not in text  # ", " and ": " are the only whitespace between tokens


def test_regex_and_choice(served):
    client = served[0]
    phone = "[0-9]{3}-[0-9]{4}"
    sentiments = ["positive", "negative", "neutral"]
    jobs = [
        ("Write a phone number.", {"guided_regex": phone}, lambda t: re.fullmatch(phone, t)),
        ("Give me a phone number for the office.", {"structured_outputs": {"regex": phone}},
         lambda t: re.fullmatch(phone, t)),
        ("Sentiment of: 'I love this movie!'", {"guided_choice": sentiments}, lambda t: t in sentiments),
        ("Sentiment of: 'The food was cold.'", {"structured_outputs": {"choice": sentiments}},
         lambda t: t in sentiments),
    ]

    def one(job):
        question, constraint, _ = job
        out = client.chat.completions.create(model=MODEL, messages=ask(question), max_tokens=40, temperature=0,
                                             extra_body=constraint)
        return out.choices[0]

    for (question, _, matches), choice in zip(jobs, concurrently(one, jobs)):
        assert choice.finish_reason == "stop"
        assert matches(choice.message.content), (question, choice.message.content)


TOOL_QUESTIONS = ["What is the weather like in Paris right now?", "Wake me up at 7:30 tomorrow.",
                  "Search the web for JAX tutorials."]


def test_required_tool_calls_validate(served):
    client = served[0]

    def one(question):
        out = client.chat.completions.create(model=MODEL, messages=ask(question), max_tokens=MAX_TOKENS,
                                             temperature=0, tools=TOOLS, tool_choice="required")
        return out.choices[0]

    for question, choice in zip(TOOL_QUESTIONS, concurrently(one, TOOL_QUESTIONS)):
        assert choice.finish_reason == "tool_calls", question
        assert choice.message.content is None
        assert choice.message.tool_calls, question
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_streamed_required_call_is_the_non_streamed_one(served):
    client = served[0]
    kw = dict(model=MODEL, messages=ask(TOOL_QUESTIONS[0]), max_tokens=MAX_TOKENS, temperature=0, tools=TOOLS,
              tool_choice="required", parallel_tool_calls=False)

    def whole():
        return client.chat.completions.create(**kw).choices[0]

    def streamed():
        calls, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                assert not choice.delta.content
                for delta in choice.delta.tool_calls or []:
                    if delta.index not in calls:
                        assert delta.id.startswith("call_") and delta.type == "function"
                        assert delta.function.name and delta.function.arguments == ""
                        calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                    else:
                        calls[delta.index]["arguments"] += delta.function.arguments
                finish = choice.finish_reason or finish
        return [calls[i] for i in sorted(calls)], finish

    with ThreadPoolExecutor(2) as pool:
        whole_future, streamed_future = pool.submit(whole), pool.submit(streamed)
        reply, (calls, finish) = whole_future.result(), streamed_future.result()
    assert reply.finish_reason == finish == "tool_calls"
    (call,) = reply.message.tool_calls  # parallel_tool_calls=false: one call
    assert calls == [{"name": call.function.name, "arguments": call.function.arguments}]
    jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
