"""orca_jax's own tokenizer (`models.tokenizer.Tokenizer`) against transformers'
PreTrainedTokenizerFast over the same Rust tokenizer: the same ids, text, special tokens and
rendered chats, on the default model's vocabulary and on the tiny test tokenizer; its saved
directories read back the same by both; directories it cannot read exactly go to AutoTokenizer.
The chat renderer (`models.jinja_chat`) is checked against transformers' on templates that use
what transformers offers templates (tools, raise_exception, tojson, strftime_now, namespace,
loop controls, generation blocks, extra variables)."""

from __future__ import annotations

import json

import gguf
import pytest

from orca_jax.engine.detokenizer import IncrementalDetokenizer, detokenize_step, rust_decode_is_exact
from orca_jax.loading import gguf_tokenizer
from orca_jax.loading.loader import default_model_path
from orca_jax.loading.tokenizer import Tokenizer, load_tokenizer, unsupported_reason, read_config

TEXTS = [
    "Hello world", "What is the capital of France?", "  two leading spaces, and    four inside",
    "tabs\tand\nnewlines\n\n\nend\n", "", "   ",
    "emoji 😀👍🏽 🇫🇷 and CJK 日本語のテキスト, 한국어",
    "Ünïcödé façade naïve Ωμέγα Привет \u00a0nbsp \u200bzwsp", "def add(a, b):\n    return a + b\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|><|endoftext|> <|im_start|",
    "<s>inline bos</s> and <unk>", "12345678901234567890 pi = 3.14159", "mixed CASE don't won't I'm we'll",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"},
     {"role": "assistant", "content": "Hello!", "tool_calls": None}, {"role": "user", "content": "Count to 3."}],
]
# A template that uses everything transformers gives templates.
RICH_TEMPLATE = (
    "{%- set ns = namespace(count=0) -%}"
    "{%- if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif -%}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif -%}"
    "{%- if m['role'] == 'skip' %}{% continue %}{% endif -%}"
    "{%- set ns.count = ns.count + 1 %}"
    "{{ bos_token }}{{ m['role'] }}: {{ m['content'] | tojson }}"
    "{%- if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endif %}"
    "{{ eos_token }}\n"
    "{%- endfor -%}"
    "{{ ns.count }} messages{% if date_string is defined %} on {{ date_string }}{% endif %}"
    "{%- if add_generation_prompt %}\n{{ bos_token }}assistant: {% endif -%}"
    "{{ strftime_now('%Y') | length }}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & \"here\"",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def default_pair():
    """(ours, transformers') for the default model's GGUF vocabulary, over equal Rust tokenizers."""
    from transformers import PreTrainedTokenizerFast

    meta = gguf_tokenizer.read_tokenizer_metadata(gguf.GGUFReader(str(default_model_path())))
    ours = gguf_tokenizer.build_tokenizer(meta)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    backend = gguf_tokenizer._byte_level_bpe(tokens, types, meta["tokenizer.ggml.merges"], meta["tokenizer.ggml.pre"])
    backend.add_special_tokens(gguf_tokenizer._added_tokens(tokens, types, special=True))
    backend.add_tokens(gguf_tokenizer._added_tokens(tokens, types, special=False))
    special = {name: gguf_tokenizer._special_token(meta, tokens, f"{key}_id") for name, key in
               [("bos_token", "bos_token"), ("eos_token", "eos_token"), ("unk_token", "unknown_token"),
                ("pad_token", "padding_token")]}
    reference = PreTrainedTokenizerFast(tokenizer_object=backend, **special, add_bos_token=False, add_eos_token=False,
                                        chat_template=meta["tokenizer.chat_template"],
                                        clean_up_tokenization_spaces=False)
    return ours, reference


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama_dir):
    """(ours, AutoTokenizer's) for the tiny test tokenizer saved by PreTrainedTokenizerFast."""
    from transformers import AutoTokenizer

    return Tokenizer.from_pretrained(tiny_llama_dir), AutoTokenizer.from_pretrained(tiny_llama_dir)


