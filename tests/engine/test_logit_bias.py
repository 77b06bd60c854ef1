"""OpenAI's logit_bias through the engine: biased rows beside free ones in the same steps, no
new compiled program, and bad maps refused naming the field."""

from __future__ import annotations

import pytest

from orca_jax import SamplingParams
from orca_jax.core.sampling_params import MAX_LOGIT_BIAS
from orca_jax.errors import RequestError
from orca_jax.worker.compile_guard import no_compiles

GREEDY = dict(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory()


def test_a_large_bias_forces_its_token_a_ban_removes_one_and_free_rows_are_untouched(engine, generate):
    free = generate({"free": ("Once upon a time", SamplingParams(**GREEDY))})["free"]
    banned_first = generate({"b": ("The quick brown fox", SamplingParams(**GREEDY))})["b"]
    with no_compiles():
        out = generate({
            "free": ("Once upon a time", SamplingParams(**GREEDY)),
            "forced": ("Hello", SamplingParams(**GREEDY, logit_bias={42: 100.0})),
            "sampled": ("Hello", SamplingParams(temperature=1.0, seed=1, max_tokens=10, ignore_eos=True,
                                                logit_bias={"43": 100.0})),  # JSON's string keys
            "banned": ("The quick brown fox", SamplingParams(**GREEDY, logit_bias={t: -100.0 for t in banned_first})),
        })
    assert out["free"] == free
    assert out["forced"] == [42] * 10 and out["sampled"] == [43] * 10
    assert not set(out["banned"]) & set(banned_first), (out["banned"], banned_first)


def test_biases_beyond_the_range_are_clamped():
    params = SamplingParams(logit_bias={1: 1e6, 2: -1e6, 3: 0.5})
    assert params.logit_bias == {1: 100.0, 2: -100.0, 3: 0.5}


@pytest.mark.parametrize("bias", [{-1: 1.0}, {1: float("nan")}, {1: "x"}, {"a": 1.0}, [1, 2],
                                  {t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}])
def test_bad_maps_are_refused_naming_the_field(bias):
    with pytest.raises(RequestError) as error:
        SamplingParams(logit_bias=bias)
    assert error.value.param == "logit_bias"


def test_a_token_outside_the_vocabulary_is_refused_and_queues_nothing(engine):
    with pytest.raises(RequestError) as error:
        engine.add_request("outside", "hi", SamplingParams(logit_bias={engine.model_config.vocab_size: 1.0}))
    assert error.value.param == "logit_bias" and "outside" not in engine.requests
