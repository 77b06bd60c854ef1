"""StructuredOutputsParams: what a request's output must match (vLLM's names and semantics).

Exactly one constraint per request:

    json          a JSON schema (dict or its JSON text): the output is JSON that validates
    json_object   True: the output is any JSON object (OpenAI's response_format json_object)
    regex         the output matches this regular expression (Rust `regex` syntax)
    choice        the output is exactly one of these strings
    grammar       a context-free grammar, Lark or GBNF (llama.cpp's) syntax, as llguidance takes it

`disable_additional_properties` (vLLM's flag; what OpenAI's `strict: true` asks for) closes
every object of a JSON schema that does not say otherwise (`additionalProperties: false`): a
schema's properties are then the only keys, where JSON Schema's default lets a model go on
adding keys of its own until max_tokens cuts the JSON short.

`starts_after` leaves the output free until it holds that text (the reasoning of a thinking
model: orca_jax.entrypoints.reasoning_parsers), and constrains what follows.

`disable_any_whitespace` writes JSON compactly (`{"a":1}`); by default JSON is written with one
space after ':' and ',' and no other whitespace, which reads like what models were trained on
while leaving a small model no room to wander into endless newlines.

This module checks shapes and types only, raising RequestError naming
`structured_outputs.<field>`; whether a schema, regex or grammar compiles is the grammar
engine's to say (orca_jax.structured.guided_decoding), also before anything is queued.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from orca_jax.errors import RequestError

CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")
# A choice list becomes one regex (orca_jax.structured.guided_decoding.choice_regex); past this
# many alternatives its automaton takes seconds to build, so longer lists are refused up front.
MAX_CHOICES = 20_000


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # The constraint starts once the output holds this text's tokens (a reasoning model's end of
    # reasoning, set by the server's --reasoning-parser); the output before it is free. Not part
    # of the grammar, so not of its cache key.
    starts_after: str | None = None

    def __post_init__(self):
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise RequestError(
                "structured outputs take exactly one of json, json_object, regex, choice, grammar; got "
                + (", ".join(given) if given else "none"), "structured_outputs")
        if isinstance(self.json, str):
            object.__setattr__(self, "json", _parse_schema_text(self.json))
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise RequestError("json must be a JSON schema (an object)", "structured_outputs.json")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise RequestError("regex must be a non-empty string", "structured_outputs.regex")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise RequestError("grammar must be a non-empty string", "structured_outputs.grammar")
        if self.json_object not in (None, True, False):
            raise RequestError("json_object must be true or false", "structured_outputs.json_object")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise RequestError("choice must be a non-empty list of non-empty strings", "structured_outputs.choice")
            if len(self.choice) > MAX_CHOICES:
                raise RequestError(f"choice has {len(self.choice)} alternatives; at most {MAX_CHOICES} are supported",
                                   "structured_outputs.choice")
            object.__setattr__(self, "choice", tuple(self.choice))
        for flag in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, flag), bool):
                raise RequestError(f"{flag} must be true or false", f"structured_outputs.{flag}")

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def field(self) -> str:
        """The field errors about the constraint name."""
        return f"structured_outputs.{self.kind}"

    def cache_key(self) -> str:
        """One string per distinct constraint: compiled grammars are cached under it."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace, self.disable_additional_properties],
                          sort_keys=True, separators=(",", ":"))

    def json_schema(self) -> dict | bool:
        """The schema to enforce (json / json_object), closed when asked."""
        schema = {"type": "object"} if self.kind == "json_object" else self.json
        return closed_objects(schema) if self.disable_additional_properties else schema


# Keywords whose value maps names to subschemas (not a schema itself), and those whose value is data.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("const", "enum", "default", "examples")


def closed_objects(schema):
    """A copy of a JSON schema in which every object schema without its own
    `additionalProperties` allows no keys beyond its `properties`."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_objects(sub) for name, sub in value.items()}
        else:
            closed[key] = value if key in _DATA else closed_objects(value)
    if (closed.get("type") == "object" or "properties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _parse_schema_text(text: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RequestError(f"json is not valid JSON: {exc}", "structured_outputs.json") from None
