"""The harmony format (orca_jax/entrypoints/harmony.py): gpt-oss's channels split into reasoning,
content and tool calls, whole and streamed in any chunking; and a two-turn conversation with a
reasoning section and a tool call through the server and the official `openai` client.

The server runs a scripted tiny model: a GPT-2 whose attention and MLP are zeroed, so each
position's logits come from its learned position embedding alone, set so that greedy decoding
writes a fixed harmony reply at the positions where the conversation's replies fall. Its
tokenizer is the tiny one with harmony's markers added as special tokens; its chat template
(`HARMONY_TEMPLATE`) writes harmony as gpt-oss's does (tools in a developer message, earlier
reasoning as analysis messages, calls on the commentary channel, results as messages from the
function). The `openai-harmony` package is not used: its encoding downloads on first use.
"""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_jax.entrypoints.harmony import HarmonyReasoningParser, parse_messages
from orca_jax.entrypoints.reasoning_parsers import ReasoningStream, reasoning_parser
from orca_jax.entrypoints.server import ServerSettings, build_app
from orca_jax.entrypoints.tool_parsers import ToolCallStreamer, extract_tool_calls, get_tool_parser

HARMONY = reasoning_parser("openai_gptoss")
PROMPT = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 20 C in Paris.<|return|>"


# ---- the split ---------------------------------------------------------------------------------
def test_analysis_is_reasoning_final_is_content():
    reasoning, content, held = HARMONY.split(ANALYSIS + FINAL, PROMPT)
    assert (reasoning, content, held) == ("The user wants the weather. Call the tool.", "It is 20 C in Paris.", 0)


def test_a_function_call_becomes_tool_calls_with_the_openai_parser():
    _, content, _ = HARMONY.split(ANALYSIS + CALL, PROMPT)
    text, calls = extract_tool_calls(get_tool_parser("openai"), content)
    assert text is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]


def test_recipient_in_the_role_header_and_a_preamble_to_the_user():
    """harmony lets `to=` stand before the channel, and commentary to no one is for the user."""
    text = ('<|channel|>commentary<|message|>Checking.<|end|>'
            '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": 1}<|call|>')
    _, content, _ = HARMONY.split(text, PROMPT)
    parsed = get_tool_parser("openai").parse(content, final=True)
    assert parsed.content == "Checking." and [(c.name, c.arguments) for c in parsed.calls] == [("lookup", '{"q": 1}')]


def test_the_prompt_may_open_the_final_channel_and_the_constraint_waits_for_it():
    assert HARMONY.constraint_waits_for(PROMPT) == "<|channel|>final<|message|>"
    opened = PROMPT + "<|channel|>final<|message|>"
    assert HARMONY.constraint_waits_for(opened) is None
    assert HARMONY.split("plain answer", opened) == ("", "plain answer", 0)


def test_messages_parse_with_their_channel_recipient_and_state():
    (analysis, call) = parse_messages("assistant" + ANALYSIS + CALL)
    assert (analysis.channel, analysis.recipient, analysis.closed) == ("analysis", None, True)
    assert (call.channel, call.recipient, call.closed, call.is_function_call) == (
        "commentary", "functions.get_weather", False, True)


def test_a_call_with_bad_arguments_degrades_to_text():
    bad = CALL.replace('{"city": "Paris"}', '{"city": ')
    _, content, _ = HARMONY.split(bad, PROMPT)
    assert get_tool_parser("openai").parse(content, final=True).calls == []


_PIECES = st.lists(st.sampled_from([
    "<|channel|>", "analysis", "final", "commentary", " to=functions.f", " <|constrain|>json", "<|message|>",
    "<|end|>", "<|start|>", "assistant", "<|call|>", "<|return|>", "<|", "<|en", "d|>", "a b", " ", '{"x": 1}', "é"]),
    max_size=16)


@settings(max_examples=300, deadline=None)
@given(pieces=_PIECES, cuts=st.lists(st.integers(0, 200), max_size=8))
def test_streamed_fields_reassemble_to_the_whole_split(pieces, cuts):
    """Any text, cut anywhere: the streamed reasoning, content and tool-call deltas add up to
    the non-streamed message, and nothing sent is ever taken back."""
    text = "".join(pieces)
    stream, streamer = ReasoningStream(HARMONY, PROMPT), ToolCallStreamer(get_tool_parser("openai"))
    reasoning, content_text, deltas = "", "", []
    bounds = sorted({min(c, len(text)) for c in cuts} | {len(text)})
    previous = 0
    for i, bound in enumerate(bounds):
        final = i == len(bounds) - 1
        new_reasoning, new_content = stream.update(text[previous:bound], final)
        previous = bound
        reasoning += new_reasoning
        content_text += new_content
        deltas += streamer.update(content_text, final)
    whole_reasoning, whole_content, _ = HARMONY.split(text, PROMPT)
    assert reasoning == whole_reasoning and content_text == whole_content
    parsed = get_tool_parser("openai").parse(whole_content, final=True)
    if parsed.calls:  # well-formed calls: the stream sent exactly the final parse
        assert "".join(d.get("content", "") for d in deltas) == parsed.content
        streamed_calls: dict[int, str] = {}
        for delta in deltas:
            for call in delta.get("tool_calls", []):
                streamed_calls[call["index"]] = streamed_calls.get(call["index"], "") + call["function"]["arguments"]
        assert list(streamed_calls.values()) == [call.arguments for call in parsed.calls]


