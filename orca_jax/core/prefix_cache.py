"""Content hashes of full KV pages, the keys of automatic prefix caching.

A page's K/V depend on every token up to its last one, so its identity is a hash chained over
its parent page's hash and its own token ids: two sequences whose first k pages hash alike
share those k pages' contents exactly. The first page also takes a salt (reserved for keys
that change the K/V without changing the tokens, such as a LoRA adapter or image features, or
a tenant that must not share a cache with others), and the chain carries it to every page.

BLAKE2b with a 16-byte digest: a collision would silently give one sequence another's
context, and Python's `hash` of a tuple is 64 bits and not built to resist them. One page
costs about a microsecond to hash.
"""

from __future__ import annotations

import hashlib

import numpy as np

DIGEST_SIZE = 16


def hash_page(parent: bytes | None, token_ids: list[int], salt: str | None = None) -> bytes:
    """The hash of a full page holding `token_ids`, after the page whose hash is `parent`
    (None for a sequence's first page, which takes `salt` instead)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    if parent is None:
        # Marked, so that no parent's digest and no salt can produce the same input.
        h.update(b"salt:" + salt.encode() if salt is not None else b"root")
    else:
        h.update(b"page:" + parent)
    h.update(np.asarray(token_ids, np.int64).tobytes())
    return h.digest()


def extend_page_hashes(page_hashes: list[bytes], tokens, num_tokens: int, page_size: int,
                       salt: str | None = None) -> list[bytes]:
    """Append to `page_hashes` (a sequence's hashes so far, in place) the hashes of its pages
    that `num_tokens` known tokens fill. `tokens(start, stop)` gives the token ids."""
    for index in range(len(page_hashes), num_tokens // page_size):
        parent = page_hashes[index - 1] if index else None
        page_hashes.append(hash_page(parent, tokens(index * page_size, (index + 1) * page_size), salt))
    return page_hashes
