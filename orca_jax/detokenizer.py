"""Incremental detokenization for streaming, and stop-string handling.

Decoding one token at a time is wrong for byte-level BPE (a character can span tokens) and for
SentencePiece (a lone token loses its leading space). So each step decodes a short window of
recent tokens twice, with and without the new ones, and emits the difference, and only once the
window no longer ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Prompt tokens kept as left context, so the first generated token decodes with its spacing.
_CONTEXT_TOKENS = 6
_INCOMPLETE = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    prompt_token_ids: list[int]
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    text: str = ""  # everything decoded so far (after stop-string truncation)
    emitted: int = 0  # characters of `text` already handed out as deltas

    def __post_init__(self):
        self._ids = list(self.prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_token(self, token_id: int) -> str | None:
        """Append one token. Returns the stop string if the text now contains one (the text is
        then truncated at it), else None."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return None  # wait for the rest of the character
        search_from = max(0, len(self.text) - self._hold)
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._truncate_at_stop(search_from)

    def flush(self) -> None:
        """At the end of a sequence: emit whatever is still pending, even an incomplete
        character."""
        if self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full = self._decode(self._ids[self._prefix_offset:])
            self.text += full[len(prefix):]
            self._read_offset = len(self._ids)

    def _truncate_at_stop(self, search_from: int) -> str | None:
        """Cut at the earliest stop string in the text (one token can complete several)."""
        found = [(at, stop) for stop in self.stop if (at := self.text.find(stop, search_from)) >= 0]
        if not found:
            return None
        at, stop = min(found, key=lambda f: f[0])
        self.text = self.text[: at + len(stop)] if self.include_stop_str_in_output else self.text[:at]
        return stop

    def take_delta(self, finished: bool) -> str:
        """New text for a stream. While running, the last characters that could still begin a
        stop string are held back."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self._hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
