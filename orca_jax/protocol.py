"""The OpenAI wire protocol as the server accepts it: request bodies and error bodies.

Request models are strict (a string is not a number, a float is not an integer) so that a
wrongly typed field is a 400 that names it, not a silent coercion. Unknown fields are ignored,
as OpenAI and vLLM do, because clients send fields this server has no use for (`user`,
`metadata`, ...); fields that would change the answer and that the engine cannot honour
(`logit_bias`, `suffix`, `tools`, ...) are refused instead of ignored.

vLLM's extensions that map onto SamplingParams are accepted too (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`); the
`openai` client sends them through `extra_body`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orca_jax.sampling_params import SamplingParams

MAX_N = 128  # OpenAI's own limit on choices per request
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# ---- errors ----------------------------------------------------------------------------------
class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
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


def _is_union_tag(part) -> bool:
    """pydantic puts the union member it tried into an error's location ('stop', 'list[str]');
    the field's name is the path without those."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"})


def validation_error_to_openai(errors: list[dict]) -> OpenAIError:
    """The first pydantic validation error as a 400 naming the field."""
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if not _is_union_tag(part)]
    kind = first.get("type", "")
    param = ".".join(str(part) for part in loc) or None
    if kind == "missing":
        return bad_request(f"missing required field: '{param}'", param, "missing_required_parameter")
    cause = (first.get("ctx") or {}).get("error")
    message = str(cause) if cause is not None else first.get("msg", "invalid value")
    if param is None and kind == "value_error":
        # A check across fields (model validator): its message starts with the field it blames.
        return bad_request(message, _first_word(message), "invalid_value")
    if param is None:
        return bad_request(f"request body must be a JSON object: {message}", None, "invalid_type")
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    return bad_request(f"invalid value for '{param}': {message}", param, code)


_FIRST_WORD = re.compile(r"^\s*([A-Za-z_]+)")


def _first_word(message: str) -> str | None:
    match = _FIRST_WORD.match(message)
    return match[1] if match else None


def engine_error_to_openai(exc: Exception, prompt_field: str, logprobs_field: str) -> OpenAIError:
    """Map the ValueError/TypeError of SamplingParams or LLMEngine.add_request to a 400. Their
    messages start with the name of what is wrong ("temperature must be ...", "prompt is 600
    tokens, but max_model_len ...", "request needs 40 KV pages ..."), which names the field."""
    message = str(exc)
    word = _first_word(message)
    param = {"prompt": prompt_field, "logprobs": logprobs_field, "request": "max_tokens"}.get(word, word)
    code = "context_length_exceeded" if "max_model_len" in message else "invalid_value"
    return bad_request(message, param, code)


# ---- shared request fields -------------------------------------------------------------------
class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool = False


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SamplingRequest(StrictModel):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, stop):
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not all(stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, bias):
        if bias:
            raise ValueError("logit_bias is not supported by this server")
        return None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            min_p=self.min_p, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, n=self.n, logprobs=logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


# ---- /v1/completions -------------------------------------------------------------------------
class CompletionRequest(SamplingRequest):
    # One or more prompts: a string, strings, token ids, or lists of token ids. After
    # validation always a list of prompts, each a string or a list of token ids.
    prompt: Any
    max_tokens: int = Field(COMPLETION_DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(None, ge=0)
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
        raise ValueError(
            "prompt must be a non-empty string, a list of strings, a list of token ids, "
            "or a list of token-id lists"
        )

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix):
        if suffix:
            raise ValueError("suffix is not supported by this server")
        return None

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n)")
        return self


# ---- /v1/chat/completions --------------------------------------------------------------------
class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list | None = None
    functions: list | None = None
    response_format: dict | None = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, tools):
        if tools:
            raise ValueError("tool and function calling are not supported by this server")
        return None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, response_format):
        if response_format and response_format.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return response_format

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_request(model: type[StrictModel], raw: bytes) -> StrictModel:
    """Decode and validate a JSON body, raising OpenAIError(400) on the first problem."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", None, "invalid_json") from None
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error_to_openai(exc.errors()) from None
