"""prompt_logprobs through the engine, against HF transformers' own logits of the prompt (the
tiny random Llama, float32): correct across chunked prefill (a prompt three times the step's
token budget), for a prompt already in the prefix cache, beside rows that do not ask, and with
no compile after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

from orca_jax import SamplingParams
from orca_jax.errors import RequestError
from orca_jax.worker.compile_guard import no_compiles

pytestmark = pytest.mark.usefixtures("torch_single_thread")
PROMPT = ("The quick brown fox jumps over the lazy dog while Paris is the capital of France and once upon a "
          "time a dog said hello to a fox in the quick brown forest by the lazy river")


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(enable_prefix_caching=True)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir):
    """(prompt ids, f64 log-probabilities [P, V]) from transformers."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    ids = AutoTokenizer.from_pretrained(tiny_llama_dir).encode(PROMPT)
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return ids, torch.log_softmax(logits, -1).numpy()


@pytest.fixture
def run(run_engine):
    """run_to_completion, then no KV page left in use."""
    def go(engine, requests):
        final = run_engine(engine, requests)
        assert engine.allocator.num_used == 0
        return final
    return go


def check_against_hf(prompt_logprobs, ids, reference, k):
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for position in range(1, len(ids)):
        entry, expected = prompt_logprobs[position], reference[position - 1]
        assert entry[ids[position]] == pytest.approx(expected[ids[position]], abs=1e-4), position
        # The entry holds the top k and the prompt's own token: its k largest are HF's top k.
        top = sorted(entry, key=lambda t: -entry[t])[:k]
        assert top == np.argsort(-expected, kind="stable")[:k].tolist(), position


def test_prompt_logprobs_match_transformers_across_chunks_and_the_prefix_cache(engine, run, hf_logprobs):
    ids, reference = hf_logprobs
    assert len(ids) > 2 * engine.config.max_num_batched_tokens  # the prompt takes several steps
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    free = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with no_compiles():
        first = run(engine, [("first", ids, params), ("free", "Once upon a time", free)])
        # The same prompt again: its pages are cached now, yet every value is computed.
        second = run(engine, [("second", ids, params)])
    check_against_hf(first["first"].prompt_logprobs, ids, reference, 2)
    assert second["second"].prompt_logprobs == first["first"].prompt_logprobs
    assert first["free"].prompt_logprobs is None
    alone = run(engine, [("alone", "Once upon a time", free)])
    assert alone["alone"].outputs[0].token_ids == first["free"].outputs[0].token_ids


def test_zero_gives_only_the_prompt_tokens_own(engine, run, hf_logprobs):
    ids, reference = hf_logprobs
    out = run(engine, [("zero", ids[:20], SamplingParams(max_tokens=1, prompt_logprobs=0))])["zero"]
    assert all(list(entry) == [ids[p]] for p, entry in enumerate(out.prompt_logprobs) if entry is not None)


def test_more_than_max_logprobs_is_refused(engine):
    with pytest.raises(RequestError) as info:
        engine.add_request("many", "hello", SamplingParams(prompt_logprobs=engine.config.max_logprobs + 1))
    assert info.value.param == "prompt_logprobs" and not engine.requests