def assert_same(ours, reference, texts=TEXTS):
    for text in texts:
        for add_special in (True, False):
            assert ours.encode(text, add_special_tokens=add_special) == reference.encode(
                text, add_special_tokens=add_special), (text, add_special)
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), text
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
        assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == reference.convert_ids_to_tokens(
            ids, skip_special_tokens=True)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
                 "pad_token_id", "add_bos_token", "add_eos_token", "vocab_size", "all_special_tokens",
                 "all_special_ids", "special_tokens_map", "chat_template"):
        assert getattr(ours, name) == getattr(reference, name), name
    assert len(ours) == len(reference) and ours.get_vocab() == reference.get_vocab()
    assert ours.convert_tokens_to_ids(["<s>", "not-a-token-at-all"]) == reference.convert_tokens_to_ids(
        ["<s>", "not-a-token-at-all"])
    batch = [ours.encode(t) for t in texts]
    assert ours.batch_decode(batch, skip_special_tokens=True) == reference.batch_decode(batch, skip_special_tokens=True)
    assert ours.decode(batch) == reference.decode(batch)  # a list of sequences decodes to a list


def assert_same_chats(ours, reference, template=None, **kwargs):
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt,
                                            chat_template=template, **kwargs)
            assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt,
                                                         chat_template=template, **kwargs)
            ids = ours.apply_chat_template(messages, add_generation_prompt=prompt, chat_template=template, **kwargs)
            ref = reference.apply_chat_template(messages, add_generation_prompt=prompt, chat_template=template,
                                                **kwargs)
            assert ids["input_ids"] == list(ref["input_ids"])
            assert ours.apply_chat_template(messages, return_dict=False, chat_template=template,
                                            **kwargs) == list(reference.apply_chat_template(
                                                messages, return_dict=False, chat_template=template, **kwargs))


# ---- equal to transformers --------------------------------------------------------------------
def test_default_model_vocabulary_matches_transformers(default_pair):
    ours, reference = default_pair
    assert_same(ours, reference)
    assert ours.encode("<|im_start|><|im_end|>") == [1, 2]  # special tokens stay whole
    assert rust_decode_is_exact(ours)


def test_default_model_chat_template_matches_transformers(default_pair):
    ours, reference = default_pair
    assert "<|im_start|>" in ours.chat_template
    assert_same_chats(ours, reference)
    assert_same_chats(ours, reference, tools=TOOLS)


def test_tiny_tokenizer_matches_transformers(tiny_pair):
    ours, reference = tiny_pair
    assert_same(ours, reference)
    assert_same_chats(ours, reference)


def test_rich_template_renders_as_transformers_does(tiny_pair):
    ours, reference = tiny_pair
    assert_same_chats(ours, reference, template=RICH_TEMPLATE)
    assert_same_chats(ours, reference, template=RICH_TEMPLATE, tools=TOOLS, date_string="26 Jul 2024")
    skipped = [{"role": "skip", "content": "x"}, {"role": "user", "content": "<b>&</b>"}]
    text = ours.apply_chat_template(skipped, tokenize=False, chat_template=RICH_TEMPLATE)
    assert text == reference.apply_chat_template(skipped, tokenize=False, chat_template=RICH_TEMPLATE)
    assert '"<b>&</b>"' in text and text.startswith("<s>user:")  # tojson does not escape HTML
    from jinja2.exceptions import TemplateError

    for tokenizer in (ours, reference):
        with pytest.raises(TemplateError, match="bad role"):
            tokenizer.apply_chat_template([{"role": "bad", "content": ""}], tokenize=False,
                                          chat_template=RICH_TEMPLATE)


