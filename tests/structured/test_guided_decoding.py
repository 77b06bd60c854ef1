"""Constrained decoding through the engine, on the tiny random Llama: outputs always match their
constraint (JSON schema, regex, choice, grammar) whatever the random weights want, constrained
and free rows share steps without changing each other's tokens, a preempted constrained
sequence resumes its grammar, a compiling grammar holds back only its own request, a failed
compile fails only its own, bad constraints are refused before queueing, and nothing compiles
after warm-up."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from orca_jax import SamplingParams
from orca_jax.worker.compile_guard import no_compiles
from orca_jax.errors import RequestError
from orca_jax.structured.guided_decoding import GrammarCompiler
from orca_jax.structured.structured_outputs import StructuredOutputsParams as Constraint

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):", "Once upon a time"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
# Short whatever the weights: what a crowd of preempted sequences must finish within max_tokens.
PET = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 99}},
       "required": ["pet", "age"], "additionalProperties": False}
CODE_REGEX = r"[A-Z]{2}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe later"]
# Lark: a tiny arithmetic language.
GRAMMAR = 'start: expr\nexpr: NUMBER | "(" expr OP expr ")"\nOP: "+" | "*"\nNUMBER: /[0-9]{1,3}/'


def constraints() -> dict[str, Constraint]:
    return {"json": Constraint(json=PERSON), "regex": Constraint(regex=CODE_REGEX),
            "choice": Constraint(choice=CHOICES), "grammar": Constraint(grammar=GRAMMAR),
            "json_object": Constraint(json_object=True)}


def assert_satisfies(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(CODE_REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"[0-9]{1,3}|\(.*\)", text) and text.count("(") == text.count(")"), text


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    """Small pool (23 usable pages of 8 tokens) so that crowds of long prompts preempt."""
    return tiny_engine_factory(max_num_seqs=8, max_num_batched_tokens=32, page_size=8, num_pages=24,
                               max_model_len=128)


@pytest.fixture(autouse=True)
def leave_engine_clean(request):
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        for request_id in list(engine.requests):
            engine.abort(request_id)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.allocator.num_used == 0, "KV pages leaked"
        assert engine.scheduler.num_needing_host_tokens == 0


def run(engine, requests: list[tuple[str, str, SamplingParams]]) -> dict:
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    final = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert set(final) == {r[0] for r in requests}
    assert engine.allocator.num_used == 0
    return final


def mixed_requests(tag: str) -> list[tuple[str, str, SamplingParams]]:
    """Every kind of constraint, greedy and seeded, next to free requests."""
    requests = []
    for i, (kind, constraint) in enumerate(constraints().items()):
        greedy = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=constraint)
        seeded = SamplingParams(max_tokens=60, temperature=1.0, seed=100 + i, structured_outputs=constraint)
        requests += [(f"{tag}-{kind}-greedy", PROMPTS[i % 4], greedy), (f"{tag}-{kind}-seeded", PROMPTS[(i + 1) % 4],
                                                                       seeded)]
    requests += [(f"{tag}-free-{i}", p, SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.9, seed=i,
                                                       ignore_eos=True))
                 for i, p in enumerate(PROMPTS)]
    return requests


def test_constrained_outputs_match_and_share_steps_without_changing_anyone(engine):
    together = run(engine, mixed_requests("mix"))
    for request_id, out in together.items():
        kind = request_id.split("-")[1]
        if kind == "json_object":  # any object: a random model's keys can outlast max_tokens
            assert out.text.startswith("{") and (out.finish_reason == "length" or isinstance(json.loads(out.text), dict))
        elif kind != "free":
            assert out.finish_reason == "stop", (request_id, out.text)
            assert_satisfies(kind, out.text)
    # Batch invariance: each request alone gives the same tokens (greedy and seeded).
    for request_id, prompt, params in mixed_requests("solo"):
        alone = run(engine, [(request_id, prompt, params)])[request_id]
        assert alone.token_ids == together[request_id.replace("solo", "mix", 1)].token_ids, request_id


def test_no_compiles_after_warmup_and_same_tokens_one_step_at_a_time(engine):
    requests = mixed_requests("overlap")
    with no_compiles("serving constrained and free requests"):
        overlapped = run(engine, requests)
    engine.config = engine.config.__class__(**{**engine.config.__dict__, "async_scheduling": False})
    try:
        one_at_a_time = run(engine, [(f"sync-{r}", p, s) for r, p, s in requests])
    finally:
        engine.config = engine.config.__class__(**{**engine.config.__dict__, "async_scheduling": True})
    for request_id, out in overlapped.items():
        assert one_at_a_time[f"sync-{request_id}"].token_ids == out.token_ids, request_id


def test_preempted_constrained_sequences_resume_their_grammar(engine):
    """Eight ~45-token prompts and their JSON need ~60 pages at once; the pool has 23, so
    sequences are preempted and recomputed, their matchers kept: outputs equal solo runs."""
    prompt = " ".join(["the lazy dog jumps"] * 10)
    requests = [(f"crowd-{i}", prompt + f" {i}", SamplingParams(max_tokens=60, temperature=0.0 if i % 2 else 1.0,
                                                                 seed=i, structured_outputs=Constraint(json=PET)))
                for i in range(8)]
    preemptions = engine.scheduler.num_preemptions
    crowd = run(engine, requests)
    assert engine.scheduler.num_preemptions > preemptions, "the crowd did not preempt"
    for request_id, prompt_i, params in requests:
        out = crowd[request_id]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PET)
        assert run(engine, [("alone", prompt_i, params)])["alone"].token_ids == out.token_ids


def test_n_samples_each_follow_their_own_matcher(engine):
    params = SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=7, structured_outputs=Constraint(regex=CODE_REGEX))
    (out,) = run(engine, [("n4", PROMPTS[0], params)]).values()
    assert len(out.outputs) == 4
    for completion in out.outputs:
        assert re.fullmatch(CODE_REGEX, completion.text) and completion.finish_reason == "stop"


def test_a_complete_grammar_ends_generation_even_with_ignore_eos(engine):
    for ignore_eos in (False, True):
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=ignore_eos,
                                structured_outputs=Constraint(choice=["a", "b"]))
        (out,) = run(engine, [(f"choice-{ignore_eos}", PROMPTS[1], params)]).values()
        assert out.text in ("a", "b") and out.finish_reason == "stop" and len(out.token_ids) == 1


def test_max_tokens_cuts_an_unfinished_grammar_with_length(engine):
    params = SamplingParams(max_tokens=3, temperature=0.0, structured_outputs=Constraint(json=PERSON))
    (out,) = run(engine, [("short", PROMPTS[0], params)]).values()
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith("{")


@pytest.mark.parametrize("constraint,param", [
    (dict(json={"type": "strange"}), "structured_outputs.json"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_bad_constraints_are_refused_before_anything_is_queued(engine, constraint, param):
    params = SamplingParams(max_tokens=5, structured_outputs=Constraint(**constraint))
    with pytest.raises(RequestError) as error:
        engine.add_request("bad", PROMPTS[0], params)
    assert error.value.param == param
    assert not engine.requests and not engine.scheduler.waiting


def test_a_compiling_grammar_holds_back_only_its_own_request(engine, monkeypatch):
    release = threading.Event()
    real_build = GrammarCompiler._build

    def slow_build(self, text):
        assert release.wait(60), "the test never released the compile"
        return real_build(self, text)

    monkeypatch.setattr(GrammarCompiler, "_build", slow_build)
    slow = Constraint(regex="[a-c]{4}")  # a constraint no earlier test compiled (the cache would serve it)
    engine.add_request("slow", PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0, structured_outputs=slow))
    engine.add_request("free", PROMPTS[1], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finished = {}
    while "free" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "slow" not in finished and not engine.requests["slow"].seqs[0].output_token_ids
    release.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch("[a-c]{4}", finished["slow"].text)


def test_a_failed_compile_fails_only_its_own_request(engine, monkeypatch):
    def broken_build(self, text):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(GrammarCompiler, "_build", broken_build)
    doomed = Constraint(regex="[x-z]{5}")
    out = run(engine, [("doomed", PROMPTS[0], SamplingParams(max_tokens=8, structured_outputs=doomed)),
                       ("fine", PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))])
    assert out["doomed"].error and "compiler exploded" in out["doomed"].error
    assert out["doomed"].outputs[0].finish_reason == "abort"
    assert out["fine"].error is None and len(out["fine"].token_ids) == 8
    monkeypatch.undo()
    # The failure was not cached: the same constraint compiles once the compiler works.
    again = run(engine, [("again", PROMPTS[0], SamplingParams(max_tokens=8, structured_outputs=doomed))])
    assert re.fullmatch("[x-z]{5}", again["again"].text)


def test_each_constraint_compiles_once(engine):
    compiler = engine.grammars
    first = compiler.compile(Constraint(json={"type": "object", "properties": {"k": {"type": "integer"}}}))
    same = compiler.compile(Constraint(json=json.dumps({"properties": {"k": {"type": "integer"}}, "type": "object"})))
    assert first is same
    assert compiler.compile(Constraint(json={"type": "object"}, disable_any_whitespace=True)) is not first


@pytest.mark.parametrize("grammar", ['start: "a" <[99999]>', 'start: "a" <|no_such_token|>'])
def test_grammars_naming_tokens_are_checked_against_the_vocabulary_once_it_is_built(engine, grammar):
    engine.grammars.llg_tokenizer()  # a server builds it at start (prepare_in_background)
    with pytest.raises(RequestError) as error:
        engine.add_request("tokens", PROMPTS[0], SamplingParams(structured_outputs=Constraint(grammar=grammar)))
    assert error.value.param == "structured_outputs.grammar" and not engine.requests


# ---- long choice lists, and a matcher that gives up ---------------------------------------------
def test_choice_regex_matches_exactly_its_choices(engine):
    """Metacharacters, spaces, unicode, and a choice that is a prefix of another: each is
    accepted whole, and nothing else is."""
    import llguidance

    from orca_jax.structured.guided_decoding import choice_regex

    choices = ["a.b", "a.b+c", "(x|y)*", "[1-2]{3}", "back\\slash", "tab\there", "naïve café", "$^#&-~", "a"]
    grammar = llguidance.LLMatcher.grammar_from_regex(choice_regex(choices))
    template = llguidance.LLMatcher(engine.grammars.llg_tokenizer(), grammar, log_level=0)
    assert not template.is_error(), template.get_error()
    tokenizer = engine.tokenizer
    for choice in choices:
        matcher = template.deep_copy()
        assert all(matcher.consume_token(t) for t in tokenizer.encode(choice)), (choice, matcher.get_error())
        assert matcher.is_accepting(), choice
    for other in ["a.", "ab", "xy", "a.bc", "naive"]:
        matcher = template.deep_copy()
        ok = all(matcher.consume_token(t) for t in tokenizer.encode(other))
        assert not (ok and matcher.is_accepting()), other


def test_three_thousand_choices_give_one_of_them(engine):
    """Past llguidance's 2,000 items in a parser row: a grammar with an alternative per choice
    ended after one token; the choice regex has no such row."""
    choices = [f"item-{i:04d}" for i in range(3000)]
    params = [SamplingParams(max_tokens=20, temperature=t, seed=i, structured_outputs=Constraint(choice=choices))
              for i, t in enumerate((0.0, 1.0, 1.0))]
    final = run(engine, [(f"many-{i}", PROMPTS[i], p) for i, p in enumerate(params)])
    for out in final.values():
        assert out.error is None and out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text in choices, out.outputs[0].text


def test_a_matcher_that_gives_up_fails_its_request_not_stops_it(engine):
    """A Lark rule with 2,500 alternatives passes llguidance's row limit at the first token:
    the request ends with the constraint's error (never finish_reason "stop" with text the
    constraint refuses); the request beside it is untouched."""
    from orca_jax.errors import CONSTRAINT_FAILED

    grammar = "start: " + " | ".join(f'"w{i:04d}"' for i in range(2500))
    final = run(engine, [
        ("gives-up", PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0,
                                                structured_outputs=Constraint(grammar=grammar))),
        ("free", PROMPTS[1], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)),
    ])
    failed = final["gives-up"]
    assert failed.error is not None and failed.error.startswith(CONSTRAINT_FAILED), failed.error
    assert failed.outputs[0].finish_reason != "stop"
    assert final["free"].error is None and len(final["free"].outputs[0].token_ids) == 6
