"""The GGUF tokenizer built without torch (`orca_jax.loading.gguf_tokenizer`) against transformers'
own GGUF path (AutoTokenizer with gguf_file, which needs torch: fine in tests): on the real default
model, on small SentencePiece and Llama-3-style vocabularies written here with `gguf.GGUFWriter`,
and in a process where importing torch fails."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import pytest

from orca_jax.loading import gguf_tokenizer
from orca_jax.loading.gguf_tokenizer import build_tokenizer, merges_from_scores, split_merge, tokenizer_from_gguf
from orca_jax.loading.loader import default_model_path

TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "  two leading spaces, and    four inside",
    "tabs\tand\nnewlines\n\n\nend\n",
    "   ",
    "",
    "emoji 😀👍🏽 🇫🇷 and CJK 日本語のテキスト, Korean 한국어",
    "Ünïcödé façade naïve Ωμέγα Привет мир \u00a0nbsp \u200bzwsp",
    "def add(a, b):\n    return a + b  # comment\n\nclass X:\n\tpass\n",
    'json = {"key": [1, 2.5, -3e10], "ok": true}',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|> <|im_start|",  # a special token twice, and one cut short
    "<repo_name>orca<file_sep>main.py",
    "The year 2024 has 365 days; pi = 3.14159, 1,000,000 and 0x1F",
    "12345678901234567890",
    "mixed CASE and 'quotes' don't won't I'm we'll they've",
    "a\r\nwindows line",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Count to 3."}],
]


@pytest.fixture(scope="module")
def default_tokenizers():
    """(ours, transformers') for the embedded default model (SmolLM2, byte-level BPE)."""
    from transformers import AutoTokenizer

    path = default_model_path()
    ours = tokenizer_from_gguf(gguf.GGUFReader(str(path)))
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, reference


def _assert_same_tokenizer(ours, reference, texts):
    for text in texts:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == reference.encode(text, add_special_tokens=add_special), (text, add_special)
        ids = ours.encode(text)
        assert ours.decode(ids) == reference.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True), text
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "add_bos_token", "add_eos_token"):
        assert getattr(ours, name) == getattr(reference, name), name
    assert len(ours) == len(reference)
    assert ours.all_special_ids == reference.all_special_ids


# ---- the default model ------------------------------------------------------------------------
def test_default_model_tokenizer_matches_transformers(default_tokenizers):
    ours, reference = default_tokenizers
    _assert_same_tokenizer(ours, reference, TEXTS)
    assert ours.convert_ids_to_tokens([ours.bos_token_id, ours.eos_token_id]) == ["<|im_start|>", "<|im_end|>"]
    assert not ours.add_bos_token  # SmolLM2's file says so; the chat template writes its own markers
    # Special tokens stay whole: one id each, never split by BPE.
    assert ours.encode("<|im_start|><|im_end|>") == [1, 2]


def test_default_model_chat_template_matches_transformers(default_tokenizers):
    ours, reference = default_tokenizers
    assert ours.chat_template == reference.chat_template and "<|im_start|>" in ours.chat_template
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            ids = ours.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
            ref_ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
            assert list(ids["input_ids"]) == list(ref_ids["input_ids"])
    assert text.endswith("<|im_start|>user\nCount to 3.<|im_end|>\n")


def test_default_model_splits_every_digit_first_as_llama_cpp_does(default_tokenizers):
    """SmolLM2's file names its pre-tokenizer "smollm": llama.cpp (and the model's original
    tokenizer.json) isolate every digit before the GPT-2 split. transformers' GGUF reader uses
    the plain GPT-2 split, which differs only where whitespace runs into a digit: there it cuts
    "\\n\\n" into two tokens where the model was trained on one."""
    ours, reference = default_tokenizers
    for text, before, digits in [("a\n\n1", "a\n\n", "1"), ("x = 3.14\n\n42", "x = 3.14\n\n", "42"),
                                 ("total:  7", "total:  ", "7")]:
        # Every digit is its own piece, so encoding is encoding up to the digits, then each digit.
        expected = ours.encode(before) + [tid for d in digits for tid in ours.encode(d)]
        assert ours.encode(text) == expected, text
    double_newline = ours.convert_tokens_to_ids("ĊĊ")
    assert double_newline in ours.encode("a\n\n1")
    # Away from whitespace-before-digit the two splits agree (TEXTS above has plenty of digits).
    assert reference.encode("a\n\n1") != ours.encode("a\n\n1")


