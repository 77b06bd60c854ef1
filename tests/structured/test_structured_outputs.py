"""StructuredOutputsParams: one constraint per request, shapes checked on construction with the
field named; a stable cache key; closing objects for strict schemas."""

from __future__ import annotations

import jsonschema
import pytest

from orca_jax import SamplingParams
from orca_jax.errors import RequestError
from orca_jax.structured.structured_outputs import StructuredOutputsParams, closed_objects


@pytest.mark.parametrize("kwargs,param", [
    (dict(), "structured_outputs"),
    (dict(regex="a", choice=["a"]), "structured_outputs"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json=[1, 2]), "structured_outputs.json"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(regex=5), "structured_outputs.regex"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", ""]), "structured_outputs.choice"),
    (dict(choice="ab"), "structured_outputs.choice"),
    (dict(grammar="   "), "structured_outputs.grammar"),
    (dict(json_object=True, disable_any_whitespace="yes"), "structured_outputs.disable_any_whitespace"),
])
def test_malformed_constraints_name_their_field(kwargs, param):
    with pytest.raises(RequestError) as error:
        StructuredOutputsParams(**kwargs)
    assert error.value.param == param


def test_json_text_is_parsed_and_keys_are_stable():
    a = StructuredOutputsParams(json='{"type": "object", "properties": {"x": {"type": "integer"}}}')
    b = StructuredOutputsParams(json={"properties": {"x": {"type": "integer"}}, "type": "object"})
    assert a.json == b.json and a.cache_key() == b.cache_key() and a.kind == "json"
    assert StructuredOutputsParams(choice=["a", "b"]).cache_key() != StructuredOutputsParams(choice=["b", "a"]).cache_key()
    assert a.cache_key() != StructuredOutputsParams(json=b.json, disable_any_whitespace=True).cache_key()
    assert StructuredOutputsParams(json_object=True).json_schema() == {"type": "object"}


def test_sampling_params_take_only_structured_outputs_params():
    assert SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")).structured_outputs.kind == "regex"
    with pytest.raises(RequestError) as error:
        SamplingParams(structured_outputs={"regex": "a+"})
    assert error.value.param == "structured_outputs"


def test_closed_objects_refuse_extra_keys_at_every_depth_and_keep_explicit_choices():
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "items": {"type": "array", "items": {"properties": {"b": {"type": "string"}}}},
            "open": {"type": "object", "additionalProperties": True},
            # A property named like a keyword is a property, not a keyword.
            "properties": {"type": "object", "properties": {}},
            "const_obj": {"const": {"type": "object"}},
        },
        "$defs": {"d": {"type": "object"}},
    }
    closed = closed_objects(schema)
    validator = jsonschema.Draft202012Validator(closed)
    assert validator.is_valid({"inner": {"a": 1}, "items": [{"b": "x"}], "open": {"anything": 1},
                               "properties": {}, "const_obj": {"type": "object"}})
    for extra in ({"zzz": 1}, {"inner": {"a": 1, "z": 2}}, {"items": [{"b": "x", "z": 1}]}, {"properties": {"z": 1}}):
        assert not validator.is_valid(extra), extra
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["properties"]["const_obj"] == {"const": {"type": "object"}}  # data, untouched
    assert "additionalProperties" not in schema, "the caller's schema is not changed"
    assert StructuredOutputsParams(json=schema, disable_additional_properties=True).json_schema() == closed
