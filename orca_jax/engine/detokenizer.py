"""Incremental detokenization for streaming, and stop-string handling.

Decoding one token at a time is wrong for byte-level BPE (a character can span tokens) and for
SentencePiece (a lone token loses its leading space). So each step decodes a short window of
recent tokens twice, with and without the new ones (`windows`), and emits the difference
(`accept`), and only once the window no longer ends in an incomplete character (U+FFFD).

The engine feeds a whole step at once with `detokenize_step`: one call into the Rust tokenizer
(`decode_batch`) decodes both windows of every sequence, instead of two Python-level
`tokenizer.decode` calls per token. tokenizers' own `DecodeStream` cannot flush a trailing
partial character at the end of a sequence, hence the windows.

Every step costs time proportional to what is new: the text is kept as a list of pieces and
joined only when someone reads `text` (a string attribute grown with `+=` is copied whole
every step), and the stop-string search and the stream deltas look only at the end of it.
"""

from __future__ import annotations

import functools
import sys

# Prompt tokens kept as left context, so the first generated token decodes with its spacing.
_CONTEXT_TOKENS = 6
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """The text of one sequence, grown a token at a time (`add_token`, or `windows` then
    `accept` as `detokenize_step` does), truncated at the first stop string.

    Three views of the text are kept, each costing O(new characters) per token: `_pieces` (all
    of it, joined when `text` is read), `_unsent` (what `take_delta` has not handed out yet)
    and `_tail` (its last characters that a stop string could begin with)."""

    __slots__ = ("tokenizer", "stop", "include_stop_str_in_output", "min_tokens", "skip_special_tokens", "emitted",
                 "_ids", "_num_tokens", "_prefix_offset", "_read_offset", "_hold", "_pieces", "_length", "_unsent",
                 "_tail")

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] = (),
                 include_stop_str_in_output: bool = False, *, min_tokens: int = 0, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens  # stop strings count only from this many tokens on (vLLM's rule)
        self.skip_special_tokens = skip_special_tokens
        self._num_tokens = 0  # tokens added
        self.emitted = 0  # characters of `text` already handed out as deltas
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # While running, this many last characters could still be the start of a stop string.
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._pieces: list[str] = []  # the text, in the order it was decoded
        self._length = 0  # characters in the pieces
        self._unsent: list[str] = []  # text[emitted:], in pieces
        self._tail = ""  # text[-hold:]

    # ---- the text ---------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """Everything decoded so far (after stop-string truncation). Joined on read, and kept
        as one piece afterwards, so reading it every step costs one copy per step."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _append(self, piece: str) -> None:
        self._pieces.append(piece)
        self._unsent.append(piece)
        self._length += len(piece)

    def _truncate(self, end: int) -> None:
        """Keep `text[:end]`. Only called with a stop string just found, so `end` lies in the
        new text or the tail, past what was sent."""
        while self._pieces and self._length - len(self._pieces[-1]) >= end:
            self._length -= len(self._pieces.pop())
        if self._length > end:
            last = self._pieces[-1]
            self._pieces[-1] = last[: len(last) - (self._length - end)]
            self._length = end
        unsent = "".join(self._unsent)[: end - self.emitted]
        self._unsent = [unsent] if unsent else []
        self._tail = self._last_characters(self._hold)

    def _last_characters(self, count: int) -> str:
        """`text[-count:]` (or all of it), reading only the pieces it spans."""
        parts, covered = [], 0
        for piece in reversed(self._pieces):
            if covered >= count:
                break
            parts.append(piece)
            covered += len(piece)
        joined = "".join(reversed(parts))
        return joined[len(joined) - count:] if len(joined) > count else joined

    def _tail_of(self, window: str) -> str:
        """The last `hold` characters of `window`, an end of the text (all of it if shorter)."""
        return window[len(window) - self._hold:] if len(window) > self._hold else window

    # ---- adding tokens ----------------------------------------------------------------------
    def windows(self, token_id: int) -> tuple[list[int], list[int]]:
        """Append one token; returns the token windows to decode for it, (prefix, full): the
        text `full` adds to `prefix` is the new text. Pass both decodes to `accept`."""
        self._ids.append(token_id)
        self._num_tokens += 1
        ids, start = self._ids, self._prefix_offset
        return ids[start:self._read_offset], ids[start:]

    def accept(self, prefix_text: str, full_text: str) -> str | None:
        """Take the decoded windows of the last `windows` call. Returns the stop string if the
        text now contains one (the text is then truncated at it), else None."""
        if len(full_text) <= len(prefix_text) or full_text.endswith(_INCOMPLETE):
            return None  # wait for the rest of the character
        new = full_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if not self.stop:
            self._append(new)
            return None
        # A stop string completed by this token starts in the last `hold` characters or later.
        search_from = self._length - len(self._tail)
        window = self._tail + new
        self._append(new)
        self._tail = self._tail_of(window)
        if self._num_tokens < self.min_tokens:
            return None
        return self._truncate_at_stop(window, search_from)

    def add_token(self, token_id: int) -> str | None:
        """Append one token, decoding it with `tokenizer.decode` (the reference path;
        `detokenize_step` gives the same result for a whole step in one call)."""
        prefix_ids, full_ids = self.windows(token_id)
        return self.accept(self._decode(prefix_ids), self._decode(full_ids))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def flush(self) -> None:
        """At the end of a sequence: emit whatever is still pending, even an incomplete
        character."""
        if self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full = self._decode(self._ids[self._prefix_offset:])
            new = full[len(prefix):]
            if new:
                self._append(new)
                self._tail = self._tail_of(self._tail + new)
            self._read_offset = len(self._ids)

    def _truncate_at_stop(self, window: str, window_start: int) -> str | None:
        """Cut at the earliest stop string in `window` (the end of the text, from
        `window_start`; one token can complete several stop strings)."""
        found = [(at, stop) for stop in self.stop if (at := window.find(stop)) >= 0]
        if not found:
            return None
        at, stop = min(found, key=lambda f: f[0])
        self._truncate(window_start + at + (len(stop) if self.include_stop_str_in_output else 0))
        return stop

    # ---- streaming --------------------------------------------------------------------------
    def take_delta(self, finished: bool) -> str:
        """New text for a stream. While running, the last characters that could still begin a
        stop string are held back."""
        end = self._length if finished else max(self.emitted, self._length - self._hold)
        count = end - self.emitted
        if count == 0:
            return ""
        unsent = self._unsent[0] if len(self._unsent) == 1 else "".join(self._unsent)
        delta, rest = unsent[:count], unsent[count:]
        self._unsent = [rest] if rest else []
        self.emitted = end
        return delta


