"""IncrementalDetokenizer with real byte-level BPE tokenizers: split characters and stop strings."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_jax.engine.detokenizer import IncrementalDetokenizer

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


# ---------------------------------------------------------------------------------------------
# A whole step at once (detokenize_step) against one token at a time (add_token)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_tokenizer():
    """The embedded default model's tokenizer, built from its GGUF file as the loader does."""
    import gguf

    from orca_jax.loading.gguf_tokenizer import tokenizer_from_gguf
    from orca_jax.loading.loader import default_model_path

    return tokenizer_from_gguf(gguf.GGUFReader(str(default_model_path())))


def _stream_case(draw_text, tokenizer, rng):
    """(prompt ids, generated ids, stop strings, include_stop) for one random sequence: text
    with multi-byte characters encoded, with random ids (special ones among them) mixed in, and
    stop strings cut from its decoded text, so they can span tokens and split characters."""
    ids = tokenizer.encode(draw_text(), add_special_tokens=False)
    for _ in range(rng.integers(0, 4)):
        ids.insert(int(rng.integers(0, len(ids) + 1)), int(rng.integers(0, len(tokenizer))))
    prompt = tokenizer.encode(draw_text() or "x", add_special_tokens=False)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    stops = []
    for _ in range(rng.integers(0, 3)):
        if len(text) >= 2:
            at = int(rng.integers(0, len(text) - 1))
            stops.append(text[at: at + int(rng.integers(1, 5))])
    stops = [s for s in stops if s]
    return prompt, ids, stops, bool(rng.integers(0, 2))


def _run_lockstep(cases, tokenizers, rng):
    """Feed every case both ways: all live sequences through one detokenize_step per step, and
    each through add_token alone; deltas are taken at random steps (a lagging reader). Returns
    per case (text, stop string, deltas, the step it stopped at) for both ways."""
    from orca_jax.engine.detokenizer import detokenize_step

    def make(i):
        prompt, _, stops, include = cases[i]
        return IncrementalDetokenizer(tokenizers[i], prompt, stops, include)

    batched, solo = [make(i) for i in range(len(cases))], [make(i) for i in range(len(cases))]
    results = {way: [{"stop": None, "at": None, "deltas": []} for _ in cases] for way in ("batched", "solo")}
    live = list(range(len(cases)))
    step = 0
    while live:
        rows = [i for i in live if step < len(cases[i][1])]
        found = detokenize_step([batched[i] for i in rows], [cases[i][1][step] for i in rows])
        for i, stop in zip(rows, found):
            solo_stop = solo[i].add_token(cases[i][1][step])
            for way, found_here in (("batched", stop), ("solo", solo_stop)):
                if found_here is not None:
                    results[way][i].update(stop=found_here, at=step)
        for i in list(live):
            ended = step + 1 >= len(cases[i][1]) or results["batched"][i]["stop"] is not None \
                or results["solo"][i]["stop"] is not None
            take = ended or rng.integers(0, 3) == 0
            for way, detok in (("batched", batched[i]), ("solo", solo[i])):
                if ended and results[way][i]["stop"] is None:
                    detok.flush()
                if take:
                    results[way][i]["deltas"].append(detok.take_delta(ended))
            if ended:
                live.remove(i)
        step += 1
    for way, detoks in (("batched", batched), ("solo", solo)):
        for r, d in zip(results[way], detoks):
            r["text"] = d.text
    return results


def _first_stop_oracle(tokenizer, prompt, ids, stops, include):
    """(stop string, step, final text) by brute force: the text without stop strings after each
    step; at the first step where it contains a stop string, cut at the earliest one."""
    plain = IncrementalDetokenizer(tokenizer, prompt)
    for step, token in enumerate(ids):
        plain.add_token(token)
        text = plain.text
        found = [(at, stop) for stop in stops if (at := text.find(stop)) >= 0]
        if found:
            at, stop = min(found, key=lambda f: f[0])
            return stop, step, text[: at + len(stop)] if include else text[:at]
    plain.flush()
    return None, None, plain.text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), num_seqs=st.integers(1, 12), mixed=st.booleans())
def test_batched_step_equals_one_token_at_a_time(seed, num_seqs, mixed, tiny_tokenizer, multilingual_tokenizer):
    import numpy as np

    rng = np.random.default_rng(seed)
    alphabet = list("ab xyz.,!") + ["é", "ß", "中", "文", "世", "界", "你", "好", "😀", "🎉", "👍", "🏽", "한"]

    def draw_text():
        return "".join(rng.choice(alphabet, size=int(rng.integers(0, 25))))

    choices = (tiny_tokenizer, multilingual_tokenizer)
    tokenizers = [choices[int(rng.integers(0, 2))] if mixed else tiny_tokenizer for _ in range(num_seqs)]
    cases = [_stream_case(draw_text, tok, rng) for tok in tokenizers]
    results = _run_lockstep(cases, tokenizers, rng)
    assert results["batched"] == results["solo"]
    for case, r, tok in zip(cases, results["batched"], tokenizers):
        assert (r["stop"], r["at"], r["text"]) == _first_stop_oracle(tok, *case), case
    for (_, ids, stops, include), r, tok in zip(cases, results["batched"], tokenizers):
        assert "".join(r["deltas"]) == r["text"]
        if r["stop"] is None:  # ran to the end: the whole decode, with no stop string in it
            assert r["text"] == tok.decode(ids, skip_special_tokens=True)
            # (Unless the end was an incomplete character: the flush at finish, which releases it
            # and the text waiting with it, does not look for stop strings.)
            assert REPLACEMENT in r["text"] or not any(s in r["text"] for s in stops)
        else:
            assert r["text"].endswith(r["stop"]) == include or r["stop"] == ""


