"""LLM: the offline API (generate in prompt order, token-id prompts, chat template)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from orca_jax import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), max_num_seqs=8, max_num_batched_tokens=32, page_size=8,
               num_pages=64, max_model_len=256, min_token_bucket=32)  # one step program


def greedy(max_tokens=8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def assert_idle(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.num_free_pages == engine.allocator.num_usable


PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of",
    "def add(a, b):",
    "0123456789",
    "Selective batching flattens",
    "Iteration",
]


@pytest.fixture(scope="module")
def solo(llm):
    """Each prompt generated on its own: (prompt token ids, output token ids, text)."""
    results = []
    for prompt in PROMPTS:
        [out] = llm.generate(prompt, greedy(12), use_tqdm=False)
        results.append((out.prompt_token_ids, out.token_ids, out.text))
    return results


def test_get_tokenizer(llm):
    tok = llm.get_tokenizer()
    assert tok is llm.engine.tokenizer
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"


def test_generate_returns_outputs_in_prompt_order(llm, solo):
    # Different lengths so that requests finish out of order: the longest first in the list.
    max_tokens = [12, 10, 8, 6, 3, 1]
    params = [greedy(n) for n in max_tokens]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(outs) == len(PROMPTS)
    for out, prompt, n, (prompt_ids, tokens, _) in zip(outs, PROMPTS, max_tokens, solo):
        assert out.prompt == prompt
        assert out.prompt_token_ids == prompt_ids == llm.get_tokenizer().encode(prompt)
        assert out.finished and out.finish_reason == "length"
        assert out.token_ids == tokens[:n]
    assert_idle(llm)


def test_generate_with_token_id_prompts(llm, solo):
    id_prompts = [ids for ids, _, _ in solo]
    outs = llm.generate(id_prompts[::-1], greedy(12), use_tqdm=False)
    for out, (ids, tokens, text) in zip(outs, solo[::-1]):
        assert out.prompt is None and out.prompt_token_ids == ids
        assert out.token_ids == tokens and out.text == text
    # One prompt given as a flat list of ids is one request, not one per id.
    [single] = llm.generate(id_prompts[0], greedy(12), use_tqdm=False)
    assert single.token_ids == solo[0][1]
    # Mixed strings and id lists keep their order too.
    mixed = llm.generate([PROMPTS[1], id_prompts[2]], greedy(12), use_tqdm=False)
    assert [o.token_ids for o in mixed] == [solo[1][1], solo[2][1]]
    assert_idle(llm)


def test_generate_single_string_and_default_params(llm):
    outs = llm.generate("Hello", use_tqdm=False)
    assert len(outs) == 1 and outs[0].prompt == "Hello"
    assert 1 <= len(outs[0].token_ids) <= SamplingParams().max_tokens
    assert_idle(llm)


def test_params_count_must_match(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS[:3], [greedy(), greedy()], use_tqdm=False)
    assert_idle(llm)


def test_bad_prompt_leaves_the_engine_clean(llm, solo):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([PROMPTS[0], ""], greedy(12), use_tqdm=False)
    assert_idle(llm)
    [out] = llm.generate(PROMPTS[0], greedy(12), use_tqdm=False)
    assert out.token_ids == solo[0][1]


def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    expected_ids = tok.encode("<s>user: What is the capital of France?</s><s>assistant: ", add_special_tokens=False)
    assert llm.apply_chat_template(conversation) == expected_ids
    [out] = llm.chat(conversation, greedy(8), use_tqdm=False)
    assert out.prompt_token_ids == expected_ids
    [plain] = llm.generate([expected_ids], greedy(8), use_tqdm=False)
    assert out.token_ids == plain.token_ids

    second = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    outs = llm.chat([conversation, second], greedy(8), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [
        expected_ids, tok.encode("<s>system: Be brief.</s><s>user: Hi</s><s>assistant: ", add_special_tokens=False)]
    assert outs[0].token_ids == out.token_ids
    no_gen = llm.apply_chat_template(second, add_generation_prompt=False)
    assert tok.decode(no_gen) == tok.decode(tok.encode("<s>system: Be brief.</s><s>user: Hi</s>",
                                                       add_special_tokens=False))
    assert_idle(llm)


def test_n_and_stop_through_generate(llm, solo):
    [out] = llm.generate(PROMPTS[0], greedy(12, n=2), use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [solo[0][1], solo[0][1]]
    text = solo[0][2]
    at = next(j for j in range(1, len(text) - 1) if text[j:j + 2].strip() and text.find(text[j:j + 2]) == j)
    [stopped] = llm.generate(PROMPTS[0], greedy(12, stop=[text[at:at + 2]]), use_tqdm=False)
    assert stopped.text == text[:at] and stopped.finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == text[at:at + 2]
    assert_idle(llm)


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model="/nonexistent")


def test_generate_asks_the_engine_for_final_outputs_only(llm, solo, monkeypatch):
    """generate hands the engine copies of the params with output_kind="final_only" (the
    caller's own are unchanged, one copy per distinct object); the results are the full
    outputs whatever kind the caller chose."""
    seen = []
    real_add = llm.engine.add_request

    def recording_add(request_id, prompt, params=None):
        seen.append(params)
        return real_add(request_id, prompt, params)

    monkeypatch.setattr(llm.engine, "add_request", recording_add)
    shared = greedy(12, logprobs=1)
    outs = llm.generate(PROMPTS[:3], shared, use_tqdm=False)
    assert shared.output_kind == "cumulative"
    assert [p.output_kind for p in seen] == ["final_only"] * 3 and seen[0] is seen[1] is seen[2]
    assert dataclasses.replace(seen[0], output_kind="cumulative") == shared
    for out, (_, tokens, text) in zip(outs, solo):
        assert out.token_ids == tokens and out.text == text and len(out.outputs[0].logprobs) == 12
    seen.clear()
    delta = llm.generate(PROMPTS[:2], [greedy(12, output_kind="delta"), greedy(12)], use_tqdm=False)
    assert [p.output_kind for p in seen] == ["final_only"] * 2
    assert [(o.token_ids, o.text) for o in delta] == [(t, x) for _, t, x in solo[:2]]
    assert_idle(llm)


def test_progress_bar_counts_prompts_and_tokens(llm, capsys):
    llm.generate(PROMPTS, greedy(5), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and f"{len(PROMPTS)}/{len(PROMPTS)}" in err and "tok/s" in err
    assert_idle(llm)


def test_a_repeated_prompt_reports_its_cached_tokens_until_the_cache_is_reset(llm):
    """LLM.generate on a prompt it has seen: the outputs say how much of it came from the prefix
    cache (vLLM's num_cached_tokens), and reset_prefix_cache() forgets it."""
    prompt = list(range(60, 100))  # 40 tokens
    params = SamplingParams(max_tokens=3, temperature=0)
    llm.reset_prefix_cache()
    first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert second.num_cached_tokens % llm.engine.config.page_size == 0 and second.num_cached_tokens < 40
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0


def test_generate_with_structured_outputs_and_chat_with_tools(llm):
    from orca_jax import StructuredOutputsParams

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(max_tokens=30, temperature=0.9, seed=1,
                             structured_outputs=StructuredOutputsParams(choice=["left", "right"]))]
    json_out, choice_out = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert json.loads(json_out.text)["n"] in range(10) and json_out.finish_reason == "stop"
    assert choice_out.text in ("left", "right")

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    conversation = [{"role": "user", "content": "1 + 2?"}]
    with_tools = llm.apply_chat_template(conversation, tools=tools)
    text = llm.get_tokenizer().decode(with_tools)
    assert text.startswith("<s>system: You can call these functions:") and '"name": "add"' in text
    [out] = llm.chat(conversation, greedy(4), use_tqdm=False, tools=tools)
    assert out.prompt_token_ids == with_tools
    assert_idle(llm)


def test_prompt_dicts_with_cache_salts(llm):
    """vLLM's TextPrompt / TokensPrompt dicts, with and without a cache_salt: the same tokens as
    the plain prompt, and cached pages shared only between prompts of the same salt (text and
    token-id forms of one salted prompt included); an unknown key is refused by name."""
    text = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 2
    ids = llm.get_tokenizer().encode(text)
    assert len(ids) > 24, "the prompt must fill pages"
    params = SamplingParams(max_tokens=3, temperature=0)
    llm.reset_prefix_cache()
    [first] = llm.generate({"prompt": text, "cache_salt": "tenant-1"}, params, use_tqdm=False)
    assert first.prompt == text and first.prompt_token_ids == ids and first.num_cached_tokens == 0
    # Another salt and no salt, in one batch: neither takes tenant-1's pages, nor each other's.
    other, plain = llm.generate([{"prompt": text, "cache_salt": "tenant-2"}, text], params, use_tqdm=False)
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    # The same salt, as token ids: its pages are found.
    [again] = llm.generate([{"prompt_token_ids": ids, "cache_salt": "tenant-1"}], params, use_tqdm=False)
    assert again.prompt is None and again.num_cached_tokens == (len(ids) - 1) // 8 * 8
    assert {o.outputs[0].token_ids == first.outputs[0].token_ids for o in (other, plain, again)} == {True}
    with pytest.raises(ValueError, match="unknown prompt key 'salt'"):
        llm.generate([{"prompt": text, "cache_salt": "tenant-1"}, {"prompt": text, "salt": "x"}], params,
                     use_tqdm=False)
    assert_idle(llm)
