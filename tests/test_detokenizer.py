"""IncrementalDetokenizer with real byte-level BPE tokenizers: split characters and stop strings."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_jax.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
MULTILINGUAL_CORPUS = [
    "你好世界，今天天气很好。我们去公园散步吧！",
    "😀😃😄😁😆 emoji 🎉🎉 party 👍🏽👍🏽 🚀 launch",
    "日本語のテキストです。東京と大阪。",
    "naïve café résumé — déjà vu, Ångström, Straße",
    "한국어 텍스트 예제입니다",
    "mixed 中文 and English 😀 text",
] * 20


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def multilingual_tokenizer():
    """A GPT-2-style byte-level BPE trained on CJK and emoji text with a small vocabulary, so its
    merges cut multi-byte characters: tokens like '😀' + the first byte of the next emoji."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(MULTILINGUAL_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def stream(tokenizer, prompt_ids, ids, stop=(), include_stop=False):
    """Feed `ids` one by one as the engine does; returns (deltas, stop string or None, detok)."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt_ids), list(stop), include_stop)
    deltas, found = [], None
    for token in ids:
        found = detok.add_token(token)
        if found is not None:
            break
        deltas.append(detok.take_delta(False))
    if found is None:
        detok.flush()
    deltas.append(detok.take_delta(True))
    return deltas, found, detok


def splits_characters(tokenizer, ids) -> bool:
    return any(REPLACEMENT in tokenizer.decode([i]) for i in ids)


# ---------------------------------------------------------------------------------------------
# Multi-byte characters
# ---------------------------------------------------------------------------------------------
CASES = [
    "😀😃😄 emoji 👍🏽",
    "你好世界，今天天气很好。",
    "naïve café 中文 and 😀😀 end",
    "🎉🎉🎉🚀",
    "Ångström Straße déjà",
    "한국어",
]


@pytest.mark.parametrize("text", CASES)
@pytest.mark.parametrize("which", ["tiny", "multilingual"])
def test_split_characters_are_never_emitted_half_done(which, text, tiny_tokenizer, multilingual_tokenizer):
    tokenizer = tiny_tokenizer if which == "tiny" else multilingual_tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert splits_characters(tokenizer, ids), "the case must contain tokens that cut a character"
    prompt = tokenizer.encode("Prompt: ", add_special_tokens=False)
    deltas, found, detok = stream(tokenizer, prompt, ids)
    assert found is None
    assert not any(REPLACEMENT in d for d in deltas), deltas
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text


def test_multilingual_tokens_straddle_characters(multilingual_tokenizer):
    """The GPT-2-style case proper: one token holds a whole character plus part of the next
    ('na' + the first byte of 'ï'), the next token the rest of it plus more."""
    tok = multilingual_tokenizer
    text = "naïve café résumé Straße 😀😃😄😁😆"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert any(p[0] != REPLACEMENT and p.endswith(REPLACEMENT) for p in pieces), pieces
    assert any(p[0] == REPLACEMENT and p[-1] != REPLACEMENT for p in pieces), pieces
    deltas, _, _ = stream(tok, [], ids)
    assert "".join(deltas) == text and all(REPLACEMENT not in d for d in deltas)


TEXT_ALPHABET = st.sampled_from(list("ab xyz.,!") + ["é", "ß", "中", "文", "世", "界", "你", "好", "😀", "🎉", "👍", "🏽", "한"])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(TEXT_ALPHABET, min_size=1, max_size=12).map("".join),
    text=st.lists(TEXT_ALPHABET, min_size=0, max_size=30).map("".join),
    which=st.sampled_from(["tiny", "multilingual"]),
    special_at=st.lists(st.integers(0, 40), max_size=3),
)
def test_deltas_concatenate_to_the_full_decode(prompt, text, which, special_at, tiny_tokenizer,
                                               multilingual_tokenizer):
    tokenizer = tiny_tokenizer if which == "tiny" else multilingual_tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    for at in sorted(special_at, reverse=True):  # EOS/BOS-like tokens are skipped in the text
        ids.insert(min(at, len(ids)), tokenizer.eos_token_id)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    deltas, found, _ = stream(tokenizer, prompt_ids, ids)
    assert found is None
    assert not any(REPLACEMENT in d for d in deltas), deltas
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_first_token_keeps_its_leading_space(tiny_tokenizer):
    tok = tiny_tokenizer
    prompt = tok.encode("The quick", add_special_tokens=False)
    ids = tok.encode(" brown fox", add_special_tokens=False)
    deltas, _, _ = stream(tok, prompt, ids)
    assert deltas[0].startswith(" ") and "".join(deltas) == " brown fox"


# ---------------------------------------------------------------------------------------------
# Stop strings
# ---------------------------------------------------------------------------------------------
def test_stop_string_spanning_two_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode("The quick brown fox jumps", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[:3] == ["The", " quick", " brown"], pieces
    stop = "ck br"  # the end of ' quick' and the start of ' brown'
    deltas, found, detok = stream(tok, tok.encode("Say:", add_special_tokens=False), ids, stop=[stop])
    assert found == stop
    assert detok.text == "The qui"
    assert "".join(deltas) == "The qui"
    # Before the stop was decided, nothing past the final text went out.
    emitted = ""
    for d in deltas[:-1]:
        emitted += d
        assert "The qui".startswith(emitted), emitted
    # After ' quick' the last len(stop) - 1 characters were held back.
    assert deltas[:2] == ["", "The q"], deltas


def test_stop_string_included_in_output(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode("The quick brown fox jumps", add_special_tokens=False)
    deltas, found, detok = stream(tok, [], ids, stop=["ck br"], include_stop=True)
    assert found == "ck br"
    assert detok.text == "".join(deltas) == "The quick br"


def test_partial_stop_match_is_released_when_it_diverges(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode("The quick brown fox", add_special_tokens=False)
    deltas, found, detok = stream(tok, [], ids, stop=["quick red"])
    assert found is None
    # While running, the last len('quick red') - 1 = 8 characters are held back; once the text
    # has moved past a possible match it is released, and the end comes out at finish.
    assert deltas == ["", "T", "he qui", "ck b", "rown fox"], deltas
    assert "".join(deltas) == detok.text == "The quick brown fox"


def test_held_back_text_while_running(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode("The quick brown fox", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], ["xyz12"])
    out = ""
    for token in ids:
        assert detok.add_token(token) is None
        out += detok.take_delta(False)
        assert out == detok.text[: max(0, len(detok.text) - 4)], (out, detok.text)
    assert out + detok.take_delta(True) == "The quick brown fox"


def test_stop_string_inside_a_split_character(multilingual_tokenizer, tiny_tokenizer):
    """A stop string that is one multi-byte character, cut across byte tokens, is found only once
    the character is complete, and the text before it is exact."""
    for tok in (tiny_tokenizer, multilingual_tokenizer):
        ids = tok.encode("ab 世界 cd", add_special_tokens=False)
        assert splits_characters(tok, ids) or tok is multilingual_tokenizer
        deltas, found, detok = stream(tok, [], ids, stop=["界"])
        assert found == "界"
        assert detok.text == "".join(deltas) == "ab 世"
        assert not any(REPLACEMENT in d for d in deltas)


def test_earliest_stop_string_wins_when_one_token_completes_two(tiny_tokenizer):
    """' quick' completes both 'ck' and 'qu' at once: the text must end before the earlier
    match ('qu'), whatever the order of the stop list; the output never contains a stop string."""
    tok = tiny_tokenizer
    ids = tok.encode("The quick brown fox", add_special_tokens=False)
    assert tok.decode([ids[1]]) == " quick"
    for stop in (["qu", "ck"], ["ck", "qu"]):
        deltas, found, detok = stream(tok, [], ids, stop=stop)
        assert found == "qu", (stop, found)
        assert detok.text == "".join(deltas) == "The ", (stop, detok.text)