def detokenize_step(detoks: list[IncrementalDetokenizer], tokens: list[int]) -> list[str | None]:
    """Add tokens[i] to detoks[i] for every i, as `add_token` would. Returns the stop string
    each one found (or None). Detokenizers sharing a tokenizer are decoded together: both
    windows of all of them in one call."""
    if len(detoks) != len(tokens):
        raise ValueError(f"{len(detoks)} detokenizers for {len(tokens)} tokens")
    groups = _rows_by_tokenizer(detoks)
    if len(groups) == 1:  # the engine's case: one tokenizer, no regrouping
        (tokenizer, skip), _ = groups[0]
        decoded = _decode_many(tokenizer, [ids for d, t in zip(detoks, tokens) for ids in d.windows(t)], skip)
        return [d.accept(prefix, full) for d, prefix, full in zip(detoks, decoded[0::2], decoded[1::2])]
    windows = [d.windows(t) for d, t in zip(detoks, tokens)]
    texts: list[tuple[str, str] | None] = [None] * len(detoks)
    for (tokenizer, skip), rows in groups:
        decoded = _decode_many(tokenizer, [ids for row in rows for ids in windows[row]], skip)
        for row, prefix, full in zip(rows, decoded[0::2], decoded[1::2]):
            texts[row] = prefix, full
    return [d.accept(prefix, full) for d, (prefix, full) in zip(detoks, texts)]


def _rows_by_tokenizer(detoks: list[IncrementalDetokenizer]) -> list[tuple[tuple[object, bool], list[int]]]:
    """[((tokenizer, skip_special_tokens), the rows decoding that way)]; one engine has one
    tokenizer and most requests skip special tokens, so that case is checked first. Grouped by
    identity: tokenizers need not be hashable."""
    if not detoks:
        return []
    first, skip = detoks[0].tokenizer, detoks[0].skip_special_tokens
    if all(d.tokenizer is first and d.skip_special_tokens == skip for d in detoks):
        return [((first, skip), range(len(detoks)))]
    groups: dict[tuple[int, bool], tuple[tuple[object, bool], list[int]]] = {}
    for row, d in enumerate(detoks):
        key = (id(d.tokenizer), d.skip_special_tokens)
        groups.setdefault(key, ((d.tokenizer, d.skip_special_tokens), []))[1].append(row)
    return list(groups.values())


def _decode_many(tokenizer, id_lists: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """`[tokenizer.decode(ids, skip_special_tokens=...) for ids in id_lists]`, in one Rust call
    where that is provably the same text."""
    if rust_decode_is_exact(tokenizer):
        return tokenizer.backend_tokenizer.decode_batch(id_lists, skip_special_tokens=skip_special_tokens)
    return [tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in id_lists]


def rust_decode_is_exact(tokenizer) -> bool:
    """Whether `tokenizer.decode(ids, skip_special_tokens=True)` is exactly the Rust tokenizer's
    `decode`. orca_jax's own tokenizer (`models.tokenizer.Tokenizer`) says so itself
    (`decodes_in_rust`), without transformers being imported. In transformers 5 a fast
    tokenizer's decode is the Rust decode followed by an optional `clean_up_tokenization`
    (string replacements such as " ." -> "."); so it is, for a `TokenizersBackend` that
    overrides neither `decode` nor `_decode` and does not clean up. Anything else (a slow
    tokenizer, a subclass with its own decoding, clean-up on) is decoded through
    `tokenizer.decode`."""
    if getattr(type(tokenizer), "decodes_in_rust", False):
        return True
    if "transformers" not in sys.modules:  # then no transformers tokenizer exists in this process
        return False
    classes = _transformers_decode_classes()
    if classes is None:
        return False
    base, backend = classes
    cls = type(tokenizer)
    return (isinstance(tokenizer, backend) and cls.decode is base.decode and cls._decode is backend._decode
            and not tokenizer.clean_up_tokenization_spaces)


@functools.cache
def _transformers_decode_classes():
    """(PreTrainedTokenizerBase, TokenizersBackend) of transformers 5, or None for another
    layout, where the fast path is not taken. Imported on first use: this module does not
    need transformers otherwise."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    return PreTrainedTokenizerBase, TokenizersBackend