def test_the_openai_tool_parser_needs_the_harmony_reasoning_parser():
    with pytest.raises(ValueError, match="--tool-call-parser openai reads the output that --reasoning-parser "
                                         "openai_gptoss splits"):
        ServerSettings("m", tool_call_parser="openai", enable_auto_tool_choice=True)
    ServerSettings("m", tool_call_parser="openai", enable_auto_tool_choice=True, reasoning_parser="openai_gptoss")
    assert isinstance(HARMONY, HarmonyReasoningParser) and HARMONY.needs_special_tokens


# ---- through the server and the openai client --------------------------------------------------
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
HARMONY_TEMPLATE = (
    "{%- set ns = namespace(tool='') -%}"
    "<|start|>system<|message|># Valid channels: analysis, commentary, final."
    "{% if reasoning_effort %}\nReasoning: {{ reasoning_effort }}{% endif %}<|end|>"
    "{%- if tools -%}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n"
    "{%- for t in tools %}\n// {{ t.function.description }}\ntype {{ t.function.name }} = "
    "(_: {{ t.function.parameters | tojson }}) => any;{% endfor %}\n} // namespace functions<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role in ('system', 'developer') -%}<|start|>developer<|message|># Instructions\n\n{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if m.thinking -%}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif -%}"
    "{%- for c in m.tool_calls or [] -%}{%- set ns.tool = c.function.name -%}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{%- endfor -%}"
    "{%- if m.content -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- elif m.role == 'tool' -%}<|start|>functions.{{ ns.tool }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
FIRST_TURN = [{"role": "user", "content": "Weather in Paris?"}]
FIRST_REPLY = ("<|channel|>analysis<|message|>need the weather<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
SECOND_REPLY = "<|channel|>analysis<|message|>it is mild<|end|><|start|>assistant<|channel|>final<|message|>20 C<|return|>"
MODEL = "harmony-tiny"


SECOND_TURN = FIRST_TURN + [
    {"role": "assistant", "content": None, "reasoning": "need the weather",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": '{"temp": 20}', "tool_call_id": "call_1"}]


def _conversation_prompts(tokenizer):
    """The two turns' prompt token ids as the server renders them (its request models, its
    template call)."""
    from orca_jax.entrypoints.chat_template import apply_chat_template
    from orca_jax.entrypoints.protocol import ChatMessage, Tool

    tools = [Tool(**tool).as_template_dict() for tool in TOOLS]
    return [apply_chat_template(tokenizer, [ChatMessage(**m).as_template_dict() for m in turn], True, tools=tools,
                                call_format="openai", chat_template=HARMONY_TEMPLATE)
            for turn in (FIRST_TURN, SECOND_TURN)]


@pytest.fixture(scope="module")
def scripted_dir(tiny_llama_dir, tmp_path_factory):
    """The scripted GPT-2: replies FIRST_REPLY to the first turn and SECOND_REPLY to the second."""
    import torch
    import transformers

    directory = tmp_path_factory.mktemp("harmony-scripted")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_llama_dir / name).exists():
            shutil.copy(tiny_llama_dir / name, directory / name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.save_pretrained(directory)
    call_id, return_id = tokenizer.convert_tokens_to_ids(["<|call|>", "<|return|>"])
    first, second = _conversation_prompts(tokenizer)
    scripts = [(len(prompt), tokenizer.encode(reply, add_special_tokens=False))
               for prompt, reply in ((first, FIRST_REPLY), (second, SECOND_REPLY))]
    hidden = 128
    assert sum(len(s) for _, s in scripts) <= hidden and len(first) + len(scripts[0][1]) <= len(second) < 440
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=hidden, n_layer=1, n_head=2, n_positions=640,
                                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=[call_id, return_id])
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.zero_()
        # Position p - 1 predicts the script's token at p: a one-hot direction per scripted
        # position, and each scripted token's head row reads its directions.
        direction = 0
        for start, tokens in scripts:
            for offset, token in enumerate(tokens):
                model.transformer.wpe.weight[start + offset - 1, direction] = 1.0
                model.lm_head.weight[token, direction] = 20.0
                direction += 1
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [call_id, return_id]}))
    return directory