# ---- small vocabularies written here ----------------------------------------------------------
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Iteration-level scheduling lets finished requests leave after every step.",
    "def add(a, b):\n    return a + b\n",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; :",
] * 10
SMALL_TEXTS = ["The quick brown fox", " leading space", "Paris and Berlin 2024", "capital\n\nof  France",
               "unknown ß and 😀 fall back to bytes", "<tool>call</tool> me", "<s>inline bos</s>", ""]


def _write_gguf(path: Path, tokenizer_kv) -> Path:
    """A GGUF with llama metadata and a tokenizer, and no weights (tokenizers read metadata only)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(16)
    writer.add_block_count(1)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    tokenizer_kv(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _trained_pieces(pre_tokenizer, vocab_size: int, alphabet=()) -> list[str]:
    """Vocabulary pieces of a small BPE trained on _CORPUS, in id (= merge) order."""
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, initial_alphabet=list(alphabet))
    tok.train_from_iterator(_CORPUS, trainer)
    vocab = tok.get_vocab()
    return sorted(vocab, key=vocab.get), [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]


def _sentencepiece_gguf(path: Path, add_space_prefix: bool | None = True, add_bos: bool | None = None) -> Path:
    """A llama.cpp-style SentencePiece vocabulary: <unk>, <s>, </s>, 256 byte tokens, pieces
    with "\u2581" for spaces scored by merge rank, and one user-defined token; no merge list."""
    from tokenizers import pre_tokenizers

    pieces, _ = _trained_pieces(pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first"), 300)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<tool>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0]

    def kv(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        if add_bos is not None:
            writer.add_add_bos_token(add_bos)
        if add_space_prefix is not None:
            writer.add_add_space_prefix(add_space_prefix)
        writer.add_chat_template("{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}")

    return _write_gguf(path, kv)


def _byte_level_gguf(path: Path, pre: str | None, model: str = "gpt2") -> Path:
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    pieces, merges = _trained_pieces(pre_tokenizers.ByteLevel(add_prefix_space=False), 400, alphabet)
    tokens = ["<|endoftext|>", "<|user|>"] + pieces

    def kv(writer):
        writer.add_tokenizer_model(model)
        if pre is not None:
            writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([3, 3] + [1] * len(pieces))
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(0)
        writer.add_add_bos_token(True)

    return _write_gguf(path, kv)


def _reference(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("add_space_prefix,add_bos", [(None, None), (True, False), (True, True)])
def test_sentencepiece_vocabulary_matches_transformers(tmp_path, add_space_prefix, add_bos):
    path = _sentencepiece_gguf(tmp_path / "spm.gguf", add_space_prefix, add_bos)
    ours = tokenizer_from_gguf(gguf.GGUFReader(str(path)))
    reference = _reference(path)
    _assert_same_tokenizer(ours, reference, SMALL_TEXTS + TEXTS)
    # llama.cpp's defaults for a SentencePiece file that does not say: BOS added, space prefixed.
    assert ours.add_bos_token == (add_bos is not False)
    ids = ours.encode("ß", add_special_tokens=False)
    assert ours.convert_ids_to_tokens(ids)[-2:] == ["<0xC3>", "<0x9F>"]  # byte fallback
    assert ours.decode(ours.encode("unknown ß 😀", add_special_tokens=False)) == "unknown ß 😀"
    assert ours.convert_ids_to_tokens(ours.encode("<tool>", add_special_tokens=False))[-1] == "<tool>"
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == "<s>[user] hi</s>"


def test_sentencepiece_without_space_prefix_prepends_nothing(tmp_path):
    """`tokenizer.ggml.add_space_prefix = false`: llama.cpp puts no "▁" before the text
    (transformers' GGUF reader ignores the flag, so it is checked here directly)."""
    path = _sentencepiece_gguf(tmp_path / "spm.gguf", add_space_prefix=False)
    ours = tokenizer_from_gguf(gguf.GGUFReader(str(path)))
    with_prefix = tokenizer_from_gguf(gguf.GGUFReader(str(_sentencepiece_gguf(tmp_path / "p.gguf"))))
    tokens = ours.convert_ids_to_tokens(ours.encode("The quick fox", add_special_tokens=False))
    assert tokens[0] == "The" and tokens[1] == "▁quick"
    assert with_prefix.convert_ids_to_tokens(with_prefix.encode("The", add_special_tokens=False))[0] == "▁The"
    for text in SMALL_TEXTS:  # and decoding strips nothing it did not add
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("pre", [None, "default", "gpt2", "llama-bpe"])
def test_byte_level_vocabulary_matches_transformers(tmp_path, pre):
    path = _byte_level_gguf(tmp_path / "bpe.gguf", pre)
    ours = tokenizer_from_gguf(gguf.GGUFReader(str(path)))
    _assert_same_tokenizer(ours, _reference(path), SMALL_TEXTS + TEXTS)
    assert ours.encode("hi")[0] == 0  # add_bos_token from the file


def test_llama3_pre_tokenizer_cuts_digits_in_groups_of_three(tmp_path):
    ours = tokenizer_from_gguf(gguf.GGUFReader(str(_byte_level_gguf(tmp_path / "l3.gguf", "llama-bpe"))))

    def encode(text):
        return ours.encode(text, add_special_tokens=False)

    assert encode("1234567") == encode("123") + encode("456") + encode("7")
    assert encode("x 2024!") == encode("x") + encode(" ") + encode("202") + encode("4") + encode("!")


def test_unsupported_tokenizer_model_is_refused_by_name(tmp_path):
    path = _byte_level_gguf(tmp_path / "t5.gguf", None, model="t5")
    with pytest.raises(ValueError, match="'t5'") as info:
        tokenizer_from_gguf(gguf.GGUFReader(str(path)))
    assert "tokenizer.ggml.model" in str(info.value) and "gpt2" in str(info.value)


def test_unsupported_pre_tokenizer_is_refused_by_name(tmp_path):
    path = _byte_level_gguf(tmp_path / "q.gguf", "deepseek-coder")
    with pytest.raises(ValueError, match="'deepseek-coder'") as info:
        tokenizer_from_gguf(gguf.GGUFReader(str(path)))
    assert "smollm" in str(info.value)


def test_missing_vocabulary_and_bad_special_ids_raise_value_error():
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        build_tokenizer({"tokenizer.ggml.model": "gpt2"})
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": 7}
    with pytest.raises(ValueError, match="eos_token_id = 7"):
        build_tokenizer(meta)


def test_split_merge_cuts_at_the_first_space_after_the_first_character():
    assert split_merge("Ġ t") == ("Ġ", "t")
    assert split_merge("  x") == (" ", "x")  # a left side that is a space itself
    with pytest.raises(ValueError, match="malformed"):
        split_merge("nospace")


def test_merges_from_scores_rank_by_score_then_longer_left():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -0.5]
    # "abc" (best score) can be made two ways: the longer left side ("ab" + "c") goes first.
    assert merges_from_scores(tokens, scores) == [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]


