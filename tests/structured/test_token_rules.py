"""vLLM's token rules (allowed_token_ids, bad_words, min_tokens): the bitmask rows they build,
and their effect through the engine on the tiny random Llama, where the weights do not care
what the rules forbid: a rule the engine dropped would show in the tokens."""

from __future__ import annotations

import numpy as np
import pytest

from orca_jax import SamplingParams
from orca_jax.errors import RequestError
from orca_jax.structured.token_rules import TokenRules, bad_word_token_ids, pack_bits
from orca_jax.worker.compile_guard import no_compiles

V = 100


def allowed_ids(row: np.ndarray, vocab_size: int = V) -> set[int]:
    bits = (row.astype(np.int64)[:, None] >> np.arange(32)) & 1
    return set(np.flatnonzero(bits.reshape(-1)[:vocab_size]).tolist())


def rules(**fields) -> TokenRules:
    params = SamplingParams(**fields)
    words = {"cat": [7], " cat": [8], "big dog": [3, 4], " big dog": [5, 3, 4]}
    return TokenRules.build(params, lambda text: words.get(text, [9]), {2}, V)


def full_row() -> np.ndarray:
    return np.full(-(-V // 32), -1, np.int32)


def test_packed_bits_hold_exactly_the_ids_including_the_sign_bit():
    ids = {0, 5, 31, 32, 63, 64, 99}
    assert allowed_ids(pack_bits(ids, V)) == ids


def test_no_rules_build_nothing():
    assert rules() is None
    assert rules(max_tokens=4, temperature=0.5) is None


def test_allowed_tokens_keep_only_themselves():
    row = full_row()
    rules(allowed_token_ids=[1, 31, 40]).apply(row, [], 0)
    assert allowed_ids(row) == {1, 31, 40}


def test_a_one_token_bad_word_is_always_masked_a_longer_one_after_its_prefix():
    r = rules(bad_words=["cat", "big dog"])
    assert r.banned == (7, 8) and r.reads_output
    row = full_row()
    r.apply(row, [11, 12], 2)
    assert allowed_ids(row) == set(range(V)) - {7, 8}
    row = full_row()
    r.apply(row, [11, 3], 2)  # the output ends with "big": "dog" (4) may not follow
    assert allowed_ids(row) == set(range(V)) - {7, 8, 4}
    row = full_row()
    r.apply(row, [5, 3], 2)  # " big" spelled with its space token: same last token
    assert 4 not in allowed_ids(row)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    r = rules(min_tokens=3, max_tokens=8, stop_token_ids=[17])
    assert r.in_force(2) and not r.in_force(3)
    row = full_row()
    r.apply(row, [1, 1], 2)
    assert allowed_ids(row) == set(range(V)) - {2, 17}
    row = full_row()
    r.apply(row, [1, 1, 1], 3)
    assert allowed_ids(row) == set(range(V))
    assert rules(min_tokens=3, max_tokens=8, ignore_eos=True).end_tokens == ()


def test_bad_words_are_banned_as_written_and_after_a_space():
    table = {"dog": [4], " dog": [6, 4], "cat": [7], " cat": [8]}
    assert bad_word_token_ids("cat", table.get) == [[7], [8]]
    # A tokenizer that writes the space as its own token: the spaced spelling adds nothing.
    assert bad_word_token_ids("dog", table.get) == [[4]]


@pytest.mark.parametrize("fields, param", [
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=9, max_tokens=8), "min_tokens"),
    (dict(bad_words=[" "]), "bad_words"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-3]), "allowed_token_ids"), (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(spaces_between_special_tokens=False), "spaces_between_special_tokens"),
])
def test_bad_values_are_refused_naming_the_field(fields, param):
    with pytest.raises(RequestError) as info:
        SamplingParams(**fields)
    assert info.value.param == param


# ---- through the engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory()


GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_allowed_token_ids_bound_every_sample_and_leave_free_rows_alone(engine, generate):
    allowed = [10, 11, 12, 40, 41]
    free = generate({"free": ("Once upon a time", SamplingParams(**GREEDY))})["free"]
    with no_compiles():
        out = generate({
            "free": ("Once upon a time", SamplingParams(**GREEDY)),
            "allowed": ("The quick brown fox", SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                                                              allowed_token_ids=allowed)),
        })
    assert set(out["allowed"]) <= set(allowed) and len(out["allowed"]) == 12
    assert out["free"] == free


def _contains(tokens: list[int], run: list[int]) -> bool:
    return any(tokens[i:i + len(run)] == run for i in range(len(tokens) - len(run) + 1))


def test_a_multi_token_bad_word_never_appears(engine, generate):
    prompt = "Paris is the capital of"
    free = generate({"free": (prompt, SamplingParams(**GREEDY))})["free"]
    # A word the free output spells in two or more tokens.
    for i in range(len(free) - 1):
        word = engine.tokenizer.decode(free[i:i + 2]).strip()
        spellings = bad_word_token_ids(word, engine._encode_plain) if word else []
        if any(len(s) >= 2 and _contains(free, s) for s in spellings):
            break
    else:
        pytest.fail(f"no two-token word in the free output {free}")
    with no_compiles():
        out = generate({"banned": (prompt, SamplingParams(**GREEDY, bad_words=[word]))})["banned"]
    assert not any(_contains(out, s) for s in spellings), (word, spellings, out)
    assert out != free


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(engine, generate):
    prompt = "def add(a, b):"
    free = generate({"free": (prompt, SamplingParams(**GREEDY))})["free"]
    first = free[0]
    stopped = generate({"stop": (prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                                stop_token_ids=[first]))})["stop"]
    assert stopped == [first]  # without min_tokens the stop id ends it at once
    held = generate({"held": (prompt, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6,
                                                             stop_token_ids=[first]))})["held"]
    assert len(held) >= 6 and first not in held[:6]
    text = engine.tokenizer.decode(free[:1]).strip() or engine.tokenizer.decode(free[:2]).strip()
    engine.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, stop=[text],
                                                   ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"


def test_a_rule_with_a_token_outside_the_vocabulary_is_refused_and_queues_nothing(engine):
    with pytest.raises(RequestError) as info:
        engine.add_request("bad", "hello", SamplingParams(allowed_token_ids=[engine.model_config.vocab_size]))
    assert info.value.param == "allowed_token_ids" and not engine.requests


def test_truncate_prompt_tokens_keeps_the_prompts_end(engine):
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    engine.add_request("t", ids, SamplingParams(max_tokens=2, temperature=0.0, truncate_prompt_tokens=4))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert list(outs[0].prompt_token_ids) == ids[-4:]
