"""vLLM's per-request token rules, as rows of the step's token bitmask.

    allowed_token_ids   only these tokens may be sampled
    bad_words           these words are never produced: a one-token word is always masked; for
                        a longer one, its last token is masked whenever the output so far ends
                        with the rest of it
    min_tokens          EOS and the request's stop token ids are masked until the output holds
                        this many tokens (the engine also ignores stop strings until then)

They ride on constrained decoding's bitmask (orca_jax.structured.guided_decoding): a row with a
rule in force this step is masked like a guided row, and a row without one costs nothing
(its step sends the shared all-ones mask), so the compiled step is unchanged. Only a
multi-token bad word reads the output's last tokens, so only such a request needs its tokens
on the host before each step, as a grammar does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orca_jax.errors import RequestError


@dataclass(frozen=True)
class TokenRules:
    vocab_size: int
    allowed: np.ndarray | None  # i32[W] bitmask of the allowed tokens; None: every token
    banned: tuple[int, ...]  # tokens never sampled (the one-token bad words)
    banned_after: tuple[tuple[tuple[int, ...], int], ...]  # (output must end with, token then masked)
    min_tokens: int
    end_tokens: tuple[int, ...]  # masked while the output is shorter than min_tokens

    @classmethod
    def build(cls, params, encode, end_tokens: set[int], vocab_size: int) -> TokenRules | None:
        """The rules of a SamplingParams, None when it has none. `encode(text)`: token ids of
        a text without special tokens. `end_tokens`: the engine's EOS ids (the request's stop
        token ids are added). Raises RequestError naming the field for a token id outside the
        vocabulary."""
        allowed = None
        if params.allowed_token_ids is not None:
            _check_ids(params.allowed_token_ids, vocab_size, "allowed_token_ids")
            allowed = pack_bits(params.allowed_token_ids, vocab_size)
        banned, banned_after = set(), set()
        for word in params.bad_words:
            for ids in bad_word_token_ids(word, encode):
                _check_ids(ids, vocab_size, "bad_words")
                if len(ids) == 1:
                    banned.add(ids[0])
                else:
                    banned_after.add((tuple(ids[:-1]), ids[-1]))
        ends = () if params.ignore_eos else tuple(sorted(end_tokens))
        ends = tuple(sorted(set(ends) | set(params.stop_token_ids)))
        if allowed is None and not banned and not banned_after and params.min_tokens == 0:
            return None
        return cls(vocab_size, allowed, tuple(sorted(banned)), tuple(sorted(banned_after)), params.min_tokens, ends)

    @property
    def reads_output(self) -> bool:
        """Whether the mask depends on the output's tokens (not only on their count)."""
        return bool(self.banned_after)

    def in_force(self, num_output: int) -> bool:
        """Whether a step sampling output token number `num_output` (0-based) masks anything."""
        return (self.allowed is not None or bool(self.banned) or bool(self.banned_after)
                or num_output < self.min_tokens)

    def apply(self, row: np.ndarray, output: list[int], num_output: int) -> None:
        """Clear, in `row` (i32[W], a bitmask row), the tokens these rules forbid next, after
        `output` (the tokens so far, `num_output` of them counting those the host lacks)."""
        if self.allowed is not None:
            row &= self.allowed
        forbidden = list(self.banned)
        forbidden += [token for before, token in self.banned_after
                      if len(output) >= len(before) and tuple(output[len(output) - len(before):]) == before]
        if num_output < self.min_tokens:
            forbidden += [t for t in self.end_tokens if t < self.vocab_size]
        if forbidden:
            ids = np.asarray(forbidden, np.int64)
            # One word per forbidden token: clear its bit (int32 words, the sign bit included).
            np.bitwise_and.at(row, ids // 32, ~np.left_shift(1, ids % 32).astype(np.uint32).view(np.int32))


def bad_word_token_ids(word: str, encode) -> list[list[int]]:
    """A bad word's token sequences: as written at the start of a text, and after a space
    (where byte-level and SentencePiece tokenizers spell it differently), as vLLM bans it."""
    bare = word.lstrip()
    spellings = [encode(bare)]
    spaced = encode(" " + bare)
    # The spaced spelling is another word only if it is not the bare one with a space token
    # in front (a tokenizer that writes the space as its own token).
    if spaced and spaced != spellings[0] and spaced[1:] != spellings[0]:
        spellings.append(spaced)
    return [ids for ids in spellings if ids]


def pack_bits(token_ids, vocab_size: int) -> np.ndarray:
    """i32[ceil(V / 32)] with bit t % 32 of word t // 32 set for each token t."""
    bits = np.zeros(-(-vocab_size // 32) * 32, bool)
    bits[np.asarray(list(token_ids), np.int64)] = True
    return np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=-1).view(">u4").astype(np.uint32).view(np.int32)[:, 0]


def _check_ids(ids, vocab_size: int, field: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{field}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", field)