def test_byte_level_spelling_is_gpt2s():
    spelling = gguf_tokenizer.byte_to_char()
    assert len(set(spelling.values())) == 256
    assert spelling[ord(" ")] == "Ġ" and spelling[ord("\n")] == "Ċ" and spelling[ord("A")] == "A"
    from tokenizers import pre_tokenizers

    assert gguf_tokenizer.byte_level_alphabet() == set(pre_tokenizers.ByteLevel.alphabet())


# ---- no torch at runtime -----------------------------------------------------------------------
_BLOCK_TORCH = """
import importlib.abc, importlib.machinery, sys

_import_attempts = []

class _TorchFails(importlib.abc.Loader):
    # Every import of torch ends here and fails; it is recorded too, since code that catches the
    # ImportError would leave nothing in sys.modules.
    def create_module(self, spec):
        _import_attempts.append(spec.name)
        raise ImportError(f"importing {spec.name} is blocked in this test")
    def exec_module(self, module):
        raise ImportError("blocked")

class _BlockTorch(importlib.abc.MetaPathFinder):
    # torch stays findable (transformers sees it installed, the stricter case: code that imports
    # torch only when it is available would try here), but importing it fails.
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return importlib.machinery.ModuleSpec(name, _TorchFails())
        return None

sys.meta_path.insert(0, _BlockTorch())
"""


