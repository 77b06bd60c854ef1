"""The tokenizer of a GGUF file, built from the file's own metadata with `tokenizers` alone.

A GGUF has no tokenizer.json: llama.cpp's converter stores the vocabulary, token types, merges
or scores, special token ids and the chat template as `tokenizer.*` metadata. transformers can
read those too (`AutoTokenizer.from_pretrained(..., gguf_file=...)`), but its GGUF reader
imports torch, which is a test-only dependency here, and it parses the whole file a second time.
This module builds the same kind of `tokenizers.Tokenizer` from the `gguf.GGUFReader` the
weights were read with, and wraps it in orca_jax's own `models.tokenizer.Tokenizer` (what
`transformers.PreTrainedTokenizerFast` would be over it, without importing transformers).

Two vocabulary kinds (`tokenizer.ggml.model`) are supported:
  "gpt2"   byte-level BPE with merges (SmolLM, Llama 3, Qwen, StarCoder, ...). How text is split
           before BPE (`tokenizer.ggml.pre`) follows llama.cpp, the format's reference, which
           reproduces each model's original tokenizer.json.
  "llama"  SentencePiece BPE (Llama 2, TinyLlama, Mistral v0.1, ...): "\u2581" for spaces, byte
           fallback tokens `<0xNN>`, merges derived from the token scores when the file lists none.
Any other kind is refused with an error that names it.
"""

from __future__ import annotations

from typing import Any

from orca_jax.loading.tokenizer import Tokenizer

SPACE_MARK = "\u2581"  # SentencePiece's visible space

# gguf.TokenType values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Metadata arrays the tokenizer reads; the model loader skips them when it reads the config.
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                    "tokenizer.ggml.scores")

# `tokenizer.ggml.pre` -> how text is split before byte-level BPE, as llama.cpp's llama-vocab.cpp
# groups them. "gpt2": GPT-2's regex. "digits": every digit alone first, then GPT-2's regex
# (StarCoder-style vocabularies, SmolLM's among them). "llama3": the cl100k-style regex of Llama 3.
# "qwen2": Qwen2/2.5/3's regex, Llama 3's but with every digit alone (llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_QWEN2, which DeepSeek-R1's Qwen distills name "deepseek-r1-qwen").
_PRE_TOKENIZER_KINDS = {
    "default": "gpt2", "gpt2": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "command-r": "digits", "codeshell": "digits",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEXES = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def tokenizer_from_gguf(reader) -> Tokenizer:
    """The tokenizer of the vocabulary in an opened GGUF file."""
    return build_tokenizer(read_tokenizer_metadata(reader))


def read_tokenizer_metadata(reader) -> dict[str, Any]:
    """The `tokenizer.*` fields of an opened `gguf.GGUFReader`, decoded (absent ones omitted)."""
    return {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer of decoded `tokenizer.*` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("the GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges"), meta.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        backend = _sentencepiece_bpe(tokens, meta)
    else:
        raise ValueError(
            f"cannot build a tokenizer for GGUF tokenizer model {kind!r} (tokenizer.ggml.model); "
            "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
        )
    backend.add_special_tokens(_added_tokens(tokens, types, special=True))
    backend.add_tokens(_added_tokens(tokens, types, special=False))
    # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    return Tokenizer(
        backend,
        special_tokens={
            "bos_token": _special_token(meta, tokens, "bos_token_id"),
            "eos_token": _special_token(meta, tokens, "eos_token_id"),
            "unk_token": _special_token(meta, tokens, "unknown_token_id"),
            "pad_token": _special_token(meta, tokens, "padding_token_id"),
        },
        # Given explicitly, so that the post-processor is built to add (or not add) them.
        add_bos_token=add_bos,
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _special_token(meta: dict, tokens: list[str], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ValueError(f"tokenizer.ggml.{key} = {token_id} is outside the vocabulary of {len(tokens)} tokens")
    return tokens[token_id]


def _added_tokens(tokens: list[str], types: list[int], special: bool) -> list:
    """Control tokens (`<|im_start|>`) as special tokens, user-defined ones (`<think>`) as plain
    added tokens: llama.cpp matches both whole in the text, so they must never be split by BPE.
    They keep their literal spelling, which is also their key in the vocabulary."""
    from tokenizers import AddedToken

    wanted = CONTROL if special else USER_DEFINED
    return [AddedToken(token, special=special, normalized=False)
            for token, token_type in zip(tokens, types) if token_type == wanted]


# ---- byte-level BPE ("gpt2") -----------------------------------------------------------------
def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str] | None, pre: str | None):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models

    if merges is None:
        raise ValueError("byte-level BPE GGUF vocabulary without tokenizer.ggml.merges")
    alphabet = byte_level_alphabet()
    spelling = byte_to_char()
    vocab = {}
    for index, (token, token_type) in enumerate(zip(tokens, types)):
        if token_type in (NORMAL, UNUSED, UNKNOWN) and not set(token) <= alphabet:
            # A normal token must be spelled in the byte alphabet for BPE to ever produce it; a
            # few converters wrote some literally, so spell those the byte-level way.
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    model = models.BPE(vocab=vocab, merges=[split_merge(m) for m in merges], dropout=None,
                       continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    tokenizer = RustTokenizer(model)
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_level_pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    kind = _PRE_TOKENIZER_KINDS.get(pre or "default")
    if kind is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
            f"{', '.join(sorted(_PRE_TOKENIZER_KINDS))}"
        )
    gpt2_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "gpt2":
        return gpt2_regex
    if kind == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2_regex])
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEXES[kind]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def split_merge(merge: str) -> tuple[str, str]:
    """"a b" -> ("a", "b"). The separator is the first space after the first character, as
    llama.cpp reads it, so a merge whose left side is itself a space still splits right."""
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ValueError(f"malformed GGUF merge {merge!r} (expected 'left right')")
    return merge[:cut], merge[cut + 1:]


def byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level spelling: printable bytes stand for themselves, the other 68 are
    moved to the code points from 256 on, so every token is visible text without spaces."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    spelling = {b: chr(b) for b in printable}
    moved = (b for b in range(256) if b not in spelling)
    for offset, b in enumerate(moved):
        spelling[b] = chr(256 + offset)
    return spelling


def byte_level_alphabet() -> set[str]:
    return set(byte_to_char().values())


# ---- SentencePiece BPE ("llama") -------------------------------------------------------------
def _sentencepiece_bpe(tokens: list[str], meta: dict):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = [split_merge(m) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError("SentencePiece GGUF vocabulary needs tokenizer.ggml.scores (one per token) or merges")
        merges = merges_from_scores(tokens, scores)
    unk = _special_token(meta, tokens, "unknown_token_id")
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    tokenizer = RustTokenizer(model)
    # SentencePiece marks spaces with U+2581 and (by default) adds one before the text.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE_MARK, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))  # the space the encoder added
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE keeps no merge list: the score of a piece is the rank of the merge that
    made it. Every split of a piece into two vocabulary pieces is a candidate merge with the
    piece's score; the best score merges first. Ties go to the longer left part, then the
    longer right part, then vocabulary order (the order transformers' converter gives)."""
    ids = {token: index for index, token in enumerate(tokens)}
    candidates = []
    for token, score in zip(tokens, scores):
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        splits = [(left, right) for left, right in splits if left in ids and right in ids]
        splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        candidates.extend((left, right, score) for left, right in splits)
    candidates.sort(key=lambda c: (-c[2], -len(c[0]), -len(c[1])))  # stable: keeps the order above
    return [(left, right) for left, right, _ in candidates]
