"""What tools and tool_choice mean (orca_jax.entrypoints.chat_tools): the plan per tool_choice, the schema
"required" enforces (checked with jsonschema against calls it must take and refuse), and the
errors that name their field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from orca_jax.entrypoints.chat_tools import finish_reason, plan_tools, required_calls_schema
from orca_jax.errors import RequestError
from orca_jax.entrypoints.protocol import ChatCompletionRequest
from orca_jax.entrypoints.tool_parsers import HermesToolParser, JsonArrayToolParser, NamedToolParser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME], **fields})


def test_plans_per_tool_choice():
    assert plan_tools(ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
                      "hermes").tools is None
    none = plan_tools(request(tool_choice="none"), "hermes")
    assert none.tools and none.parser is None and none.constraint is None
    auto = plan_tools(request(tool_choice="auto"), "hermes")
    assert isinstance(auto.parser, HermesToolParser) and auto.constraint is None
    assert plan_tools(request(), "hermes").parser is not None, "tools without tool_choice: auto when enabled"
    assert plan_tools(request(), None).parser is None, "... and none when it is not"
    required = plan_tools(request(tool_choice="required"), None)
    assert isinstance(required.parser, JsonArrayToolParser) and required.constraint.kind == "json"
    named = plan_tools(request(tool_choice={"type": "function", "function": {"name": "get_time"}}), None)
    assert isinstance(named.parser, NamedToolParser)
    # get_time is strict: its object takes no keys beyond tz.
    assert named.constraint.json == {**TIME["function"]["parameters"], "additionalProperties": False}


def test_auto_needs_the_server_flag():
    with pytest.raises(RequestError) as error:
        plan_tools(request(tool_choice="auto"), None)
    assert error.value.param == "tool_choice" and "--enable-auto-tool-choice" in error.value.message


def test_required_schema_takes_calls_of_the_tools_only():
    tools = request().tools
    validator = jsonschema.Draft202012Validator(required_calls_schema(tools, parallel=True))
    good = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}},
            {"name": "get_time", "parameters": {"tz": "UTC"}}]
    assert validator.is_valid(good)
    for bad in ([], [{"name": "get_weather", "parameters": {"unit": "C"}}],  # none; a required argument missing
                [{"name": "launch", "parameters": {}}],  # not a tool
                [{"name": "get_time", "parameters": {"tz": "UTC", "extra": 1}}],  # strict
                [{"parameters": {"tz": "UTC"}, "name": "get_time", "why": 1}]):
        assert not validator.is_valid(bad), bad
    single = jsonschema.Draft202012Validator(required_calls_schema(tools, parallel=False))
    assert single.is_valid(good[:1]) and not single.is_valid(good)
    # The name comes first, so a streamed call announces itself before its arguments.
    assert list(required_calls_schema(tools, True)["items"]["anyOf"][0]["properties"]) == ["name", "parameters"]


def test_an_unenforceable_parameters_schema_is_named():
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/$defs/missing"}}}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, broken],
            "tool_choice": "required"}
    with pytest.raises(RequestError) as error:
        plan_tools(ChatCompletionRequest.model_validate(body), None)
    assert error.value.param == "tools.1.function.parameters"
    # With "none" the schema is only shown to the model, never compiled: no error.
    assert plan_tools(ChatCompletionRequest.model_validate({**body, "tool_choice": "none"}), None).constraint is None


def test_finish_reason_says_tool_calls_only_for_a_reply_that_ended_calling():
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("stop", False) == "stop"
    assert finish_reason("length", True) == "length"


def test_history_arguments_reach_the_template_as_objects():
    message = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": json.dumps({"tz": "UTC"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]}).messages
    assert message[1].as_template_dict()["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}
    assert message[2].as_template_dict() == {"role": "tool", "content": "12:00", "tool_call_id": "c1"}
