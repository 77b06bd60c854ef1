"""RequestError: a request that cannot be served as asked, raised where the check is made.

It names what is wrong (`param`, a field of the request) and why (`code`), so the server can
answer a 400 that names the field without reading the message. It is a ValueError, so code
that catches ValueError for bad input (the offline API, older tests) keeps working.
"""

from __future__ import annotations

# How the error of a request whose output constraint failed mid-generation begins (the
# matcher refused a token or gave up): the server answers it as the client's error, not 500.
CONSTRAINT_FAILED = "the output constraint could not be satisfied"


class RequestError(ValueError):
    """A bad request. `param` is the field at fault (None: the request as a whole), in the
    caller's terms: SamplingParams and LLMEngine name their own arguments (`temperature`,
    `prompt`, `max_tokens`); inside a pydantic validator it is relative to the object being
    validated (the validator's location is put in front of it)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def check_unicode(text: str, param: str) -> None:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"), which no tokenizer can encode and
    no response can echo: refuse it as the bad input it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{param} is not valid Unicode text: it holds a lone surrogate "
                           f"({text[exc.start]!r}) at character {exc.start}", param) from None
