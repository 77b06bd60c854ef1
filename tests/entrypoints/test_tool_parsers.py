"""Tool-call parsers: each format whole, and streamed in any chunking to the same calls."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_jax.entrypoints.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    ToolCallStreamer,
    extract_tool_calls,
    get_tool_parser,
)

ID = re.compile(r"call_[A-Za-z0-9]{24}")


def names_and_arguments(calls):
    return [(call["function"]["name"], call["function"]["arguments"]) for call in calls]


def stream(parser, text, cuts=None):
    """Feed `text` to a streamer in prefixes ending at `cuts` (default: one character at a
    time), then finally whole; reassemble what it sent: (content, [(id, name, arguments)])."""
    streamer = ToolCallStreamer(parser)
    deltas = []
    for cut in range(1, len(text)) if cuts is None else cuts:
        deltas += streamer.update(text[:cut], final=False)
    deltas += streamer.update(text, final=True)
    content, calls = "", []
    for delta in deltas:
        assert len(delta) == 1
        if "content" in delta:
            assert delta["content"]
            content += delta["content"]
            continue
        [tool_call] = delta["tool_calls"]
        if "id" in tool_call:  # the announcement: exactly once per call, in index order
            assert tool_call["index"] == len(calls)
            assert tool_call["type"] == "function" and tool_call["function"]["arguments"] == ""
            calls.append([tool_call["id"], tool_call["function"]["name"], ""])
        else:
            assert set(tool_call) == {"index", "function"} and set(tool_call["function"]) == {"arguments"}
            assert tool_call["function"]["arguments"]
            calls[tool_call["index"]][2] += tool_call["function"]["arguments"]
    assert streamer.tool_call_ids == [call[0] for call in calls]
    assert streamer.has_tool_calls == bool(calls)
    return content, [tuple(call) for call in calls]


def assert_streams_like_whole(parser, text, cuts=None):
    content, calls = extract_tool_calls(parser, text)
    streamed_content, streamed_calls = stream(parser, text, cuts)
    assert streamed_content == (content or "")
    assert [(name, arguments) for _, name, arguments in streamed_calls] == names_and_arguments(calls)
    return content, calls


# -- hermes --------------------------------------------------------------------------------

def test_hermes_single_call_after_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = extract_tool_calls(HermesToolParser(), text)
    assert content == "Let me check."
    assert names_and_arguments(calls) == [("get_weather", '{"city": "Paris"}')]
    assert ID.fullmatch(calls[0]["id"]) and calls[0]["type"] == "function"


def test_hermes_multiple_calls_keep_raw_arguments_and_unique_ids():
    text = ('<tool_call>{"name": "a", "arguments": {"x":1,  "y": [2]}}</tool_call>\n'
            '<tool_call>\n  {"name": "b", "arguments": {}}  \n</tool_call>\n')
    content, calls = extract_tool_calls(HermesToolParser(), text)
    assert content is None
    assert names_and_arguments(calls) == [("a", '{"x":1,  "y": [2]}'), ("b", "{}")]
    assert calls[0]["id"] != calls[1]["id"]


def test_hermes_missing_closing_tag_at_the_end():
    text = 'Sure <tool_call>\n{"name": "f", "arguments": {"q": "x"}}\n'
    content, calls = extract_tool_calls(HermesToolParser(), text)
    assert content == "Sure"
    assert names_and_arguments(calls) == [("f", '{"q": "x"}')]


@pytest.mark.parametrize("text", [
    'Hi <tool_call>{"name": "f", "arguments": {"q": }}</tool_call>',  # invalid JSON
    'Hi <tool_call>{"name": "f", "arguments": {"q": 1}',  # cut off
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # name not a string
    '<tool_call>call f()</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
])
def test_hermes_invalid_output_is_all_content(text):
    assert extract_tool_calls(HermesToolParser(), text) == (text, [])


def test_hermes_plain_text_is_content():
    assert extract_tool_calls(HermesToolParser(), "  Just an answer, 1 < 2.\n") == ("Just an answer, 1 < 2.", [])


def test_hermes_arguments_before_name():
    text = '<tool_call>{"arguments": {"a": {"b": "c"}}, "name": "f"}</tool_call>'
    _, calls = assert_streams_like_whole(HermesToolParser(), text)
    assert names_and_arguments(calls) == [("f", '{"a": {"b": "c"}}')]


def test_hermes_arguments_given_as_a_json_string():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    _, calls = assert_streams_like_whole(HermesToolParser(), text)
    assert names_and_arguments(calls) == [("f", '{"a": 1}')]
    text = '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>'
    assert names_and_arguments(extract_tool_calls(HermesToolParser(), text)[1]) == [("f", "[1, 2]")]


def test_hermes_scalar_arguments_and_extra_keys():
    # A number can grow into one whose normalized form is not an extension ("5" -> "5e-1" is
    # 0.5), so a scalar at the end of the text must count as unfinished.
    text = '<tool_call>{"id": 12, "type": "function", "name": "f", "arguments": 5e-1}</tool_call>'
    _, calls = assert_streams_like_whole(HermesToolParser(), text)
    assert names_and_arguments(calls) == [("f", "0.5")]


def test_hermes_call_without_arguments_takes_none():
    _, calls = assert_streams_like_whole(HermesToolParser(), '<tool_call>{"name": "now"}</tool_call>')
    assert names_and_arguments(calls) == [("now", "{}")]


def test_hermes_holds_back_a_possible_opening_tag():
    parser = HermesToolParser()
    streamer = ToolCallStreamer(parser)
    assert streamer.update("Hello <tool", final=False) == [{"content": "Hello"}]
    assert streamer.update("Hello <tool_call>", final=False) == []
    deltas = streamer.update('Hello <tool_call>{"name": "f", "arguments": {"a"', final=False)
    assert deltas == [
        {"tool_calls": [{"index": 0, "id": streamer.tool_call_ids[0], "type": "function",
                         "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
    ]
    assert parser.parse("Hello <tool", final=True).content == "Hello <tool"
    assert parser.parse("a <b> c <", final=False).content == "a <b> c"


def test_hermes_name_is_streamed_only_once_complete():
    parsed = HermesToolParser().parse('<tool_call>{"name": "get_wea', final=False)
    assert parsed.calls[0].name is None
    parsed = HermesToolParser().parse('<tool_call>{"name": "get_weather", "arguments": {"c', final=False)
    assert (parsed.calls[0].name, parsed.calls[0].arguments, parsed.calls[0].complete) == ("get_weather", '{"c', False)


# -- llama3_json ---------------------------------------------------------------------------

def test_llama3_python_tag_and_semicolon_separated_calls():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": "z"}}'
    content, calls = assert_streams_like_whole(Llama3JsonToolParser(), text)
    assert content is None
    assert names_and_arguments(calls) == [("a", '{"x": 1}'), ("b", '{"y": "z"}')]


def test_llama3_plain_json_call():
    content, calls = extract_tool_calls(Llama3JsonToolParser(), '\n{"name": "f", "parameters": {}}')
    assert content is None and names_and_arguments(calls) == [("f", "{}")]


@pytest.mark.parametrize("text", [
    "The answer is 42.",
    "<|python_tag|>print(1)",
    '{"name": "f", "parameters": {"x": 1}} and more',
    '{"name": "f", "parameters": {"x": 1}}; {"name": "g"',
    '{"answer": 42}',
])
def test_llama3_anything_else_is_content(text):
    assert extract_tool_calls(Llama3JsonToolParser(), text) == (text, [])
    assert stream(Llama3JsonToolParser(), text)[0] == text


def test_llama3_holds_blank_and_tag_prefix_until_decided():
    parser = Llama3JsonToolParser()
    assert parser.parse("  <|python", final=False).content == ""
    assert parser.parse("  <|python_tag|> ", final=False).content == ""
    assert parser.parse("  <|pythons", final=False).content == "  <|pythons"


# -- json array (tool_choice="required") and named -----------------------------------------

def test_json_array_calls():
    text = '[{"name": "a", "parameters": {"x": [1, {"y": "]"}]}}, {"name": "b", "arguments": {}}]'
    content, calls = assert_streams_like_whole(JsonArrayToolParser(), text)
    assert content is None
    assert names_and_arguments(calls) == [("a", '{"x": [1, {"y": "]"}]}'), ("b", "{}")]


def test_json_array_drops_a_cut_off_call():
    text = '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x":'
    assert names_and_arguments(extract_tool_calls(JsonArrayToolParser(), text)[1]) == [("a", "{}")]


def test_named_call_is_the_whole_text():
    content, calls = assert_streams_like_whole(NamedToolParser("f"), '{"city": "Oslo", "n": [1]}')
    assert content is None and names_and_arguments(calls) == [("f", '{"city": "Oslo", "n": [1]}')]
    assert extract_tool_calls(NamedToolParser("f"), '{"city": ') == (None, [])


def test_named_call_is_announced_before_any_argument():
    streamer = ToolCallStreamer(NamedToolParser("f"))
    [announce] = streamer.update("", final=False)
    assert announce["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}


# -- registry ------------------------------------------------------------------------------

def test_get_tool_parser():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "openai"}
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="hermes, llama3_json, openai"):
        get_tool_parser("mistral")


# -- streamed equals whole, for random calls and chunkings ---------------------------------

TRICKY = ['"', "\\", "{", "}", "[", "]", "</tool_call>", "<tool_call>", ";", "\\u00e9", "é", "😀", "\n", ": ,"]
texts = st.one_of(st.text(max_size=12), st.lists(st.sampled_from(TRICKY), max_size=4).map("".join))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)), max_leaves=8)
arguments_objects = st.dictionaries(texts, json_values, max_size=4)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,15}", fullmatch=True)
dumps_styles = st.sampled_from([{}, {"ensure_ascii": False}, {"separators": (",", ":")}, {"indent": 2}])


@st.composite
def calls_as_written(draw, arguments_key="arguments"):
    """[(name, arguments text, call object text)], keys in either order."""
    calls = []
    for _ in range(draw(st.integers(1, 3))):
        name, style = draw(names), draw(dumps_styles)
        arguments = json.dumps(draw(arguments_objects), **style)
        members = [f'"name": {json.dumps(name)}', f'"{arguments_key}": {arguments}']
        if draw(st.booleans()):
            members.reverse()
        calls.append((name, arguments, "{" + ", ".join(members) + "}"))
    return calls


def random_cuts(draw, text):
    return sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))


def check(parser, text, expected_calls, expected_content, draw):
    content, calls = assert_streams_like_whole(parser, text, random_cuts(draw, text))
    assert names_and_arguments(calls) == expected_calls
    assert content == (expected_content or None)
    assert len({call["id"] for call in calls}) == len(calls)
    assert_streams_like_whole(parser, text)  # one character at a time


FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
contents = st.text(max_size=20).filter(lambda text: "<tool_call>" not in text)


@FAST
@given(calls_as_written(), contents, st.sampled_from(["\n", "", "  "]), st.booleans(), st.data())
def test_hermes_streams_like_whole(calls, content, gap, close_last, data):
    blocks = [f"<tool_call>{gap}{call}{gap}</tool_call>" for _, _, call in calls]
    if not close_last:
        blocks[-1] = blocks[-1].removesuffix("</tool_call>")
    text = content + "\n".join(blocks)
    check(HermesToolParser(), text, [(n, a) for n, a, _ in calls], content.strip(), data.draw)


@FAST
@given(st.sampled_from(["arguments", "parameters"]), st.data())
def test_llama3_streams_like_whole(arguments_key, data):
    calls = data.draw(calls_as_written(arguments_key))
    prefix = data.draw(st.sampled_from(["", "<|python_tag|>", " \n"]))
    text = prefix + data.draw(st.sampled_from([";", "; ", " ;\n"])).join(call for _, _, call in calls)
    check(Llama3JsonToolParser(), text, [(n, a) for n, a, _ in calls], "", data.draw)


@FAST
@given(st.data())
def test_json_array_streams_like_whole(data):
    calls = data.draw(calls_as_written("parameters"))
    text = "[" + ", ".join(call for _, _, call in calls) + "]"
    check(JsonArrayToolParser(), text, [(n, a) for n, a, _ in calls], "", data.draw)


@FAST
@given(names, arguments_objects, dumps_styles, st.data())
def test_named_streams_like_whole(name, arguments, style, data):
    text = json.dumps(arguments, **style)
    check(NamedToolParser(name), text, [(name, text)], "", data.draw)


@FAST
@given(st.text(max_size=30), st.data())
def test_plain_text_streams_whole_for_every_parser(text, data):
    for parser in (HermesToolParser(), Llama3JsonToolParser()):
        content, calls = assert_streams_like_whole(parser, text, random_cuts(data.draw, text))
        if not calls:
            assert content in (text or None, text.strip() or None)