def test_the_sandbox_refuses_what_transformers_refuses(tiny_pair):
    from jinja2.exceptions import SecurityError

    ours, _ = tiny_pair
    for template in ("{{ messages.__class__.__mro__ }}", "{% set ns = namespace() %}{% set ns._x = 1 %}",
                     "{{ ''.__class__ }}"):
        try:
            text = ours.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, chat_template=template)
        except SecurityError:
            continue
        assert "class" not in text  # the sandbox renders unsafe attributes as undefined


def test_incremental_detokenization_matches_transformers(tiny_pair, default_pair):
    for ours, reference in (tiny_pair, default_pair):
        for text in TEXTS:
            ids = ours.encode(text, add_special_tokens=False)
            prompt = ours.encode("Prompt: ")
            a, b = IncrementalDetokenizer(ours, prompt), IncrementalDetokenizer(reference, prompt)
            for token in ids:
                assert detokenize_step([a], [token]) == detokenize_step([b], [token])
                assert a.take_delta(False) == b.take_delta(False)
            a.flush(), b.flush()
            assert a.text == b.text == reference.decode(ids, skip_special_tokens=True), text


# ---- files --------------------------------------------------------------------------------------
def test_saved_directory_reads_back_the_same_in_both(default_pair, tmp_path):
    from transformers import AutoTokenizer

    ours, reference = default_pair
    ours.save_pretrained(tmp_path / "ours")
    assert read_config(tmp_path / "ours")["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert_same(Tokenizer.from_pretrained(tmp_path / "ours"), reference)
    assert_same(AutoTokenizer.from_pretrained(tmp_path / "ours"), reference)  # vLLM and HF read it
    reference.save_pretrained(tmp_path / "theirs")  # transformers 5 layout: chat_template.jinja
    back = load_tokenizer(tmp_path / "theirs")
    assert isinstance(back, Tokenizer)
    assert_same(back, reference)
    assert_same_chats(back, reference)


def test_add_bos_token_survives_the_round_trip(tmp_path):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models

    backend = RustTokenizer(models.BPE(vocab={"<s>": 0, "a": 1, "b": 2, "ab": 3}, merges=[("a", "b")]))
    tokenizer = Tokenizer(backend, special_tokens={"bos_token": "<s>"}, add_bos_token=True)
    assert tokenizer.encode("ab") == [0, 3] and tokenizer.encode("ab", add_special_tokens=False) == [3]
    tokenizer.save_pretrained(tmp_path)
    back = Tokenizer.from_pretrained(tmp_path)
    assert back.add_bos_token and back.encode("ab") == [0, 3]


def test_a_files_own_post_processor_is_kept_without_flags(tmp_path):
    """Llama 3's tokenizer.json adds BOS in its own post-processor and its config says nothing
    of add_bos_token: transformers keeps that processor, and so must this class."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, processors
    from transformers import AutoTokenizer

    backend = RustTokenizer(models.BPE(vocab={"<|begin|>": 0, "a": 1, "b": 2, "ab": 3}, merges=[("a", "b")]))
    backend.add_special_tokens(["<|begin|>"])
    backend.post_processor = processors.TemplateProcessing(single="<|begin|> $A", special_tokens=[("<|begin|>", 0)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                 "bos_token": "<|begin|>"}))
    ours, reference = Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert ours.encode("ab") == reference.encode("ab") == [0, 3]


def test_directories_it_cannot_read_exactly_go_to_auto_tokenizer(tiny_llama_dir, tmp_path):
    import shutil

    assert unsupported_reason(tiny_llama_dir, read_config(tiny_llama_dir)) is None
    specific = tmp_path / "specific"
    shutil.copytree(tiny_llama_dir, specific)
    config = read_config(specific)
    (specific / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert "LlamaTokenizer" in unsupported_reason(specific, read_config(specific))
    assert not isinstance(load_tokenizer(specific), Tokenizer)
    no_json = tmp_path / "no-json"
    shutil.copytree(tiny_llama_dir, no_json)
    (no_json / "tokenizer.json").unlink()
    assert "tokenizer.json" in unsupported_reason(no_json, read_config(no_json))
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(no_json)
