"""make_output: a request's outputs under each output_kind, built from hand-made Requests (real
Sequences and detokenizers on the tiny tokenizer, advanced as the engine advances them)."""

from __future__ import annotations

import pytest

from orca_jax import SamplingParams
from orca_jax.engine.detokenizer import IncrementalDetokenizer, detokenize_step
from orca_jax.engine.request import Request, make_output
from orca_jax.core.sequence import Sequence, SequenceStatus

KINDS = ("cumulative", "delta", "final_only")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def make_request(tokenizer, kind="cumulative", n=1, logprobs=None, stop=None, prompt="Say:"):
    params = SamplingParams(n=n, logprobs=logprobs, stop=stop, output_kind=kind, max_tokens=64)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    seqs = [Sequence(seq_id=i, request_id="r", index=i, prompt_token_ids=ids, params=params, seed=0)
            for i in range(n)]
    detoks = [IncrementalDetokenizer(tokenizer, ids, params.stop) for _ in seqs]
    return Request("r", prompt, ids, params, seqs, detoks, arrival_time=1.0)


def advance(request, tokens: dict[int, int], now: float = 2.0) -> None:
    """One engine step: sample i gets tokens[i] (its log-probs recorded when asked); a stop
    string ends it, as the engine's stop rule does."""
    samples = sorted(tokens)
    found = detokenize_step([request.detokenizers[i] for i in samples], [tokens[i] for i in samples])
    for i, stop in zip(samples, found):
        seq = request.seqs[i]
        seq.output_token_ids.append(tokens[i])
        if seq.first_token_time is None:
            seq.first_token_time = now + i
        if seq.params.logprobs is not None:
            seq.output_logprobs.append({tokens[i]: -0.5 * len(seq.output_token_ids), 7: -9.0})
        if stop is not None:
            finish(request, i, "stop", stop)


def finish(request, i: int, reason: str, stop_reason=None) -> None:
    seq = request.seqs[i]
    seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
    if not isinstance(stop_reason, str):
        request.detokenizers[i].flush()


def run(request, streams: list[list[int]], finish_at: dict[int, int] | None = None):
    """Advance every sample along its stream, one token per step (a sample whose stream is
    done finishes by length); returns make_output after each step."""
    outputs = []
    for step in range(max(len(s) for s in streams)):
        live = {i: s[step] for i, s in enumerate(streams) if step < len(s) and not request.seqs[i].is_finished}
        advance(request, live)
        for i, s in enumerate(streams):
            if not request.seqs[i].is_finished and step + 1 >= len(s):
                finish(request, i, "length")
        outputs.append(make_output(request))
    return outputs


TEXT = " The quick brown fox jumps over the lazy dog"


