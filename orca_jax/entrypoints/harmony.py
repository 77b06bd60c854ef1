"""OpenAI's harmony format (gpt-oss): the model writes a sequence of messages, each on a channel.

    <|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    ... (the tool's result comes back as a message from `functions.get_weather`) ...
    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>It is 20 C.<|return|>

The prompt ends with `<|start|>assistant`, so the output's first message has its role already;
a message's header (role, channel, `to=` recipient, `<|constrain|>` format) runs to
`<|message|>`, its body to `<|end|>`, `<|call|>` or `<|return|>`. The markers are special
tokens, so a harmony request is detokenized with them kept (`needs_special_tokens`), and
everything shown to the client is a body, never a marker.

`--reasoning-parser openai_gptoss` (`HarmonyReasoningParser`, vLLM's name) splits the output:

    analysis                       -> `reasoning` (and `reasoning_content`)
    final, commentary to no one    -> `content` (a preamble the model addresses to the user)
    commentary to=functions.NAME   -> kept in the content as one canonical call message, for
                                      `--tool-call-parser openai` (tool_parsers.py) to turn into
                                      `tool_calls`; shown as text when no tool parser is set

Both are computed from the whole text so far, so streamed deltas reassemble to the whole
message: a header still being written, or a body ending in what may become a marker, is held
back until the next tokens decide it. This module reads the text; the `openai-harmony` package
(vLLM's, which works on token ids) is not used: its encoding is fetched from the network on
first use, which the machines here do not allow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from orca_jax.entrypoints.partial_tags import without_partial_tag

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *TERMINATORS)
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
# What a function call's message looks like inside the content handed to the tool parser.
CALL_PREFIX = CHANNEL + "commentary to="
CALL_HEADER_END = " " + CONSTRAIN + "json" + MESSAGE


@dataclass(frozen=True)
class Message:
    header: str  # between the message's start and <|message|>
    body: str
    header_done: bool  # <|message|> seen
    closed: bool  # a terminator seen

    @property
    def channel(self) -> str | None:
        match = _CHANNEL_NAME.search(self.header)
        return match.group(1) if match else None

    @property
    def recipient(self) -> str | None:
        match = _RECIPIENT.search(self.header)
        return match.group(1) if match else None

    @property
    def is_function_call(self) -> bool:
        return self.recipient is not None and self.recipient.startswith("functions.")


def parse_messages(text: str) -> list[Message]:
    """The messages of `text` in order; the first continues the header the prompt opened. Text
    after a terminator that no <|start|> opens is a message without header."""
    messages = []
    for i, segment in enumerate(text.split(START)):
        if i > 0 or segment:
            messages.extend(_segment_messages(segment))
    return messages


def _segment_messages(segment: str) -> list[Message]:
    header, found, rest = segment.partition(MESSAGE)
    if not found:
        return [Message(header, "", False, False)]
    end = min((rest.find(t) for t in TERMINATORS if t in rest), default=-1)
    if end < 0:
        return [Message(header, rest, True, False)]
    terminator = next(t for t in TERMINATORS if rest.startswith(t, end))
    messages = [Message(header, rest[:end], True, True)]
    trailing = rest[end + len(terminator):]
    if trailing:  # a stray message without <|start|> or header: read as plain text
        messages.append(Message("", trailing, True, False))
    return messages


def open_header(prompt_text: str) -> str:
    """The header the prompt leaves open for the output (`assistant` after its last <|start|>),
    '' when the prompt ends outside a message."""
    start = prompt_text.rfind(START)
    if start < 0:
        return ""
    tail = prompt_text[start + len(START):]
    return "" if any(t in tail for t in TERMINATORS) else tail


def _held_marker_prefix(text: str) -> int:
    """How many characters at the end of `text` may be the start of a marker, or a whole one
    (a body may hold a literal `<|channel|>`; held, the next token shows whether a header
    follows). Wider than `partial_tags.partial_tag_length`, which stops short of the whole tag."""
    for length in range(min(max(map(len, MARKERS)) - 1, len(text)), 0, -1):
        if any(marker.startswith(text[-length:]) for marker in MARKERS):
            return length
    return 0


def call_markup(message: Message) -> str:
    """A function call message in its canonical form inside the content (a prefix of itself
    while its arguments are being written; <|call|> once closed)."""
    return f"{CALL_PREFIX}{message.recipient}{CALL_HEADER_END}{message.body}{CALL if message.closed else ''}"


@dataclass(frozen=True)
class HarmonyReasoningParser:
    """The reasoning parser interface of reasoning_parsers.py (`split`, `constraint_waits_for`)
    over harmony's channels."""

    name: str = "openai_gptoss"
    needs_special_tokens: bool = True  # the markers are special tokens: keep them in the text

    def split(self, text: str, prompt_text: str = "", final: bool = True) -> tuple[str, str, int]:
        """(reasoning, content, held) of the output so far (see the module's table)."""
        messages = parse_messages(open_header(prompt_text) + text)
        reasoning, content, held = [], [], 0
        for i, message in enumerate(messages):
            last = i == len(messages) - 1
            if not message.header_done:
                if not final:  # the header decides where the body goes: wait for it
                    held = len(message.header)
                continue
            body = message.body
            if last and not final and not message.closed:
                held = _held_marker_prefix(body)
                body = body[:len(body) - held]
            message = Message(message.header, body, True, message.closed)
            if message.channel == "analysis":
                reasoning.append(body)
            elif message.is_function_call:
                content.append(call_markup(message))
            else:
                content.append(body)
        return "".join(reasoning), "".join(content), held

    def constraint_waits_for(self, prompt_text: str) -> str | None:
        """A structured output constrains the final channel: it starts after that channel's
        header (None if the prompt already opened it)."""
        header = open_header(prompt_text)
        if MESSAGE in header and _CHANNEL_NAME.search(header) and "final" in header:
            return None
        return CHANNEL + "final" + MESSAGE


def function_calls(content: str, final: bool) -> tuple[str, list[tuple[str, str, bool]]]:
    """The content less its function call messages, and each call as (name, arguments so far,
    closed). Not final: a tail that may be the start of a call's markup is left out. At the end
    of the output a call still open counts as closed (<|call|> is a stop token, never in the
    text)."""
    text, calls, pos = [], [], 0
    while (start := content.find(CALL_PREFIX, pos)) >= 0:
        text.append(content[pos:start])
        header_end = content.find(CALL_HEADER_END, start)
        if header_end < 0:  # the markup is canonical and written whole: this cannot grow into one
            text.append(content[start:])
            pos = len(content)
            break
        name = content[start + len(CALL_PREFIX):header_end].removeprefix("functions.")
        body_start = header_end + len(CALL_HEADER_END)
        close = content.find(CALL, body_start)
        body = content[body_start:] if close < 0 else content[body_start:close]
        calls.append((name, body, close >= 0 or final))
        pos = len(content) if close < 0 else close + len(CALL)
    tail = content[pos:]
    text.append(tail if final else without_partial_tag(tail, CALL_PREFIX))
    return "".join(text), calls
