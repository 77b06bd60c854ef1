"""Reasoning output: a thinking model's `<think>...</think>` text split from its answer.

`--reasoning-parser NAME` (vLLM's names) puts the reasoning in the chat message's `reasoning`
field (vLLM's current name) and `reasoning_content` (the name older clients read), the rest in
`content`; tool calls are parsed from the content only. Streamed, the split is made on the text
so far: a tail that could still become a tag is held back until the next token decides, so the
deltas of each field reassemble to the non-streamed message.

Where the reasoning starts:
    deepseek_r1  at the first token: DeepSeek-R1's template opens `<think>` in the prompt and
                 the model may or may not repeat it; an output with no `</think>` is all
                 reasoning (it was cut off while thinking)
    qwen3        only where the model opens `<think>` (Qwen3 with enable_thinking), or where the
                 prompt ends inside an open one (the 2507 thinking models' template); otherwise
                 (enable_thinking false closes an empty block in the prompt) it is all content

    openai_gptoss  gpt-oss's harmony channels (orca_jax/entrypoints/harmony.py): the analysis
                 channel is the reasoning, the final channel the answer

A structured output then constrains the answer, not the reasoning: `constraint_waits_for`
gives the text the grammar waits for (orca_jax.structured.guided_decoding.GuidedState's
`starts_after`), unless the prompt already closed the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from orca_jax.entrypoints.harmony import HarmonyReasoningParser
from orca_jax.entrypoints.partial_tags import partial_tag_length


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # Whether an output whose prompt has no open block starts inside the reasoning anyway.
    always_starts_in_reasoning: bool = False
    # Whether the split reads special tokens (harmony's markers): then they stay in the text.
    needs_special_tokens: bool = False

    def starts_in_reasoning(self, prompt_text: str) -> bool | None:
        """True: the output begins inside the reasoning; False: it cannot hold any (the prompt
        closed the block); None: only if the output itself opens it."""
        tail = prompt_text.rstrip()
        if tail.endswith(self.end):
            return False
        if tail.endswith(self.start) or self.always_starts_in_reasoning:
            return True
        return None

    def constraint_waits_for(self, prompt_text: str) -> str | None:
        """The text after which an output constraint starts: the end of the reasoning, or None
        when the prompt leaves no reasoning to come."""
        return None if self.starts_in_reasoning(prompt_text) is False else self.end

    def split(self, text: str, prompt_text: str = "", final: bool = True) -> tuple[str, str, int]:
        """(reasoning, content, held): the text so far split into the two fields. Not final:
        `held` characters at the end are left out of both, being a possible start of a tag."""
        opened = self.starts_in_reasoning(prompt_text)
        if opened is False:
            return "", text, 0
        # The output may open the block itself (or repeat the prompt's opening tag): until its
        # first characters rule that out, nothing is decided.
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            text, opened = stripped[len(self.start):], True
        elif not final and self.start.startswith(stripped):
            return "", "", len(text)
        opened = bool(opened)
        if not opened:
            return "", text, 0
        end = text.find(self.end)
        if end >= 0:
            return text[:end], text[end + len(self.end):], 0
        held = 0 if final else partial_tag_length(text, self.end)
        return text[:len(text) - held], "", held


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", always_starts_in_reasoning=True),
    "qwen3": ReasoningParser("qwen3"),
    # gpt-oss: harmony's analysis channel (orca_jax/entrypoints/harmony.py).
    "openai_gptoss": HarmonyReasoningParser(),
}


def reasoning_parser(name: str | None) -> ReasoningParser | HarmonyReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]


def message_fields(parser: ReasoningParser, text: str, prompt_text: str) -> tuple[dict, str]:
    """The reasoning fields of a finished message ({} without reasoning) and its content text."""
    reasoning, content, _ = parser.split(text, prompt_text)
    fields = {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning else {}
    return fields, content


class ReasoningStream:
    """One streamed choice's split: each update gives the new reasoning and the new content."""

    def __init__(self, parser: ReasoningParser, prompt_text: str):
        self.parser = parser
        self.prompt_text = prompt_text
        self.text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    def update(self, delta_text: str, final: bool) -> tuple[str, str]:
        self.text += delta_text
        reasoning, content, _ = self.parser.split(self.text, self.prompt_text, final)
        new_reasoning, new_content = reasoning[self._sent_reasoning:], content[self._sent_content:]
        self._sent_reasoning, self._sent_content = len(reasoning), len(content)
        return new_reasoning, new_content
