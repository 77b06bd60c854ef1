"""Conversations with tools through chat templates: templates that render tools get them as
transformers passes them; templates that do not (SmolLM2's, the tiny model's) get the tools
described in the system message and the tool history as text."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from orca_jax.entrypoints.chat_template import apply_chat_template, conversation_without_tool_roles, template_knows_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]
# A minimal tool-aware template in the style of Qwen's (tools into the system turn, calls as tojson).
TOOL_TEMPLATE = (
    "{% if tools %}<sys>{% for t in tools %}{{ t | tojson }}{% endfor %}</sys>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}[call {{ c.function | tojson }}]{% endfor %}{% endif %}"
    "</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tokenizer(tiny_llama_dir, template=None):
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    if template is not None:
        tok.chat_template = template
    return tok


def rendered(tok, ids) -> str:
    return tok.decode(ids)


def test_a_template_that_knows_tools_renders_them_itself(tiny_llama_dir):
    tok = tokenizer(tiny_llama_dir, TOOL_TEMPLATE)
    assert template_knows_tools(TOOL_TEMPLATE)
    text = rendered(tok, apply_chat_template(tok, HISTORY, tools=[WEATHER]))
    assert text.startswith('<sys>{"type": "function"') and '"name": "get_weather"' in text
    assert '[call {"arguments": {"city": "Paris"}' in text or '[call {"name": "get_weather"' in text
    assert "<tool>18 C</tool>" in text and text.endswith("<assistant>")


def test_a_template_without_tools_gets_them_in_the_system_message(tiny_llama_dir):
    tok = tokenizer(tiny_llama_dir)  # "<s>role: content</s>" only
    assert not template_knows_tools(tok.chat_template)
    text = rendered(tok, apply_chat_template(tok, HISTORY, tools=[WEATHER]))
    assert text.startswith("<s>system: You can call these functions:")
    assert json.dumps(WEATHER["function"]) in text
    assert '<s>assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call></s>' in text
    assert "<s>user: <tool_response>\n18 C\n</tool_response></s>" in text
    # Without tools or tool history the conversation is rendered untouched.
    plain = [{"role": "user", "content": "hi"}]
    assert rendered(tok, apply_chat_template(tok, plain)) == "<s>user: hi</s><s>assistant: "


def test_the_fallback_follows_the_call_format_and_keeps_a_system_message():
    conversation = [{"role": "system", "content": "Be brief."}] + HISTORY
    rewritten = conversation_without_tool_roles(conversation, [WEATHER], "llama3_json")
    assert rewritten[0]["role"] == "system" and rewritten[0]["content"].startswith("Be brief.\n\nYou can call")
    assert '"parameters"' in rewritten[0]["content"]
    assert rewritten[2] == {"role": "assistant",
                            "content": '{"name": "get_weather", "parameters": {"city": "Paris"}}'}
    assert [m["role"] for m in rewritten] == ["system", "user", "assistant", "user"]
