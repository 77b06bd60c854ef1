"""The OpenAI wire protocol as the server accepts it: request bodies and error bodies.

Request models are strict (a string is not a number, a float is not an integer) so that a
wrongly typed field is a 400 that names it, not a silent coercion. Unknown fields are ignored,
as OpenAI and vLLM do, because clients send fields this server has no use for (`user`,
`metadata`, ...); fields that would change the answer and that the engine cannot honour
(`suffix`, `functions`, `use_beam_search`, ...) are refused instead of ignored.

Structured outputs arrive in any of the spellings clients send (OpenAI's `response_format`,
vLLM's `structured_outputs` and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`); `SamplingRequest.structured_outputs_params` turns whichever one is set into
one StructuredOutputsParams and remembers the field it came from, so an error about the schema
names the field the client wrote. Tools (`tools`, `tool_choice`, assistant `tool_calls`,
`tool` messages) are checked here too; orca_jax/entrypoints/chat_tools.py gives them their meaning.

vLLM's extensions that map onto SamplingParams are accepted too (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`), and its
`cache_salt` (which keys the request's prefix-cache pages); the `openai` client sends them
through `extra_body`.

This module checks wire types and shapes only; the ranges of sampling fields are checked once,
by SamplingParams. Every check, here or there, raises a RequestError that names its field, and
`request_error_to_openai` / `validation_error_to_openai` turn it into the 400 body. Before
validation the decoded body is walked once: nesting past MAX_JSON_DEPTH and strings that are
not valid Unicode are refused there, so nothing later recurses into or tokenizes them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orca_jax.errors import RequestError, check_unicode
from orca_jax.core.sampling_params import SamplingParams
from orca_jax.structured.structured_outputs import StructuredOutputsParams

MAX_N = 128  # OpenAI's own limit on choices per request
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# ---- errors ----------------------------------------------------------------------------------
class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    # OpenAI answers an unknown model or URL (404) as an invalid request too.
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             413: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    error_type = OpenAIError.TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ClientName:
    """What an engine argument is called in one endpoint's request, and a note that says so."""

    field: str
    note: str


def request_error_to_openai(exc: RequestError, names: dict[str, ClientName] | None = None) -> OpenAIError:
    """The one mapping from a RequestError (raised by SamplingParams, LLMEngine or the async
    engine in their own terms) to a 400 in the terms of the request the client sent."""
    param, message = exc.param, exc.message
    renamed = (names or {}).get(param)
    if renamed is not None:
        param, message = renamed.field, f"{message} ({renamed.note})"
    return bad_request(message, param, exc.code)


