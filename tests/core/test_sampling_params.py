"""SamplingParams: vLLM names and defaults, normalisation, validation on construction."""

from __future__ import annotations

import dataclasses
import math

import pytest

from orca_jax import SamplingParams
from orca_jax.errors import RequestError
from orca_jax.core.sampling_params import MIN_TEMPERATURE

# vLLM's SamplingParams defaults for the fields orca_jax shares (stop / stop_token_ids are
# normalised to empty lists, as vLLM does).
VLLM_DEFAULTS = dict(
    max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, stop=[],
    stop_token_ids=[], ignore_eos=False, n=1, logprobs=None, presence_penalty=0.0,
    frequency_penalty=0.0, repetition_penalty=1.0, include_stop_str_in_output=False,
)


def test_defaults_equal_vllm():
    p = SamplingParams()
    for name, value in VLLM_DEFAULTS.items():
        assert getattr(p, name) == value, name
    assert not p.greedy and not p.uses_penalties


def test_field_names_are_vllm_names():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(VLLM_DEFAULTS) <= names


def test_stop_string_becomes_list_and_lists_are_copied():
    assert SamplingParams(stop="###").stop == ["###"]
    stops = ["a", "bc"]
    p = SamplingParams(stop=stops, stop_token_ids=(5, 7))
    assert p.stop == ["a", "bc"] and p.stop_token_ids == [5, 7]
    stops.append("d")
    assert p.stop == ["a", "bc"]


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=40).top_k == 40


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(presence_penalty=0.5).uses_penalties
    assert SamplingParams(frequency_penalty=-0.1).uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties


def test_valid_edges_are_accepted():
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, min_p=1.0, n=3, logprobs=0,
                   presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.01, seed=0)
    SamplingParams(top_p=1e-6, min_p=0.0, presence_penalty=2.0, frequency_penalty=-2.0, logprobs=20)


INVALID = [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5),
    ("temperature", -1.0), ("temperature", -1e-9),
    ("top_k", -2), ("top_k", 1.5),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1),
    ("min_p", 2.0), ("min_p", -0.1),
    ("n", 0), ("n", -1),
    ("logprobs", -1),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("seed", 1.5),
    ("stop", ""), ("stop", ["ok", ""]),
    ("stop_token_ids", [-1]),
    ("output_kind", "streaming"), ("output_kind", None), ("output_kind", "DELTA"),
]


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_is_a_request_error_naming_the_field(field, value):
    with pytest.raises(RequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and info.value.code == "invalid_value"


# Values no float32 array of the step may receive (inf, NaN, overflow to inf or to 0), and
# booleans where numbers are meant.
UNREPRESENTABLE = [
    ("temperature", math.inf), ("temperature", math.nan), ("temperature", 2.5), ("temperature", True),
    ("top_p", math.nan), ("min_p", math.inf), ("presence_penalty", math.nan), ("frequency_penalty", -math.inf),
    ("repetition_penalty", 1e300), ("repetition_penalty", 1e-300), ("repetition_penalty", math.inf),
    ("max_tokens", True), ("top_k", False), ("n", True), ("logprobs", True), ("seed", True),
    ("stop_token_ids", [True]), ("temperature", "1.0"), ("temperature", 10**400), ("top_p", -10**400),
]


@pytest.mark.parametrize("field,value", UNREPRESENTABLE, ids=[f"{f}={v!r}" for f, v in UNREPRESENTABLE])
def test_values_the_step_cannot_represent_are_refused(field, value):
    with pytest.raises(RequestError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_request_error_is_a_value_error():
    assert issubclass(RequestError, ValueError)


def test_tiny_temperature_is_raised_to_the_smallest_that_samples():
    assert SamplingParams(temperature=1e-300).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0.5).temperature == 0.5


def test_large_integers_are_accepted_where_they_keep_a_meaning():
    # top_k past any vocabulary keeps all of it (the step clamps it); any integer seed folds.
    assert SamplingParams(top_k=10**12).top_k == 10**12
    assert SamplingParams(seed=10**30).seed == 10**30 and SamplingParams(seed=-5).seed == -5
    SamplingParams(max_tokens=10**12, stop_token_ids=[10**30])


def test_output_kind_defaults_to_cumulative_and_takes_vllms_three_kinds():
    from orca_jax.core.sampling_params import OUTPUT_KINDS

    assert SamplingParams().output_kind == "cumulative"  # vLLM's default, RequestOutputKind.CUMULATIVE
    assert OUTPUT_KINDS == ("cumulative", "delta", "final_only")
    for kind in OUTPUT_KINDS:
        assert SamplingParams(output_kind=kind).output_kind == kind
    # A copy with another kind keeps every other field (what LLM and the server do).
    p = SamplingParams(max_tokens=5, stop="x", top_k=-1, temperature=1e-300)
    q = dataclasses.replace(p, output_kind="delta")
    assert q.output_kind == "delta" and p.output_kind == "cumulative"
    assert dataclasses.replace(q, output_kind="cumulative") == p
    with pytest.raises(RequestError, match="output_kind must be one of cumulative, delta, final_only, got 'x'"):
        SamplingParams(output_kind="x")