def test_cumulative_outputs_hold_everything_so_far_and_the_new_part(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    request = make_request(tokenizer, "cumulative", logprobs=1)
    outputs = run(request, [ids])
    seq = request.seqs[0]
    assert len(outputs) == len(ids) and all(o is not None for o in outputs)
    for step, out in enumerate(outputs):
        c = out.outputs[0]
        assert c.token_ids == ids[: step + 1] and c.delta_token_ids == [ids[step]]
        assert c.logprobs == seq.output_logprobs[: step + 1]
        assert TEXT.startswith(c.text)
        assert out.finished == (step == len(ids) - 1) and (out.finish_time is not None) == out.finished
        assert out.arrival_time == 1.0 and out.first_token_time == 2.0 and out.prompt == "Say:"
    assert outputs[-1].text == TEXT and outputs[-1].finish_reason == "length"
    assert "".join(o.outputs[0].delta_text for o in outputs) == TEXT
    # An output handed out earlier is a snapshot: later steps do not change it.
    assert outputs[2].outputs[0].token_ids == ids[:3] and len(outputs[2].outputs[0].logprobs) == 3


def test_delta_outputs_hold_only_what_is_new(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    request = make_request(tokenizer, "delta", logprobs=1)
    outputs = run(request, [ids])
    seq = request.seqs[0]
    for step, out in enumerate(outputs):
        c = out.outputs[0]
        assert c.token_ids == c.delta_token_ids == [ids[step]]
        assert c.token_ids is not c.delta_token_ids  # a merging reader extends them in place
        assert c.text == c.delta_text
        assert c.logprobs == [seq.output_logprobs[step]]
    assert "".join(o.outputs[0].text for o in outputs) == TEXT == request.detokenizers[0].text
    assert [lp for o in outputs for lp in o.outputs[0].logprobs] == seq.output_logprobs
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    # Nothing new since the previous output: an empty delta, not a repeat.
    again = make_output(request)
    assert again.outputs[0].token_ids == [] and again.outputs[0].text == "" and again.outputs[0].logprobs == []


def test_final_only_is_one_cumulative_output_at_finish(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    final = run(make_request(tokenizer, "final_only", logprobs=1), [ids])
    reference = run(make_request(tokenizer, "cumulative", logprobs=1), [ids])[-1]
    assert all(o is None for o in final[:-1])
    out = final[-1]
    c, ref = out.outputs[0], reference.outputs[0]
    assert (c.text, c.token_ids, c.logprobs, c.finish_reason) == (ref.text, ref.token_ids, ref.logprobs, "length")
    # It is the request's first output: its deltas are everything.
    assert c.delta_token_ids == ids and c.delta_text == TEXT
    assert out.finished and out.finish_time is not None and out.first_token_time == 2.0


@pytest.mark.parametrize("kind", KINDS)
def test_two_samples_finishing_at_different_steps(tokenizer, kind):
    short = tokenizer.encode(" The quick", add_special_tokens=False)
    long = tokenizer.encode(" Paris is the capital of France", add_special_tokens=False)
    assert len(short) < len(long)
    request = make_request(tokenizer, kind, n=2, logprobs=0)
    outputs = run(request, [short, long])
    emitted = [o for o in outputs if o is not None]
    assert len(emitted) == (1 if kind == "final_only" else len(long))
    assert [o.finished for o in emitted] == [False] * (len(emitted) - 1) + [True]
    last = emitted[-1]
    assert [c.index for c in last.outputs] == [0, 1]
    assert [c.finish_reason for c in last.outputs] == ["length", "length"]
    assert last.first_token_time == 2.0  # the earliest of the samples'
    for i, stream in enumerate((short, long)):
        texts = [o.outputs[i].text for o in emitted]
        tokens = [o.outputs[i].token_ids for o in emitted]
        if kind == "delta":
            assert [t for ts in tokens for t in ts] == stream and "".join(texts) == tokenizer.decode(stream)
            assert [len(o.outputs[i].logprobs) for o in emitted] == [len(ts) for ts in tokens]
        else:
            assert tokens[-1] == stream and texts[-1] == tokenizer.decode(stream)
            assert len(last.outputs[i].logprobs) == len(stream)
    if kind != "final_only":  # the short sample's finish stays visible while the other runs
        after = emitted[len(short)]
        assert after.outputs[0].finish_reason == "length" and not after.finished
        assert after.outputs[0].delta_token_ids == []


@pytest.mark.parametrize("kind", KINDS)
def test_stop_string_text_is_held_back_then_cut(tokenizer, kind):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    request = make_request(tokenizer, kind, stop=["ck br"])
    outputs = [o for o in run(request, [ids]) if o is not None]
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
    assert outputs[-1].outputs[0].stop_reason == "ck br"
    assert "".join(o.outputs[0].delta_text for o in outputs) == " The qui"
    if kind == "delta":
        assert "".join(o.outputs[0].text for o in outputs) == " The qui"
        # While running, the 4 characters that could start the stop string were not sent.
        assert all("ck" not in o.outputs[0].text for o in outputs)
    else:
        assert outputs[-1].text == " The qui"
    assert len(request.seqs[0].output_token_ids) < len(ids)


@pytest.mark.parametrize("kind", KINDS)
def test_abort_with_an_error_is_reported_in_every_kind(tokenizer, kind):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    request = make_request(tokenizer, kind, n=2)
    advance(request, {0: ids[0], 1: ids[0]})
    first = make_output(request)
    assert (first is None) == (kind == "final_only")
    advance(request, {0: ids[1], 1: ids[1]})
    request.error = "injected device fault"
    for i in range(2):
        finish(request, i, "abort")
    out = make_output(request)
    assert out.finished and out.error == "injected device fault" and out.finish_time is not None
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    expected_tokens = ids[1:2] if kind == "delta" else ids[:2]
    assert [c.token_ids for c in out.outputs] == [expected_tokens] * 2


def test_an_abort_before_any_token(tokenizer):
    for kind in KINDS:
        request = make_request(tokenizer, kind)
        finish(request, 0, "abort")
        out = make_output(request)
        assert out.finished and out.first_token_time is None and out.outputs[0].token_ids == []
        assert out.outputs[0].text == "" and out.outputs[0].logprobs is None


def test_counters_start_at_zero_per_sample(tokenizer):
    request = make_request(tokenizer, n=3)
    assert request.reported_tokens == [0, 0, 0] and request.reported_logprobs == [0, 0, 0]
    assert not request.finished


def test_outputs_are_slotted(tokenizer):
    """One RequestOutput per request per step: slotted, so no per-object __dict__."""
    out = make_output(make_request(tokenizer))
    for obj in (out, out.outputs[0]):
        assert not hasattr(obj, "__dict__")
        with pytest.raises(AttributeError):
            obj.unknown_field = 1
