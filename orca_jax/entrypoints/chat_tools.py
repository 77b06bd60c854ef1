"""OpenAI tool calling on /v1/chat/completions: what `tools` and `tool_choice` mean here.

`plan_tools` decides, per request, three things (a ToolPlan):

    tool_choice       prompt        output constraint (grammar)              parsed by
    "none"            tools shown   none                                     nothing: content only
    "auto"            tools shown   none                                     the server's --tool-call-parser
    "required"        tools shown   a JSON array of one or more calls, each  JsonArrayToolParser
                                    {"name": <a tool>, "parameters": <its
                                    schema>} (one call if parallel_tool_calls
                                    is false)
    {"function": f}   tools shown   f's parameters schema                    NamedToolParser(f)

So "required" and named calls always parse and their arguments always validate against the
function's schema; "auto" relies on the model following the format its template (or the
fallback description, orca_jax.entrypoints.chat_template) shows it. As in vLLM, "auto" needs the server
started with --enable-auto-tool-choice and a --tool-call-parser; a request that leaves
tool_choice out gets "auto" on such a server and "none" on any other.

Both response paths read the output through the same parser (orca_jax.entrypoints.tool_parsers): a
message with `tool_calls` and `finish_reason: "tool_calls"` when calls were found, the text as
content otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from orca_jax.errors import RequestError
from orca_jax.structured.guided_decoding import checked_grammar_text
from orca_jax.entrypoints.protocol import ChatCompletionRequest, Tool
from orca_jax.structured.structured_outputs import StructuredOutputsParams, closed_objects
from orca_jax.entrypoints.tool_parsers import (JsonArrayToolParser, NamedToolParser, ToolCallStreamer, ToolParser,
                                   extract_tool_calls, get_tool_parser)

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None  # OpenAI tool dicts for the chat template
    parser: ToolParser | None  # reads tool calls out of the output; None: content only
    constraint: StructuredOutputsParams | None  # the grammar tool_choice forces, if any
    call_format: str  # the call format a template without tool support is told about

    @property
    def parses_tool_calls(self) -> bool:
        return self.parser is not None


NO_TOOLS = ToolPlan(None, None, None, "hermes")


def plan_tools(request: ChatCompletionRequest, auto_tool_parser: str | None) -> ToolPlan:
    """The request's ToolPlan. `auto_tool_parser`: the server's --tool-call-parser when
    --enable-auto-tool-choice is on, else None. Raises RequestError naming the field."""
    if not request.tools:
        return NO_TOOLS
    tools = [tool.as_template_dict() for tool in request.tools]
    call_format = auto_tool_parser or "hermes"
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if auto_tool_parser else "none"
    if choice == "none":
        return ToolPlan(tools, None, None, call_format)
    if choice == "auto":
        if auto_tool_parser is None:
            raise RequestError('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                               "--tool-call-parser", "tool_choice")
        return ToolPlan(tools, get_tool_parser(auto_tool_parser), None, call_format)
    _check_parameter_schemas(request.tools)
    named = request.named_tool
    if named is not None:
        schema = _parameters(named)
        return ToolPlan(tools, NamedToolParser(named.function.name), StructuredOutputsParams(json=schema),
                        call_format)
    schema = required_calls_schema(request.tools, request.parallel_tool_calls)
    return ToolPlan(tools, JsonArrayToolParser(), StructuredOutputsParams(json=schema), call_format)


def _parameters(tool: Tool) -> dict:
    """A function's arguments schema as enforced: with OpenAI's `strict: true` its objects
    take no keys beyond their properties."""
    schema = tool.function.parameters or ANY_OBJECT
    return closed_objects(schema) if tool.function.strict else schema


def required_calls_schema(tools: list[Tool], parallel: bool) -> dict:
    """The JSON schema of tool_choice="required": an array of calls of the given tools, with
    the name first so that a streamed call announces itself before its arguments."""
    calls = [{
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "parameters": _parameters(tool)},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    } for tool in tools]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _check_parameter_schemas(tools: list[Tool]) -> None:
    """A tool whose parameters schema cannot be enforced is named, before any grammar is built
    from it (the combined grammar's error could not say which tool)."""
    for i, tool in enumerate(tools):
        try:
            checked_grammar_text(StructuredOutputsParams(json=_parameters(tool)))
        except RequestError as exc:
            raise RequestError(exc.message.replace("invalid json", "invalid parameters schema"),
                               f"tools.{i}.function.parameters") from None


def finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    """OpenAI's finish reason: "tool_calls" for a reply that ended by calling tools."""
    return "tool_calls" if has_tool_calls and reason == "stop" else reason


def chat_message(text: str, reason: str | None, plan: ToolPlan) -> dict:
    """A non-streamed choice's message and finish reason: tool calls parsed out of the text
    when the plan parses them."""
    if not plan.parses_tool_calls:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": reason}
    content, calls = extract_tool_calls(plan.parser, text)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {"message": message, "finish_reason": finish_reason(reason, bool(calls))}


class StreamedChoice:
    """One streamed choice's text so far and its tool-call streamer."""

    def __init__(self, parser: ToolParser, echo: str):
        self.streamer = ToolCallStreamer(parser)
        self.text = echo
        # The echo was sent already, as content; anything else its parse gives (a forced call's
        # announcement) is still to send.
        echoed = self.streamer.update(echo, False) if echo else []
        self._unsent = [delta for delta in echoed if "content" not in delta]

    def update(self, delta_text: str, final: bool) -> list[dict]:
        self.text += delta_text
        deltas, self._unsent = self._unsent, []
        if delta_text or final:
            deltas += self.streamer.update(self.text, final)
        return deltas
