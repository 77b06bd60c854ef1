"""--reasoning-parser: the split itself (whole and streamed, any chunking), and through the server
on the tiny random Llama with a tokenizer that has `<think>` / `</think>` tokens and a template
that opens the block: reasoning and content apart, streamed deltas that reassemble to the
non-streamed message, constraints applied to the answer only."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_jax.entrypoints.reasoning_parsers import REASONING_PARSERS, ReasoningStream, reasoning_parser
from orca_jax.entrypoints.server import ServerSettings, build_app

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]


# ---- the split ---------------------------------------------------------------------------------
@pytest.mark.parametrize("parser, prompt, text, expected", [
    (QWEN3, "assistant: ", "<think>plan</think>\n\nanswer", ("plan", "\n\nanswer")),
    (QWEN3, "assistant: ", "just an answer", ("", "just an answer")),
    (QWEN3, "assistant: <think>\n", "plan</think>answer", ("plan", "answer")),  # the prompt opened it
    (QWEN3, "assistant: <think>\n\n</think>\n\n", "a</think>b", ("", "a</think>b")),  # thinking off: all content
    (QWEN3, "assistant: ", "<think>cut off while thinking", ("cut off while thinking", "")),
    (R1, "assistant: ", "plan</think>answer", ("plan", "answer")),  # R1 starts in its reasoning
    (R1, "assistant: ", "<think>plan</think>answer", ("plan", "answer")),
    (R1, "assistant: ", "no end tag", ("no end tag", "")),
])
def test_split(parser, prompt, text, expected):
    assert parser.split(text, prompt)[:2] == expected


def test_the_constraint_waits_for_the_end_unless_the_prompt_closed_the_block():
    assert QWEN3.constraint_waits_for("assistant: ") == "</think>"
    assert QWEN3.constraint_waits_for("assistant: <think>\n\n</think>\n\n") is None
    assert R1.constraint_waits_for("<｜Assistant｜><think>\n") == "</think>"


def test_an_unknown_parser_is_refused_listing_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1, openai_gptoss, qwen3"):
        reasoning_parser("nope")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ServerSettings("m", reasoning_parser="nope")


_pieces = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "</th", "ink>", "<th", "a", " ", "\n", "b c"]),
                   max_size=12)


@settings(max_examples=300, deadline=None)
@given(pieces=_pieces, cuts=st.lists(st.integers(0, 60), max_size=6),
       parser=st.sampled_from([QWEN3, R1]),
       prompt=st.sampled_from(["assistant: ", "assistant: <think>\n", "assistant: <think></think>"]))
def test_streamed_deltas_reassemble_to_the_whole_split(pieces, cuts, parser, prompt):
    text = "".join(pieces)
    stream, reasoning, content, previous = ReasoningStream(parser, prompt), "", "", 0
    for cut in sorted(min(c, len(text)) for c in cuts) + [len(text)]:
        new_reasoning, new_content = stream.update(text[previous:cut], False)
        reasoning, content, previous = reasoning + new_reasoning, content + new_content, cut
    new_reasoning, new_content = stream.update("", True)
    assert (reasoning + new_reasoning, content + new_content) == parser.split(text, prompt)[:2]


# ---- through the server ------------------------------------------------------------------------
MODEL = "tiny-thinker"
# The template opens the reasoning, as Qwen3's 2507 thinking models' template does.
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: <think>{% endif %}")
CHAT = [{"role": "user", "content": "Is Paris the capital of France?"}]


@pytest.fixture(scope="module")
def thinker_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with `<think>` and `</think>` added to its tokenizer (as plain added
    tokens, as Qwen3's are, so they stay in the text): ids 434 and 435, inside its 512 logits."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tiny-thinker")
    for path in tiny_llama_dir.iterdir():
        shutil.copy(path, directory / path.name)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def live(thinker_dir, tiny_engine_factory, serve_in_thread, server_idle_waiter):
    engine = tiny_engine_factory(model=str(thinker_dir))
    settings = ServerSettings(MODEL, chat_template=TEMPLATE, reasoning_parser="qwen3")
    async_engine, app = build_app(engine, settings)
    with serve_in_thread(app) as url:
        yield url, engine, server_idle_waiter(async_engine)


@pytest.fixture(autouse=True)
def server_left_idle(request):
    yield
    if "live" in request.fixturenames:
        live = request.getfixturevalue("live")
        live[2]()
        assert live[1].allocator.num_used == 0


def end_id(live) -> int:
    (token,) = live[1].tokenizer.encode("</think>", add_special_tokens=False)
    return token


def chat(live, **fields) -> httpx.Response:
    body = dict(model=MODEL, messages=CHAT, max_tokens=12, ignore_eos=True) | fields
    return httpx.post(f"{live[0]}/v1/chat/completions", json=body, timeout=60)


def streamed(live, **fields) -> tuple[list[dict], list[dict]]:
    """(the choice deltas, every event) of a streamed chat."""
    body = dict(model=MODEL, messages=CHAT, max_tokens=12, ignore_eos=True, stream=True) | fields
    events = []
    with httpx.stream("POST", f"{live[0]}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    return [c["delta"] for e in events for c in e.get("choices", [])], events


def thinking_then_answering(live, **fields) -> tuple[dict, dict]:
    """(sampling fields, message) of a seeded reply that reasons, ends its reasoning, then answers:
    the sampler may pick only `</think>` and two word tokens, so a few seeds find one."""
    words = live[1].tokenizer.encode(" capital France", add_special_tokens=False)[:2]
    for seed in range(24):
        sampling = dict(temperature=2.0, seed=seed, allowed_token_ids=[end_id(live), *words], **fields)
        message = chat(live, **sampling).json()["choices"][0]["message"]
        if message.get("reasoning") and message.get("content"):
            return sampling, message
    raise AssertionError("no seed gave a reply with both reasoning and an answer")


def test_reasoning_and_content_come_apart_and_the_stream_reassembles_them(live):
    sampling, message = thinking_then_answering(live)
    assert message["reasoning_content"] == message["reasoning"]
    assert "</think>" not in message["reasoning"]  # the first one ends it; the answer may hold more
    deltas, _ = streamed(live, **sampling)
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_include_reasoning_false_leaves_it_out(live):
    sampling, message = thinking_then_answering(live)
    hidden = chat(live, include_reasoning=False, **sampling).json()["choices"][0]["message"]
    assert "reasoning" not in hidden and hidden["content"] == message["content"]
    deltas, _ = streamed(live, include_reasoning=False, **sampling)
    assert not any("reasoning" in d for d in deltas)


def test_a_reply_cut_off_while_reasoning_has_no_content(live):
    message = chat(live, temperature=0, max_tokens=4,
                   logit_bias={str(end_id(live)): -100}).json()["choices"][0]["message"]
    assert message["reasoning"] and message["content"] is None


def test_the_constraint_applies_to_the_answer_not_the_reasoning(live):
    """A choice constraint with a free reasoning before it: the reasoning holds tokens the
    choice never could, and the answer is exactly one of the choices."""
    choices = ["yes", "no"]
    for bias in (2.0, 4.0, 6.0, 8.0, 12.0):
        for seed in range(4):
            response = chat(live, temperature=1.0, seed=seed, max_tokens=24, ignore_eos=False,
                            logit_bias={str(end_id(live)): bias}, structured_outputs={"choice": choices})
            assert response.status_code in (200, 400), response.text
            if response.status_code != 200:  # EOS before the reasoning ended: the constraint never began
                assert response.json()["error"]["code"] == "constraint_failed"
                continue
            message = response.json()["choices"][0]["message"]
            if message.get("reasoning") and message.get("content") is not None:
                assert message["content"] in choices, message
                assert message["reasoning"] not in choices
                return
    raise AssertionError("no reply ended its reasoning within 24 tokens")


def test_an_eos_before_the_reasoning_ends_fails_the_constraint(live):
    eos = live[1].tokenizer.eos_token_id
    body = dict(temperature=0, ignore_eos=False, logit_bias={str(eos): 100}, structured_outputs={"choice": ["a"]})
    response = chat(live, **body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "constraint_failed"
    _, events = streamed(live, **body)
    assert events[-1]["error"]["code"] == "constraint_failed"


def test_tool_calls_are_read_from_the_answer_only():
    """A call written inside the reasoning is thinking, not a call; one in the answer is a call."""
    from orca_jax.engine.outputs import CompletionOutput
    from orca_jax.entrypoints.chat_tools import plan_tools
    from orca_jax.entrypoints.openai_serving import OpenAIServing
    from orca_jax.entrypoints.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model="m", messages=CHAT, tool_choice="auto", tools=[
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}])
    plan = plan_tools(request, "hermes")
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.reasoning = QWEN3
    call = '<tool_call>{"name": "lookup", "arguments": {"q": "Paris"}}</tool_call>'
    thought = serving._chat_message(request, plan, CompletionOutput(0, f"<think>maybe {call}</think>Yes.", [], "stop"),
                                    "assistant: ")
    assert "tool_calls" not in thought["message"] and thought["message"]["content"] == "Yes."
    assert call in thought["message"]["reasoning"] and thought["finish_reason"] == "stop"
    called = serving._chat_message(request, plan, CompletionOutput(0, f"<think>look it up</think>{call}", [], "stop"),
                                   "assistant: ")
    assert called["message"]["tool_calls"][0]["function"]["name"] == "lookup"
    assert called["finish_reason"] == "tool_calls" and called["message"]["reasoning"] == "look it up"