def test_default_model_loads_without_importing_torch(tmp_path):
    """The runtime path (tokenizer, weights, the model cache written and then read back, an
    engine started from it and one chat generation) in a process where every import of torch
    raises ImportError, installed before anything else; and transformers, which orca_jax's own
    tokenizer replaces on this path (its import is 1-2.5 s of a start), is never imported."""
    script = _BLOCK_TORCH + textwrap.dedent(f"""
        import jax
        from orca_jax.loading import model_cache
        from orca_jax.loading.loader import default_model_path, load_model
        import gguf
        from orca_jax.loading.gguf_tokenizer import tokenizer_from_gguf

        tok = tokenizer_from_gguf(gguf.GGUFReader(str(default_model_path())))
        assert tok.encode("<|im_start|>user") == [1, 4093], tok.encode("<|im_start|>user")
        plain = load_model(None)
        assert plain.tokenizer.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=False)
        first = load_model(None, cache_dir={str(tmp_path)!r})
        model_cache.wait_for_saves()
        assert "cache_save_s" in first.timings, first.timings
        second = load_model(None, cache_dir={str(tmp_path)!r})
        assert type(second.params).__name__ == "CachedCheckpoint", type(second.params)
        params = second.params.restore("float32")
        assert params["params"]["embed"].shape == (49152, 576)
        assert second.tokenizer.encode("<|im_start|>user") == [1, 4093]
        del params, second
        from orca_jax import SamplingParams
        from orca_jax.entrypoints.chat_template import apply_chat_template
        from orca_jax.engine.engine import LLMEngine

        # One bucket (64 tokens: the chat prompt and the decodes), so one program to build.
        engine = LLMEngine(model_cache_dir={str(tmp_path)!r}, warmup=False, max_num_seqs=1,
                           max_num_batched_tokens=64, min_token_bucket=64, max_model_len=256)
        prompt = apply_chat_template(engine.tokenizer, [{{"role": "user", "content": "What is the capital of France?"}}])
        engine.add_request("r", prompt, SamplingParams(max_tokens=3, temperature=0.0))
        text = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
        assert text.startswith("The capital"), text
        assert "transformers" not in sys.modules, sorted(m for m in sys.modules if m.startswith("transformers"))
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
        assert _import_attempts == [], _import_attempts
        print("OK without torch")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "OK without torch" in result.stdout


def test_the_torch_block_catches_an_import():
    """The harness above would see a runtime import of torch (even a caught one)."""
    script = _BLOCK_TORCH + textwrap.dedent("""
        try:
            import torch
        except ImportError:
            pass
        assert "torch" not in sys.modules and _import_attempts == ["torch"], _import_attempts
        print("blocked")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "blocked" in result.stdout