def _is_union_tag(part) -> bool:
    """pydantic puts the union member it tried into an error's location ('stop', 'list[str]');
    the field's name is the path without those."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"})


def _field_path(error: dict) -> list:
    return [part for part in error.get("loc", ()) if not _is_union_tag(part)]


def _dotted(path) -> str | None:
    return ".".join(str(part) for part in path) or None


def validation_error_to_openai(errors: list[dict]) -> OpenAIError:
    """One pydantic validation error as a 400 naming the field. A union field reports one
    error per member it tried; the member that got furthest into the value (the longest
    location: a list whose item 1 is bad, rather than "not a string") says what is wrong."""
    first = max(errors, key=lambda e: len(_field_path(e)))  # max keeps the first of equals
    loc = _field_path(first)
    kind = first.get("type", "")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, RequestError):
        # Raised by one of the validators below; its param is relative to where it ran.
        param = _dotted(loc + ([cause.param] if cause.param else []))
        if not loc:  # a check across fields: its message names them
            return bad_request(cause.message, param, cause.code)
        prefix = "missing required field" if cause.code == "missing_required_parameter" else "invalid value for"
        return bad_request(f"{prefix} '{param}': {cause.message}", param, cause.code)
    param = _dotted(loc)
    if kind == "missing":
        return bad_request(f"missing required field: '{param}'", param, "missing_required_parameter")
    message = str(cause) if cause is not None else first.get("msg", "invalid value")
    if param is None:
        return bad_request(f"request body must be a JSON object: {message}", None, "invalid_type")
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    return bad_request(f"invalid value for '{param}': {message}", param, code)


# ---- shared request fields -------------------------------------------------------------------
class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk, not only the last


# vLLM request fields that change the answer and that this server does not implement: refused
# by name (400) when given a value other than their no-op default, never silently dropped.
UNSUPPORTED_FIELDS = {
    "use_beam_search": False, "length_penalty": 1.0, "logits_processors": None,
    "return_tokens_as_token_ids": False, "documents": None, "mm_processor_kwargs": None,
    "kv_transfer_params": None, "vllm_xargs": None, "priority": 0, "allowed_token_ids_per_step": None,
}


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SamplingRequest(StrictModel):
    """Fields common to /v1/completions and /v1/chat/completions. Only their wire types are
    checked here; their ranges are SamplingParams' (see `sampling_params`)."""

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = Field(1, le=MAX_N)  # the server's own limit, beyond SamplingParams' n >= 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's token rules and detokenization fields (SamplingParams checks their values).
    min_tokens: int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' log-probabilities, and the top this many
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Structured outputs, in every spelling clients use (at most one per request).
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: llguidance is the one backend
    # vLLM's extension: requests share prefix-cache pages only with requests of the same salt.
    cache_salt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported_fields(cls, body):
        if isinstance(body, dict):
            for field, default in UNSUPPORTED_FIELDS.items():
                if field in body and body[field] != default:
                    raise RequestError(f"{field} is not supported by this server", field)
        return body

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _non_empty_cache_salt(cls, salt):
        if salt is not None and (not isinstance(salt, str) or not salt):  # vLLM's rule
            raise RequestError(f"cache_salt must be a non-empty string if given, got {salt!r}")
        return salt

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys_are_token_ids(cls, bias):
        # OpenAI's map: token ids as JSON object keys (strings of digits) to biases.
        for key in bias or {}:
            if not key.isdigit():
                raise RequestError(f"logit_bias keys must be token ids, got {key!r}")
        return bias or None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true", "stream_options")
        return self

    @field_validator("guided_whitespace_pattern")
    @classmethod
    def _no_whitespace_pattern(cls, pattern):
        if pattern:
            raise RequestError("guided_whitespace_pattern is not supported; use structured_outputs."
                               "disable_any_whitespace for compact JSON")
        return None

    @field_validator("response_format")
    @classmethod
    def _known_response_format(cls, response_format):
        if response_format is None:
            return None
        kind = response_format.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise RequestError(f"unknown response_format type {kind!r}; expected 'text', 'json_object' or "
                               "'json_schema'", "type")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict):
                raise RequestError("a json_schema response_format needs its 'json_schema' object", "json_schema",
                                   "missing_required_parameter")
            if not isinstance(spec.get("name"), str) or not spec["name"]:
                raise RequestError("the json_schema needs a 'name'", "json_schema.name", "missing_required_parameter")
            if not isinstance(spec.get("schema", {}), dict):
                raise RequestError("the schema must be a JSON object", "json_schema.schema")
            if not isinstance(spec.get("strict", False), (bool, type(None))):
                raise RequestError("strict must be true or false", "json_schema.strict")
        return response_format

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's output constraint and the field it was given in (None, None: none).
        Raises RequestError naming the field when more than one is given or one is malformed."""
        given = []
        rf = self.response_format
        if rf is not None and rf.get("type") == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.get("type") == "json_schema":
            spec = rf["json_schema"]
            # OpenAI's strict mode: the schema's properties are the only keys.
            given.append(("response_format.json_schema.schema",
                          {"json": spec.get("schema", {"type": "object"}),
                           "disable_additional_properties": bool(spec.get("strict"))}))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        for legacy, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(self, legacy) is not None:
                given.append((legacy, {key: getattr(self, legacy)}))
        if not given:
            return None, None
        if len(given) > 1:
            raise RequestError("give one output constraint, not several: " + ", ".join(f for f, _ in given),
                               given[1][0])
        field, spec = given[0]
        try:
            return StructuredOutputsParams(**spec), field
        except TypeError as exc:  # an unknown key in a structured_outputs object
            raise RequestError(f"unknown structured_outputs field: {exc}", field) from None
        except RequestError as exc:
            # Name the client's field: structured_outputs.<key> stays, a shorthand names itself.
            param = exc.param if field == "structured_outputs" else field
            raise RequestError(exc.message, param, exc.code) from None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage
                                             or self.stream_options.continuous_usage_stats))

    @property
    def usage_in_every_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None, defaults: dict | None = None) -> SamplingParams:
        """Raises RequestError (naming the SamplingParams field) for a value out of range.
        `prompt_logprobs`: what the endpoint needs of the prompt (echo), if more than asked.
        `defaults`: values for the fields the request left out (the model's generation config)."""
        defaults = {k: v for k, v in (defaults or {}).items() if k not in self.model_fields_set}
        sampled = {name: defaults.get(name, getattr(self, name))
                   for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
        return SamplingParams(
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            max_tokens=max_tokens, **sampled,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, n=self.n, logprobs=logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            min_tokens=self.min_tokens, bad_words=self.bad_words, allowed_token_ids=self.allowed_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logit_bias={int(token): bias for token, bias in self.logit_bias.items()} if self.logit_bias else None,
        )


# ---- /v1/completions -------------------------------------------------------------------------
class CompletionRequest(SamplingRequest):
    # One or more prompts: a string, strings, token ids, or lists of token ids. After
    # validation always a list of prompts, each a string or a list of token ids (whose range
    # the engine checks: it knows the vocabulary).
    prompt: Any
    max_tokens: int = COMPLETION_DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts_as_list(cls, prompt) -> list[str | list[int]]:
        if isinstance(prompt, str) and prompt:
            return [prompt]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) and p for p in prompt):
                return prompt
            if all(_is_token_id(t) for t in prompt):
                return [prompt]
            if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
                return prompt
        raise RequestError(
            "prompt must be a non-empty string, a list of strings, a list of token ids, "
            "or a list of token-id lists"
        )

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix):
        if suffix:
            raise RequestError("suffix is not supported by this server")
        return None

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of is not supported (only best_of == n)", "best_of")
        return self


