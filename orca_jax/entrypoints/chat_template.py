"""A conversation (and the tools it may call) as prompt token ids, through the model's chat template.

Templates written for tool use (Qwen2.5/Qwen3, Llama 3.1+, Hermes, Mistral) take the tools and
the tool-call history themselves (transformers' `apply_chat_template(tools=...)`). Many small
models' templates (SmolLM2's among them) know neither: they would drop the tools and fail on
an assistant message without content. For those the conversation is rewritten before it is
rendered, so any chat model can be offered tools:

- the tools are described in the system message, with the call format the server's tool
  parser reads (`hermes`: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks,
  `llama3_json`: a bare `{"name": ..., "parameters": ...}` object);
- an assistant message's tool calls become text in that format;
- a tool's answer becomes a user message holding `<tool_response>...</tool_response>`.
"""

from __future__ import annotations

import json

Conversation = list[dict]


def apply_chat_template(tokenizer, conversation: Conversation, add_generation_prompt: bool = True,
                        tools: list[dict] | None = None, call_format: str = "hermes", *,
                        continue_final_message: bool = False, chat_template: str | None = None,
                        template_kwargs: dict | None = None) -> list[int]:
    """Prompt token ids of a conversation under the tokenizer's chat template (shared by
    LLM.chat, the CLI and the server). `tools`: OpenAI tool dicts the model may call.
    `chat_template` replaces the tokenizer's; `template_kwargs` are extra template variables
    (vLLM's chat_template_kwargs: Qwen3's enable_thinking, say). `continue_final_message`: the
    prompt ends inside the last message, so the model continues it (vLLM's rule: not with
    add_generation_prompt)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
    kwargs = dict(template_kwargs or {})
    if chat_template:
        kwargs["chat_template"] = chat_template
    if template_knows_tools(template):
        if tools:
            kwargs["tools"] = tools
    elif tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in conversation):
        conversation = conversation_without_tool_roles(conversation, tools or [], call_format)
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **kwargs)
    if continue_final_message:
        text = _cut_after_final_message(text, conversation[-1].get("content") or "")
    # The template writes its own special tokens: do not add a second BOS.
    return tokenizer.encode(text, add_special_tokens=False)


def _cut_after_final_message(text: str, final: str) -> str:
    """The rendered conversation up to the end of its last message's content: whatever the
    template writes after it (an end-of-turn token) is dropped, so generation continues it."""
    at = text.rfind(final.strip()) if final.strip() else -1
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not render the final message's content "
                         "as given")
    return text[:at + len(final.strip())]


def template_knows_tools(template: str) -> bool:
    """A template that reads `tools` and `tool_calls` renders them itself."""
    return "tools" in template and "tool_calls" in template


def conversation_without_tool_roles(conversation: Conversation, tools: list[dict], call_format: str) -> Conversation:
    """The conversation in plain system/user/assistant text messages (see the module's doc)."""
    messages = []
    for message in conversation:
        role = message.get("role")
        if role == "tool":
            messages.append({"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n"
                                                        "</tool_response>"})
        elif message.get("tool_calls"):
            calls = [_call_text(call["function"], call_format) for call in message["tool_calls"]]
            content = message.get("content") or ""
            messages.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        else:
            messages.append({"role": role, "content": message.get("content") or ""})
    if tools:
        description = tools_system_text(tools, call_format)
        if messages and messages[0]["role"] in ("system", "developer"):
            messages[0] = {"role": messages[0]["role"], "content": f"{messages[0]['content']}\n\n{description}"}
        else:
            messages.insert(0, {"role": "system", "content": description})
    return messages


def tools_system_text(tools: list[dict], call_format: str) -> str:
    signatures = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    if call_format == "llama3_json":
        how = ('To call a function, answer with only a JSON object {"name": <function name>, "parameters": '
               '<its arguments as a JSON object>}; separate several calls with "; ".')
    else:
        how = ('To call a function, answer with a <tool_call></tool_call> block holding a JSON object '
               '{"name": <function name>, "arguments": <its arguments as a JSON object>}, one block per call.')
    return f"You can call these functions:\n<tools>\n{signatures}\n</tools>\n{how}"


def _call_text(function: dict, call_format: str) -> str:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if call_format == "llama3_json":
        return json.dumps({"name": function["name"], "parameters": arguments}, ensure_ascii=False)
    call = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"