@pytest.fixture(scope="module")
def live(scripted_dir, tiny_engine_factory, serve_in_thread, server_idle_waiter):
    engine = tiny_engine_factory(model=str(scripted_dir), max_model_len=576, num_pages=160)
    server_settings = ServerSettings(MODEL, chat_template=HARMONY_TEMPLATE, reasoning_parser="openai_gptoss",
                                     tool_call_parser="openai", enable_auto_tool_choice=True)
    async_engine, app = build_app(engine, server_settings)
    with serve_in_thread(app) as url:
        yield url, engine, server_idle_waiter(async_engine)
    assert engine.allocator.num_used == 0


def _client(live):
    import openai

    return openai.OpenAI(base_url=f"{live[0]}/v1", api_key="none", max_retries=0)


def _streamed_message(client, **body) -> tuple[dict, str]:
    """(the message the deltas add up to, the finish reason) of a streamed chat."""
    message = {"reasoning": "", "content": "", "tool_calls": {}}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            delta = choice.delta.model_dump(exclude_none=True)
            message["reasoning"] += delta.get("reasoning", "")
            message["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                entry = message["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += (call.get("function") or {}).get("name") or ""
                entry["arguments"] += (call.get("function") or {}).get("arguments") or ""
            finish = choice.finish_reason or finish
    return message, finish


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_a_tool_call_then_the_answer(live, stream):
    client = _client(live)
    body = dict(model=MODEL, messages=FIRST_TURN, tools=TOOLS, max_tokens=80, temperature=0)
    if stream:
        message, finish = _streamed_message(client, **body)
        calls = [(c["name"], c["arguments"]) for c in message["tool_calls"].values()]
        reasoning, content = message["reasoning"], message["content"] or None
    else:
        choice = client.chat.completions.create(**body).choices[0]
        finish, message = choice.finish_reason, choice.message.model_dump()
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        reasoning, content = message["reasoning"], message["content"]
    assert (finish, reasoning, content) == ("tool_calls", "need the weather", None)
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [("get_weather", {"city": "Paris"})]

    # The call's result goes back as harmony's message from the function; the reply reasons, then answers.
    body = dict(model=MODEL, messages=SECOND_TURN, tools=TOOLS, max_tokens=80, temperature=0)
    if stream:
        message, finish = _streamed_message(client, **body)
        assert not message["tool_calls"]
    else:
        choice = client.chat.completions.create(**body).choices[0]
        finish, message = choice.finish_reason, choice.message.model_dump()
    assert (finish, message["reasoning"], message["content"]) == ("stop", "it is mild", "20 C")


def test_no_marker_reaches_the_client(live):
    reply = _client(live).chat.completions.create(model=MODEL, messages=FIRST_TURN, tools=TOOLS, max_tokens=80,
                                                   temperature=0)
    dumped = json.dumps(reply.model_dump())
    assert not [m for m in MARKERS if m in dumped]


def test_a_structured_output_constrains_the_final_channel_only(live):
    """The answer is held to the choices; the analysis before it ("it is mild", no choice) is
    not, so the constraint began at the final channel."""
    reply = _client(live).chat.completions.create(
        model=MODEL, messages=SECOND_TURN, tools=TOOLS, max_tokens=80, temperature=0,
        extra_body={"structured_outputs": {"choice": ["20 C", "cold"]}})
    message = reply.choices[0].message.model_dump()
    assert (message["reasoning"], message["content"]) == ("it is mild", "20 C")


def test_reasoning_effort_reaches_the_template(live):
    """OpenAI's `reasoning_effort` is the template variable gpt-oss's template reads ("Reasoning:
    high" in its system message): the prompt grows by that line."""
    client = _client(live)
    body = dict(model=MODEL, messages=FIRST_TURN, max_tokens=1, temperature=0)
    plain = client.chat.completions.create(**body).usage.prompt_tokens
    high = client.chat.completions.create(reasoning_effort="high", **body).usage.prompt_tokens
    assert high > plain
    import httpx  # /tokenize renders a conversation as the chat does, reasoning_effort included

    tokenized = httpx.post(f"{live[0]}/tokenize", json=dict(model=MODEL, messages=FIRST_TURN, reasoning_effort="high"))
    assert tokenized.json()["count"] == high
    with pytest.raises(Exception, match="reasoning_effort"):
        client.chat.completions.create(reasoning_effort="extreme", **body)