# ---- /v1/chat/completions --------------------------------------------------------------------
# Content part types of OpenAI's chat API that carry something other than text, by what they carry.
_NON_TEXT_PARTS = {"image_url": "image", "input_image": "image", "image": "image", "input_audio": "audio",
                   "audio_url": "audio", "video_url": "video", "file": "file"}


class ContentPart(StrictModel):
    """One part of a message's content. Only text parts can be served; any other kind is
    refused by name rather than as "not a string"."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type in _NON_TEXT_PARTS:
            raise RequestError(f"{_NON_TEXT_PARTS[self.type]} content is not supported by this text-only model")
        if self.type != "text":
            raise RequestError(f"unknown content part type {self.type!r}; only 'text' parts are supported", "type")
        if self.text is None:
            raise RequestError("a text part needs its 'text'", "text", "missing_required_parameter")
        return self


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    """A tool call the assistant made, in a message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# OpenAI's `reasoning_effort` values.
ReasoningEffort = Literal["minimal", "low", "medium", "high"]


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message answers this call
    # An earlier reply's reasoning sent back (vLLM reads both names): templates that replay it
    # (gpt-oss's analysis messages) get it as `reasoning_content`, `reasoning` and `thinking`.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self):
        # OpenAI lets only an assistant message go without content (it may carry tool calls).
        if self.role != "assistant" and (self.content is None or self.content == []):
            raise RequestError(f"a {self.role!r} message needs content", "content", "missing_required_parameter")
        if self.tool_calls and self.role != "assistant":
            raise RequestError("only an assistant message can carry tool_calls", "tool_calls")
        for name in ("reasoning", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise RequestError(f"only an assistant message can carry {name}", name)
        if self.role == "tool" and not self.tool_call_id:  # OpenAI's rule: it answers a call
            raise RequestError("a 'tool' message needs the tool_call_id of the call it answers", "tool_call_id",
                               "missing_required_parameter")
        return self

    @property
    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            return "".join(part.text for part in content)
        return content or ""

    def as_template_dict(self) -> dict:
        """The message as chat templates read it: tool-call arguments as objects (templates
        render them with `tojson`), and a tool message's call id."""
        message: dict = {"role": self.role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _arguments_object(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            message.update(reasoning_content=reasoning, reasoning=reasoning, thinking=reasoning)
        return message


def _arguments_object(arguments: str):
    """A call's JSON arguments as an object when they parse as one, else the text as sent."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FunctionDefinition(StrictModel):
    name: str | None = None
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _named_with_object_parameters(self):
        if not self.name:
            raise RequestError("a tool needs a function name", "name", "missing_required_parameter")
        if not _FUNCTION_NAME.match(self.name):
            raise RequestError(f"function name {self.name!r} must be 1-64 letters, digits, '_' or '-'", "name")
        if self.parameters is not None and not isinstance(self.parameters, dict):
            raise RequestError("parameters must be a JSON schema object", "parameters")
        return self


class Tool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def as_template_dict(self) -> dict:
        function = {"name": self.function.name, "description": self.function.description or "",
                    "parameters": self.function.parameters or {"type": "object", "properties": {}}}
        return {"type": "function", "function": function}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's extension: the reply starts with the last message's content when that message
    # is the assistant's own (a continued reply).
    echo: bool = False
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    functions: list | None = None
    function_call: str | dict | None = None
    # Chat rendering as vLLM does it: template variables, the generation prompt, continuing
    # the last message instead of answering it, and a template of the request's own.
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    # vLLM's: with a --reasoning-parser, false leaves the reasoning out of the reply.
    include_reasoning: bool = True
    # OpenAI's: how much the model should reason. A template variable of that name (gpt-oss's
    # template writes it into the system message as "Reasoning: high"); templates that do not
    # read it are unchanged.
    reasoning_effort: ReasoningEffort | None = None

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, value):
        if value:
            raise RequestError("the deprecated functions / function_call fields are not supported; send tools "
                               "and tool_choice")
        return None

    @field_validator("tools")
    @classmethod
    def _distinct_tool_names(cls, tools):
        names = [t.function.name for t in tools or []]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise RequestError(f"tool names must be distinct; repeated: {', '.join(duplicated)}")
        return tools or None

    @field_validator("tool_choice")
    @classmethod
    def _known_tool_choice(cls, choice):
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if isinstance(choice, dict):
            function = choice.get("function")
            if choice.get("type") == "function" and isinstance(function, dict) and isinstance(function.get("name"),
                                                                                             str):
                return choice
            raise RequestError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}")
        raise RequestError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}")

    @model_validator(mode="after")
    def _fields_that_need_others(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true; set "
                               "add_generation_prompt to false to continue the last message", "continue_final_message")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise RequestError("tool_choice is only allowed when tools are specified", "tool_choice")
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            if name not in {t.function.name for t in self.tools}:
                raise RequestError(f"tool_choice names the function {name!r}, which is not in tools",
                                   "tool_choice")
        return self

    @property
    def named_tool(self) -> Tool | None:
        """The tool a named tool_choice forces, if any."""
        if not isinstance(self.tool_choice, dict):
            return None
        name = self.tool_choice["function"]["name"]
        return next(t for t in self.tools if t.function.name == name)

    @property
    def max_tokens_field(self) -> str:
        """The field the client set the length with (OpenAI's newer name wins, as in OpenAI)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def echo_text(self) -> str:
        """What an echoed reply starts with: the last message's content if the assistant wrote it."""
        last = self.messages[-1]
        return last.text if self.echo and last.role == "assistant" else ""


# ---- /tokenize and /detokenize (vLLM's) --------------------------------------------------------
class TokenizeRequest(StrictModel):
    """A prompt (`prompt`), or a conversation (`messages`) rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    tools: list[Tool] | None = None
    reasoning_effort: ReasoningEffort | None = None  # rendered as the chat's would be

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give either prompt or messages", "prompt", "missing_required_parameter")
        if self.messages is not None and not self.messages:
            raise RequestError("messages must not be empty", "messages")
        if self.continue_final_message and self.add_generation_prompt and self.messages is not None:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true",
                               "continue_final_message")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


# ---- parsing a body --------------------------------------------------------------------------
# No request field nests deeper than a few levels; a body nested past this is refused before
# anything recurses into it.
MAX_JSON_DEPTH = 32


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _check_json_tree(body: Any) -> None:
    """Walk the decoded body once, without recursion: refuse nesting past MAX_JSON_DEPTH and
    strings that are not valid Unicode (a lone surrogate), naming the field."""
    stack = [(body, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            field = _dotted(path[:1])
            raise bad_request(f"request body nests deeper than {MAX_JSON_DEPTH} levels (in '{field}')", field,
                              "invalid_json")
        if isinstance(value, str):
            try:
                check_unicode(value, _dotted(path) or "request body")
            except RequestError as exc:
                raise request_error_to_openai(exc) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path))
                stack.append((item, path + (key,)))
        elif isinstance(value, list):
            stack.extend((item, path + (i,)) for i, item in enumerate(value))


def parse_request(model: type[StrictModel], raw: bytes) -> StrictModel:
    """Decode and validate a JSON body, raising OpenAIError(400) on the first problem."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise bad_request("request body is not valid JSON: it nests too deeply", None, "invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN, an integer of 4300+ digits
        raise bad_request(f"request body is not valid JSON: {exc}", None, "invalid_json") from None
    _check_json_tree(body)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error_to_openai(exc.errors()) from None
