"""Tool-call parsers: turn a model's generated text into OpenAI `tool_calls`, whole or streamed.

A parser reads the full text so far (`final=False` while streaming, `True` once generation has
ended) and reports the content to show and the calls found. Both response paths use that one
function, so a streamed response cannot disagree with a non-streamed one: `ToolCallStreamer`
sends only what is new in each field since its last update, `extract_tool_calls` takes the
final parse as it is.

Arguments are the raw text of the arguments object as the model wrote it, cut out of the
output by a small lexical scanner (string and escape state, nesting depth), so every streamed
prefix is a prefix of the final arguments. `json.loads` only judges a call once it is closed.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from orca_jax.entrypoints import harmony
from orca_jax.entrypoints.partial_tags import without_partial_tag

ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"
# A complete JSON string (unrolled so that a failed match on a long open string stays linear).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_QUOTE_OR_BRACKET = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r'[^\s,:\]}]+')
_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass
class ParsedCall:
    name: str | None  # None until the name's JSON string is complete
    arguments: str  # raw JSON text of the arguments object so far (a prefix while streaming)
    complete: bool  # the call's JSON object is closed and valid


@dataclass
class ParsedOutput:
    content: str  # text outside tool calls that is safe to show now
    calls: list[ParsedCall]


class ToolParser(Protocol):
    def parse(self, text: str, final: bool) -> ParsedOutput: ...


class _Malformed(Exception):
    """The text cannot be a tool call, however it continues."""


# -- lexical JSON scanning -----------------------------------------------------------------

def _skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """Index just past the JSON value that starts at text[i]; None if the text ends inside it.
    Lexical only (string extent, nesting, scalar extent): json.loads judges a closed call."""
    if text[i] == '"':
        match = _STRING.match(text, i)
        return match.end() if match else None
    if text[i] in "{[":
        return _nested_end(text, i)
    match = _SCALAR.match(text, i)
    if match is None:
        raise _Malformed(f"no JSON value at {i}")
    # A scalar that reaches the end of the text may still be growing ("tru" -> "true").
    return match.end() if match.end() < len(text) else None


def _nested_end(text: str, i: int) -> int | None:
    """Index just past the object or array at text[i], jumping from bracket to bracket and
    over whole strings (a brace inside a string does not nest)."""
    depth = 0
    while (match := _QUOTE_OR_BRACKET.search(text, i)) is not None:
        if match.group() == '"':
            string_match = _STRING.match(text, match.start())
            if string_match is None:
                return None
            i = string_match.end()
            continue
        depth += 1 if match.group() in "{[" else -1
        i = match.end()
        if depth == 0:
            return i
    return None


def _after(text: str, i: int, char: str) -> int | None:
    """Skip whitespace, `char`, whitespace: the index reached, or None at the end of the text."""
    i = _skip_whitespace(text, i)
    if i == len(text):
        return None
    if text[i] != char:
        raise _Malformed(f"expected {char!r} at {i}")
    i = _skip_whitespace(text, i + 1)
    return i if i < len(text) else None


def _object_members(text: str, start: int) -> tuple[list[tuple[str, int, int | None]], int | None]:
    """The members of the JSON object opened at text[start], as (key, value start, value end),
    the end None for a value the text ends inside; and the index past the closing brace (None
    while the object is open)."""
    members: list[tuple[str, int, int | None]] = []
    i: int | None = _skip_whitespace(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            return members, i + 1
        if members and (i := _after(text, i, ",")) is None:
            break
        if text[i] != '"':
            raise _Malformed(f"expected a key at {i}")
        key_end = _value_end(text, i)
        if key_end is None or (value_start := _after(text, key_end, ":")) is None:
            break
        value_end = _value_end(text, value_start)
        members.append((_decode(text[i:key_end]), value_start, value_end))
        if value_end is None:
            break
        i = _skip_whitespace(text, value_end)
    return members, None


def _decode(raw: str):
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise _Malformed(str(exc)) from exc


# -- one call object -----------------------------------------------------------------------

def _scan_call(text: str, start: int) -> tuple[ParsedCall, int | None]:
    """The call whose JSON object opens at text[start], and the index past it (None while open).
    The name and arguments may come in either order, so either may be known first."""
    members, end = _object_members(text, start)
    name, arguments, has_arguments = None, "", False
    for key, value_start, value_end in members:
        if key == "name" and value_end is not None:
            decoded = _decode(text[value_start:value_end])
            name = decoded if isinstance(decoded, str) else None
        elif key in ARGUMENT_KEYS:
            arguments, has_arguments = _arguments_text(text, value_start, value_end), True
    complete = end is not None and _is_valid_call(text[start:end])
    if complete and not has_arguments:
        arguments = "{}"  # a call without arguments takes none; clients expect an object
    return ParsedCall(name, arguments, complete), end


def _arguments_text(text: str, start: int, end: int | None) -> str:
    """An object is streamed as written. Anything else (say, a string holding JSON) cannot
    grow as a prefix of its normalized form, so it shows nothing until it is complete."""
    if text[start] == "{":
        return text[start:end] if end is not None else text[start:]
    if end is None:
        return ""
    value = _loads_or_none(text[start:end])  # None: null, or invalid (then so is the call)
    if isinstance(value, str) and isinstance(_loads_or_none(value), dict):
        return value
    return "{}" if value is None else json.dumps(value, ensure_ascii=False)


def _loads_or_none(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _is_valid_call(raw: str) -> bool:
    return isinstance((_loads_or_none(raw) or {}).get("name"), str)


def _call_sequence(text: str, i: int, separator: str, closer: str = "") -> Iterator[ParsedCall]:
    """The calls written as JSON objects from text[i] on, separated by `separator` (or by
    whitespace alone), up to `closer` or the end of the text."""
    while i < len(text) and text[i] != closer:
        if text[i] != "{":
            raise _Malformed(f"expected a call object at {i}")
        call, end = _scan_call(text, i)
        yield call
        if end is None:
            return
        i = _skip_whitespace(text, end)
        if text.startswith(separator, i):
            i = _skip_whitespace(text, i + len(separator))


def _collect(parts: Iterator[str | ParsedCall]) -> tuple[list[str], list[ParsedCall], bool]:
    """Content pieces and calls in text order, and whether the text was well formed."""
    pieces: list[str] = []
    calls: list[ParsedCall] = []
    try:
        for part in parts:
            (pieces if isinstance(part, str) else calls).append(part)
    except _Malformed:
        return pieces, calls, False
    return pieces, calls, True


# -- the formats ---------------------------------------------------------------------------

class HermesToolParser:
    """Qwen2.5/Qwen3/Hermes: content, then `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
    blocks; the last block may lack its closing tag when generation stopped right after it."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pieces, calls, well_formed = _collect(self._parts(text, final))
        if final and not (well_formed and all(call.complete for call in calls)):
            return ParsedOutput(text, [])  # bad tool output degrades to plain text
        # Stripped even while streaming: trailing whitespace waits until we know it is not
        # the space before a block, which the final content drops.
        return ParsedOutput("".join(pieces).strip(), calls)

    def _parts(self, text: str, final: bool) -> Iterator[str | ParsedCall]:
        pos = 0
        while (tag := text.find(self.OPEN, pos)) >= 0:
            yield text[pos:tag]
            start = _skip_whitespace(text, tag + len(self.OPEN))
            if start == len(text):
                yield ParsedCall(None, "", False)
                return
            if text[start] != "{":
                raise _Malformed("a tool_call block that is not a JSON object")
            call, end = _scan_call(text, start)
            yield call
            if end is None:
                return
            pos = _skip_whitespace(text, end)
            if text.startswith(self.CLOSE, pos):
                pos += len(self.CLOSE)
            elif not (pos == len(text) or text.startswith(self.OPEN, pos)):
                if final or not self.CLOSE.startswith(text[pos:]):
                    raise _Malformed("text after a call inside its block")
                return  # the closing tag is being written
        tail = text[pos:]
        yield tail if final else without_partial_tag(tail, self.OPEN)


class Llama3JsonToolParser:
    """Llama 3.1/3.2: optional `<|python_tag|>`, then `{"name": ..., "parameters": ...}` objects
    separated by `;`. Output that does not start that way is all content."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = self._calls_start(text)
        if start is None:
            undecided = not final and self._may_still_open_calls(text)
            return ParsedOutput("" if undecided else text, [])
        _, calls, well_formed = _collect(_call_sequence(text, start, ";"))
        if final and not (well_formed and all(call.complete for call in calls)):
            return ParsedOutput(text, [])
        return ParsedOutput("", calls)

    def _calls_start(self, text: str) -> int | None:
        """Index of the `{` that opens the calls, or None if the text does not start with one."""
        i = _skip_whitespace(text, 0)
        if text.startswith(self.PYTHON_TAG, i):
            i = _skip_whitespace(text, i + len(self.PYTHON_TAG))
        return i if text.startswith("{", i) else None

    def _may_still_open_calls(self, text: str) -> bool:
        """The text so far is blank, or blank around (a prefix of) the python tag."""
        rest = text.lstrip(_WHITESPACE)
        if rest.startswith(self.PYTHON_TAG):
            return rest[len(self.PYTHON_TAG):].strip(_WHITESPACE) == ""
        return self.PYTHON_TAG.startswith(rest)


class JsonArrayToolParser:
    """`tool_choice="required"`: a grammar forces a JSON array of call objects. Calls that are
    not complete and valid at the end are dropped; there is never content."""

    name = "json_array"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = _skip_whitespace(text, 0)
        if start < len(text) and text[start] != "[":
            return ParsedOutput("", [])
        _, calls, _ = _collect(_call_sequence(text, _skip_whitespace(text, start + 1), ",", "]"))
        return ParsedOutput("", [call for call in calls if call.complete or not final])


class NamedToolParser:
    """`tool_choice` naming one function: a grammar forces the whole text to be its arguments."""

    name = "named"

    def __init__(self, function_name: str):
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = _skip_whitespace(text, 0)
        if start < len(text) and text[start] != "{":
            return ParsedOutput("", [] if final else [ParsedCall(self.function_name, "", False)])
        end = _nested_end(text, start) if start < len(text) else None
        arguments = text[start:end] if end is not None else text[start:]
        complete = end is not None and isinstance(_loads_or_none(arguments), dict)
        if final and not complete:
            return ParsedOutput("", [])
        return ParsedOutput("", [ParsedCall(self.function_name, arguments, complete)])


class OpenAIToolParser:
    """gpt-oss (harmony, orca_jax/entrypoints/harmony.py): each commentary message addressed to
    `functions.NAME` is a call, its body the arguments. It reads the content the harmony
    reasoning parser leaves, so it needs `--reasoning-parser openai_gptoss` beside it."""

    name = "openai"
    requires_reasoning_parser = "openai_gptoss"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, found = harmony.function_calls(text, final)
        calls = [ParsedCall(name, arguments, closed and _loads_or_none(arguments) is not None)
                 for name, arguments, closed in found]
        if final and not all(call.complete for call in calls):
            return ParsedOutput(text, [])  # bad tool output degrades to plain text, as Hermes'
        return ParsedOutput(content.strip() if final else content.lstrip(), calls)


TOOL_PARSERS: dict[str, type] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, OpenAIToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """A parser for `--tool-call-parser NAME` (parsers hold no state, so one can be shared)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; available: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


def new_tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


# -- the two response paths ----------------------------------------------------------------

def extract_tool_calls(parser: ToolParser, text: str) -> tuple[str | None, list[dict]]:
    """The non-streamed response: (content, or None if empty; OpenAI tool call dicts)."""
    parsed = parser.parse(text, final=True)
    calls = [
        {"id": new_tool_call_id(), "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}
        for call in parsed.calls
    ]
    return parsed.content or None, calls


class ToolCallStreamer:
    """The streamed response: fed the full text each time it grows, it returns the chunk deltas
    for what is new. It sends only extensions of what it sent, so it never retracts."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.tool_call_ids: list[str] = []
        self._sent_content = ""
        self._sent_arguments: list[str] = []

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.tool_call_ids)

    def update(self, text: str, final: bool) -> list[dict]:
        parsed = self.parser.parse(text, final)
        deltas: list[dict] = []
        if new_content := _extension(self._sent_content, parsed.content):
            self._sent_content += new_content
            deltas.append({"content": new_content})
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # calls are announced in order, so a later one waits for this name
            if index == len(self.tool_call_ids):
                deltas.append(self._announce(index, call.name))
            if new_arguments := _extension(self._sent_arguments[index], call.arguments):
                self._sent_arguments[index] += new_arguments
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": new_arguments}}]})
        return deltas

    def _announce(self, index: int, name: str) -> dict:
        self.tool_call_ids.append(new_tool_call_id())
        self._sent_arguments.append("")
        return {"tool_calls": [{"index": index, "id": self.tool_call_ids[-1], "type": "function",
                                "function": {"name": name, "arguments": ""}}]}


def _extension(sent: str, now: str) -> str:
    """What `now` adds to `sent`; nothing when it does not extend it (sent text is final)."""
    return now[len(sent):] if now.startswith(sent) else ""