def test_batched_step_on_the_default_model_tokenizer(gguf_tokenizer):
    """The GGUF tokenizer of the default model (byte-level BPE with special tokens): chat text,
    emoji and CJK through one detokenize_step per step equal add_token alone."""
    import numpy as np

    tok = gguf_tokenizer
    rng = np.random.default_rng(0)
    texts = ["<|im_start|>assistant\nThe capital of France is Paris. 😀 你好世界<|im_end|>",
             "def add(a, b):\n    return a + b  # naïve café 🎉🎉", "한국어 텍스트 Straße 👍🏽 done."]

    def draw_text():
        text = texts[int(rng.integers(0, len(texts)))]
        return text[int(rng.integers(0, len(text) // 2)):]

    cases = [_stream_case(draw_text, tok, rng) for _ in range(40)]
    results = _run_lockstep(cases, [tok] * len(cases), rng)
    assert results["batched"] == results["solo"]
    for case, r in zip(cases, results["batched"]):
        assert (r["stop"], r["at"], r["text"]) == _first_stop_oracle(tok, *case)
    assert any(r["stop"] is not None for r in results["batched"]), "some stop strings must be hit"
    assert any(REPLACEMENT in tok.decode([i]) for _, ids, _, _ in cases for i in ids), "split characters"


# ---------------------------------------------------------------------------------------------
# The Rust fast path: only where it is exactly tokenizer.decode
# ---------------------------------------------------------------------------------------------
def test_rust_decode_batch_equals_transformers_decode(tiny_tokenizer, multilingual_tokenizer, gguf_tokenizer):
    import numpy as np

    from orca_jax.engine.detokenizer import rust_decode_is_exact

    rng = np.random.default_rng(1)
    for tok in (tiny_tokenizer, multilingual_tokenizer, gguf_tokenizer):
        assert rust_decode_is_exact(tok)
        special = sorted(tok.all_special_ids)
        id_lists = [rng.integers(0, len(tok), size=int(rng.integers(0, 9))).tolist() for _ in range(300)]
        id_lists += [[special[0], *ids, special[-1]] for ids in id_lists[:50]]
        expected = [tok.decode(ids, skip_special_tokens=True) for ids in id_lists]
        assert tok.backend_tokenizer.decode_batch(id_lists, skip_special_tokens=True) == expected
        assert any(REPLACEMENT in t for t in expected) and any(t == "" for t in expected)


def _word_piece_tokenizer(clean_up: bool):
    """A WordPiece tokenizer: there transformers' clean-up really changes the text (" ." -> ".")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[SEP]": 1, "hello": 2, "world": 3, ".": 4, "!": 5, "##s": 6, "it": 7, "'": 8}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=clean_up)


def test_clean_up_and_custom_decoders_fall_back_to_tokenizer_decode(tiny_tokenizer):
    from transformers import PreTrainedTokenizerFast

    from orca_jax.engine.detokenizer import detokenize_step, rust_decode_is_exact

    class ShoutingTokenizer(PreTrainedTokenizerFast):  # a subclass with its own decoding
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = ShoutingTokenizer(tokenizer_object=tiny_tokenizer.backend_tokenizer, eos_token="</s>")
    cleaning = _word_piece_tokenizer(clean_up=True)
    assert rust_decode_is_exact(_word_piece_tokenizer(clean_up=False))
    assert not rust_decode_is_exact(cleaning) and not rust_decode_is_exact(shouting)
    ids = [2, 6, 4, 3, 5, 7, 8, 6, 1, 4]  # "hellos . world ! it ' s [SEP] ." before clean-up
    assert cleaning.backend_tokenizer.decode(ids, skip_special_tokens=True) != cleaning.decode(
        ids, skip_special_tokens=True)
    cases = [(cleaning, ids), (shouting, tiny_tokenizer.encode("The quick brown fox", add_special_tokens=False))]
    for tok, token_ids in cases:
        batched = [IncrementalDetokenizer(tok, [2]), IncrementalDetokenizer(tiny_tokenizer, [2])]
        solo = IncrementalDetokenizer(tok, [2])
        for token in token_ids:
            detokenize_step(batched, [token, token])
            solo.add_token(token)
        assert batched[0].text == solo.text
        if tok is cleaning:  # cleaned up (the Rust decode alone would give " hellos . world ! ...")
            assert batched[0].text.startswith(" hellos. world!"), batched[0].text
    assert batched[0].text == "THE QUICK BROWN FOX"


def test_detokenize_step_checks_its_arguments(tiny_tokenizer):
    from orca_jax.engine.detokenizer import detokenize_step

    assert detokenize_step([], []) == []
    with pytest.raises(ValueError, match="2 detokenizers for 1 tokens"):
        detokenize_step([IncrementalDetokenizer(tiny_tokenizer, []), IncrementalDetokenizer(tiny_tokenizer, [])], [5])


def test_text_pieces_are_joined_once_and_truncated_at_the_end(tiny_tokenizer):
    """`text` reads the same however often it is read, and a stop string found after a read
    (when the pieces were joined into one) still cuts at the right character."""
    tok = tiny_tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    reading, unread = IncrementalDetokenizer(tok, [], ["lazy"]), IncrementalDetokenizer(tok, [], ["lazy"])
    for token in ids:
        found = reading.add_token(token)
        assert unread.add_token(token) == found
        assert reading.text == reading.text  # the second read is the cached join
        if found:
            break
    assert found == "lazy" and reading.text == unread.text == "The quick brown fox jumps over the "
    assert reading.take_delta(True) == unread.take_delta(True) == reading.text
