"""What a streamed parser holds back: the end of the text so far that may still become a tag.

The reasoning parsers (`</think>`), the Hermes tool parser (`<tool_call>`) and harmony's call
markup all read the whole text at every update and must not show a tail that the next token
could turn into the tag they look for; once the tag is written, or generation ends, the tail
is decided. One rule for all of them, so their streams agree on what "may become" means."""

from __future__ import annotations


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (0: none)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def without_partial_tag(text: str, tag: str) -> str:
    """`text` less any ending that could be the start of `tag`, which must not be shown yet."""
    return text[:len(text) - partial_tag_length(text, tag)]
