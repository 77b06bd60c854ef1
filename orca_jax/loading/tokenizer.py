"""Tokenizer: a `tokenizers.Tokenizer` (Rust) with what the engine reads of a tokenizer, and no more.

transformers' `PreTrainedTokenizerFast` is a wrapper over the same Rust tokenizer; importing
transformers costs 1-2.5 s of every start on a 2-core CPU, for a few attributes. This class
offers the API orca_jax uses, with transformers' semantics (version 5), so that the text, the
ids and the rendered chat are exactly those of `PreTrainedTokenizerFast` (tests/models/
test_tokenizer.py compares them):

    encode(text, add_special_tokens=True)          ids (the post-processor adds BOS/EOS as asked)
    decode(ids, skip_special_tokens=False)         the Rust decode (no clean-up of spaces)
    batch_decode(id_lists, skip_special_tokens)    one Rust call for many
    bos/eos/unk/pad/sep/cls/mask_token(_id), special_tokens_map, all_special_tokens/ids
    len(), vocab_size, get_vocab(), convert_ids_to_tokens, convert_tokens_to_ids
    chat_template, apply_chat_template(conversation, tools=, add_generation_prompt=, ...)
    save_pretrained(directory) / from_pretrained(directory)   HF's layout: tokenizer.json +
                                                   tokenizer_config.json, readable by AutoTokenizer
    backend_tokenizer                              the Rust tokenizer (llguidance reads it)

Which directories it reads: a tokenizer.json whose tokenizer_config.json names the generic fast
class (`PreTrainedTokenizerFast` / `TokenizersBackend`) and asks for nothing this class lacks
(`unsupported_reason`). Model-specific classes (LlamaTokenizer, ...) may rebuild the Rust
tokenizer in transformers 5, and SentencePiece-only directories have no tokenizer.json:
`load_tokenizer` hands those to AutoTokenizer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"  # older transformers kept the special tokens here
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATES_DIR = "additional_chat_templates"
# transformers' named special tokens, in its order (all_special_tokens lists them so).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The class names AutoTokenizer builds as the generic Rust-backed tokenizer (v4 and v5 spellings).
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# The class written into tokenizer_config.json: v5 maps it to TokenizersBackend, v4 knows it too.
SAVED_CLASS = "PreTrainedTokenizerFast"


def _named_token(name: str) -> property:
    return property(lambda self: self._token_string(name), doc=f"the {name} (None when the tokenizer has none)")


def _named_token_id(name: str) -> property:
    return property(lambda self: self._token_id(name), doc=f"the id of the {name} (None when there is none)")


class Tokenizer:
    """`backend`: the Rust tokenizer, taken over (not copied). `special_tokens`: named special
    tokens (SPECIAL_TOKEN_NAMES -> text or `tokenizers.AddedToken`); a named token missing from
    the added vocabulary is added, as special, as transformers does. `add_bos_token` /
    `add_eos_token`: when either is given, or the backend has no post-processor, the
    post-processor is rebuilt to add exactly those (transformers' `update_post_processor`)."""

    # decode(ids, skip_special_tokens) is exactly backend_tokenizer.decode: the detokenizer
    # decodes a whole step in one Rust call (orca_jax.engine.detokenizer.rust_decode_is_exact).
    decodes_in_rust = True

    def __init__(self, backend, *, special_tokens: dict[str, Any] | None = None,
                 extra_special_tokens: list | tuple = (), add_bos_token: bool | None = None,
                 add_eos_token: bool | None = None, chat_template: str | dict | None = None,
                 added_tokens: list | tuple = ()):
        from tokenizers import AddedToken

        self._backend = backend
        # transformers' encode switches both off for every call unless asked (it never is here).
        backend.no_truncation()
        backend.no_padding()
        self._special = {name: value for name, value in (special_tokens or {}).items() if value is not None}
        unknown = set(self._special) - set(SPECIAL_TOKEN_NAMES)
        if unknown:
            raise ValueError(f"unknown special token names {sorted(unknown)}; known: {SPECIAL_TOKEN_NAMES}")
        self._extra_special = list(dict.fromkeys(extra_special_tokens))
        self.chat_template = chat_template
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)
        # As PreTrainedTokenizerFast.__init__: added tokens listed by the config, then named and
        # extra special tokens, each only if the added vocabulary lacks it.
        present = {token.content for token in backend.get_added_tokens_decoder().values()}
        missing = []
        for token in [*added_tokens, *self._special.values(), *self._extra_special]:
            content = str(token)
            if content not in present:
                if isinstance(token, str):
                    token = AddedToken(token, special=True)
                elif not token.special and content in {str(v) for v in self._special.values()}:
                    token.special = True
                missing.append(token)
                present.add(content)
        if missing:
            backend.add_tokens(missing)
        # A post-processor of the file's own (Llama 3's adds BOS) stays unless the flags are given.
        self._rebuild_post_processor = add_bos_token is not None or add_eos_token is not None or (
            backend.post_processor is None)
        if self._rebuild_post_processor:
            self._update_post_processor()

    # ---- special tokens ---------------------------------------------------------------------
    bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token = (
        _named_token(name) for name in SPECIAL_TOKEN_NAMES)
    bos_token_id, eos_token_id, unk_token_id, sep_token_id, pad_token_id, cls_token_id, mask_token_id = (
        _named_token_id(name) for name in SPECIAL_TOKEN_NAMES)

    def _token_string(self, name: str) -> str | None:
        value = self._special.get(name)
        return None if value is None else str(value)

    def _token_id(self, name: str) -> int | None:
        token = self._token_string(name)
        return None if token is None else self.convert_tokens_to_ids(token)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens that are set (the chat template sees them as variables)."""
        return {name: str(self._special[name]) for name in SPECIAL_TOKEN_NAMES if name in self._special}

    @property
    def extra_special_tokens(self) -> list[str]:
        return [str(token) for token in self._extra_special]

    @property
    def all_special_tokens(self) -> list[str]:
        """Named special tokens, then the extra ones, each once (transformers' order)."""
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    def _update_post_processor(self) -> None:
        """The post-processor that adds BOS and EOS as the flags say (transformers' template
        strings, so both build the same processor); a flag without its token is dropped."""
        from tokenizers import processors

        bos, eos = self.bos_token, self.eos_token
        self.add_bos_token = self.add_bos_token and bos is not None
        self.add_eos_token = self.add_eos_token and eos is not None
        bos_a, eos_a = (f"{bos}:0 " if self.add_bos_token else ""), (f" {eos}:0" if self.add_eos_token else "")
        bos_b, eos_b = (f" {bos}:1" if self.add_bos_token else ""), (f" {eos}:1" if self.add_eos_token else "")
        single = f"{bos_a}$A:0{eos_a}"
        pair = f"{single}{bos_b} $B:1{eos_b}"
        special = ([(bos, self.bos_token_id)] if self.add_bos_token else []) + (
            [(eos, self.eos_token_id)] if self.add_eos_token else [])
        self._backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    # ---- the vocabulary ---------------------------------------------------------------------
    @property
    def backend_tokenizer(self):
        return self._backend

    def __len__(self) -> int:
        """Every id, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' meaning)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return dict(sorted(self._backend.get_added_tokens_decoder().items()))

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {token.content: index for index, token in self.added_tokens_decoder.items()}

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int] | None:
        """A token unknown to the vocabulary is the unknown token's id (None without one)."""
        if isinstance(tokens, str):
            index = self._backend.token_to_id(tokens)
            return self.unk_token_id if index is None and tokens != self.unk_token else index
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(index)) for index in ids if int(index) not in skip]

    # ---- text <-> ids -----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str | list[str]:
        """One sequence's text (a list of sequences gives a list of texts, as transformers)."""
        token_ids = _as_lists(token_ids)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return self.batch_decode(token_ids, skip_special_tokens)
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return self._backend.decode_batch([list(ids) for ids in _as_lists(sequences)],
                                          skip_special_tokens=skip_special_tokens)

    # ---- chat ---------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template to render: `chat_template` (a template, or the name of one of several),
        else the tokenizer's own; of several, "tool_use" when there are tools, else "default"."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError("This model has multiple chat templates with no default specified! Please pass "
                                 f"the name of one as chat_template: {sorted(templates)}")
        if chat_template is None:
            if templates is None:
                raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set "
                                 "and no template argument was passed!")
            return templates
        return chat_template

    def apply_chat_template(self, conversation: list, tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True, **kwargs):
        """The conversation rendered by the chat template (`orca_jax.loading.jinja_chat`), with
        the special tokens and `kwargs` as the template's variables. `tokenize`: its ids
        (encoded without adding special tokens: the template writes them), as
        {"input_ids", "attention_mask"} when `return_dict`, as transformers 5 returns them."""
        from orca_jax.loading.jinja_chat import render_chat

        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        text = render_chat(self.get_chat_template(chat_template, tools), conversation, tools=tools,
                           documents=documents, add_generation_prompt=add_generation_prompt,
                           **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    # ---- files ------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> tuple[str, ...]:
        """tokenizer.json and tokenizer_config.json (the chat template inside it), as
        transformers lays them out, so AutoTokenizer reads the directory as this tokenizer."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / TOKENIZER_FILE))
        config: dict[str, Any] = {"tokenizer_class": SAVED_CLASS, "backend": "tokenizers",
                                  **self.special_tokens_map, "add_bos_token": self.add_bos_token,
                                  "add_eos_token": self.add_eos_token, "clean_up_tokenization_spaces": False}
        if self._extra_special:
            config["extra_special_tokens"] = self.extra_special_tokens
        if isinstance(self.chat_template, dict):
            config["chat_template"] = [{"name": name, "template": text} for name, text in self.chat_template.items()]
        elif self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        return str(directory / TOKENIZER_FILE), str(directory / CONFIG_FILE)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> Tokenizer:
        """The tokenizer of an HF-layout directory; ValueError (saying why) when it is not one
        this class reads exactly as transformers would (`unsupported_reason`)."""
        from tokenizers import Tokenizer as RustTokenizer

        directory = Path(directory)
        config = read_config(directory)
        reason = unsupported_reason(directory, config)
        if reason:
            raise ValueError(f"{directory}: {reason}")
        special = {name: _added_token(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
        extra = [_added_token(t) for t in config.get("extra_special_tokens") or config.get("additional_special_tokens")
                 or ()]
        added = [_added_token(spec) for _, spec in sorted(
            (config.get("added_tokens_decoder") or {}).items(), key=lambda item: int(item[0]))]
        tokenizer = cls(RustTokenizer.from_file(str(directory / TOKENIZER_FILE)), special_tokens=special,
                        extra_special_tokens=extra, add_bos_token=config.get("add_bos_token"),
                        add_eos_token=config.get("add_eos_token"), chat_template=_read_chat_template(directory, config),
                        added_tokens=added)
        tokenizer._reassert_special_tokens()
        return tokenizer

    def _reassert_special_tokens(self) -> None:
        """What transformers' from_pretrained does after construction (`_post_init`): every named
        and extra special token is added again as special and unnormalized (an added token of
        the same text takes those flags), and the post-processor rebuilt if __init__ did."""
        from tokenizers import AddedToken

        tokens = [token if not isinstance(token, str) else AddedToken(token, special=True, normalized=False)
                  for token in [*self._special.values(), *self._extra_special]]
        if tokens:
            self._backend.add_special_tokens(tokens)
        if self._rebuild_post_processor:
            self._update_post_processor()

    def __repr__(self) -> str:
        return f"Tokenizer(vocab={len(self)}, bos={self.bos_token!r}, eos={self.eos_token!r})"


def _as_lists(ids):
    """numpy arrays and scalars as Python lists and ints (the Rust decode wants those)."""
    return ids.tolist() if hasattr(ids, "tolist") else ids


def _added_token(spec):
    """A config's token: plain text, or transformers' serialized AddedToken dict."""
    if isinstance(spec, str):
        return spec
    from tokenizers import AddedToken

    fields = {k: spec[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in spec}
    return AddedToken(spec["content"], **fields)


def read_config(directory: Path) -> dict:
    """tokenizer_config.json, with special tokens it lacks taken from special_tokens_map.json."""
    config = _read_json(directory / CONFIG_FILE)
    for name, value in _read_json(directory / SPECIAL_TOKENS_FILE).items():
        config.setdefault(name, value)
    return config


def unsupported_reason(directory: Path, config: dict) -> str | None:
    """Why transformers would build something other than this class from `directory` (None: it
    would not). Anything unexpected goes to AutoTokenizer, which is always right."""
    if not (directory / TOKENIZER_FILE).is_file():
        return f"no {TOKENIZER_FILE}"
    if not (directory / CONFIG_FILE).is_file():
        return f"no {CONFIG_FILE} (AutoTokenizer would pick the class from the model's config)"
    name = config.get("tokenizer_class")
    if name not in GENERIC_CLASSES:
        return f"tokenizer_class {name!r} is not the generic fast tokenizer {GENERIC_CLASSES}"
    if config.get("clean_up_tokenization_spaces") and _model_kind(directory) != "BPE":
        return "clean_up_tokenization_spaces is set (decoding would edit the text)"
    if config.get("split_special_tokens"):
        return "split_special_tokens is set"
    if isinstance(config.get("extra_special_tokens"), dict):
        return "model-specific named special tokens (extra_special_tokens as a dict)"
    return None


def _model_kind(directory: Path) -> str | None:
    try:
        return json.loads((directory / TOKENIZER_FILE).read_text())["model"]["type"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_chat_template(directory: Path, config: dict) -> str | dict | None:
    """chat_template.jinja (and additional_chat_templates/*.jinja: named ones), else the config's
    "chat_template" (one template, or a list of {"name", "template"})."""
    templates = {path.stem: path.read_text() for path in sorted((directory / TEMPLATES_DIR).glob("*.jinja"))}
    if (directory / TEMPLATE_FILE).is_file():
        main = (directory / TEMPLATE_FILE).read_text()
        return {"default": main, **templates} if templates else main
    saved = config.get("chat_template")
    if isinstance(saved, list):
        saved = {item["name"]: item["template"] for item in saved}
    if templates:
        return {**(saved if isinstance(saved, dict) else {"default": saved} if saved else {}), **templates}
    return saved


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return value if isinstance(value, dict) else {}


def load_tokenizer(directory: str | Path):
    """The tokenizer saved in `directory`: this module's class where it reads the directory
    exactly as transformers would, else transformers' AutoTokenizer (imported only then)."""
    directory = Path(directory)
    reason = unsupported_reason(directory, read_config(directory))
    if reason is None:
        return Tokenizer.from_pretrained(directory)
    logger.info("tokenizer of %s through transformers' AutoTokenizer: %s", directory, reason)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
