"""A model's Jinja chat template rendered as transformers renders it, without transformers.

A chat template is untrusted code from a model file, so it runs in jinja2's immutable sandbox,
set up as transformers' `render_jinja_template` sets it up (transformers 5): `trim_blocks` and
`lstrip_blocks`, the loop-control extension, `{% generation %}` blocks (rendered, not tracked),
`raise_exception`, a `tojson` that does not escape HTML, `strftime_now`, and the guarded `dict`
and `namespace`. What the template sees is rebuilt from plain JSON-like values first
(`plain_data`), and message keys whose value is None are dropped, as transformers does, so the
same conversation renders to the same text. tests/loading/test_tokenizer.py holds the two equal.

jinja2 is imported on first use: a model that is never chatted with does not load it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import numpy as np

# The names transformers copies a message's reasoning under (the first is what templates read).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_MIN_JINJA = (3, 1, 6)  # older versions have known sandbox escapes


def render_chat(template: str, messages: list, *, tools: list | None = None, documents: list | None = None,
                add_generation_prompt: bool = False, **variables) -> str:
    """The text of one conversation under `template`. `tools` are OpenAI-style JSON schemas
    (callables are converted by transformers' `get_json_schema`, imported only then);
    `variables` (the tokenizer's special tokens, a caller's extra kwargs) are visible to the
    template as globals."""
    if tools is not None:
        tools = [tool if isinstance(tool, dict) else _schema_of_function(tool) for tool in tools]
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = plain_data(normalize_messages(messages))
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
    return compiled_template(template).render(
        messages=alias_reasoning_fields(chat), tools=plain_data(tools), documents=plain_data(documents),
        add_generation_prompt=add_generation_prompt, **plain_data(variables))


def normalize_messages(messages) -> list[dict]:
    """Messages as dicts (dataclasses and pydantic models converted), keys holding None dropped:
    OpenAI clients send `content=None` or `tool_calls=None`, which templates would render as text."""
    messages = _objects_to_dicts(getattr(messages, "messages", messages))
    normalized = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        normalized.append({key: value for key, value in message.items() if value is not None})
    return normalized


def alias_reasoning_fields(chat: list) -> list:
    """A message's reasoning under every name templates read it by (`reasoning_content`,
    and `thinking` for gpt-oss templates)."""
    aliased = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def plain_data(value: Any) -> Any:
    """`value` rebuilt from JSON types only; anything else becomes an inert "<TypeName>". The
    sandbox does not know which methods of a rich object are dangerous, so none reach it."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, numpy strings) carry extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    if isinstance(value, np.generic):  # np.bool_(False) would otherwise be a truthy placeholder
        return plain_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _objects_to_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _objects_to_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_objects_to_dicts(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_objects_to_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _objects_to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _objects_to_dicts(value.model_dump())
    return value


def _schema_of_function(tool) -> dict:
    import inspect

    if not (inspect.isfunction(tool) or inspect.ismethod(tool)):
        raise ValueError("Tools should either be a JSON schema, or a callable function with type hints "
                         "and a docstring suitable for auto-conversion to a schema.")
    from transformers.utils.chat_template_utils import get_json_schema

    return get_json_schema(tool)


@functools.lru_cache(maxsize=16)
def compiled_template(template: str):
    """The template compiled once per process (templates are a few KB; a server renders one
    per request)."""
    return _environment().from_string(template)


@functools.cache
def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit()) < _MIN_JINJA:
        raise ImportError(f"chat templates need jinja2>=3.1.6 (older versions have sandbox escapes); "
                          f"found {jinja2.__version__}")

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's part for training
        masks; rendering only needs its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class TemplateNamespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses underscore names (no reaching CPython internals)."""

        def __init__(*args, **kwargs):  # noqa: N805 - jinja's own signature trick, so namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    class TemplateDict:
        """`dict(...)` without attribute access to the real class."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):  # noqa: A002 - the name templates call it with
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env
