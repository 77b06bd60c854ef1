"""Scoring a text through the server, as lm-evaluation-harness does it (its loglikelihood
requests: /v1/completions with the text as the prompt, max_tokens 1, logprobs 1, echo true),
on the real default model in float32 through the official `openai` client: the prompt tokens'
log-probabilities add up to what transformers' logits give for the same tokens."""

from __future__ import annotations

import openai
import pytest
import torch

from orca_jax.engine.engine import LLMEngine
from orca_jax.entrypoints.server import ServerSettings, build_app
from orca_jax.loading.loader import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]
MODEL = "smollm2"
# A context and its continuation, as lm-evaluation-harness joins them; longer than one step's
# token budget, so the prompt is prefilled in chunks.
TEXTS = ["Question: What is the capital of France?\nAnswer: The capital of France is Paris, a city on the Seine "
         "known for the Eiffel Tower, the Louvre and its cafes, and home to about two million people. Its "
         "river islands, its wide boulevards and its many museums draw visitors from every part of the world.",
         "def add(a, b):\n    return a + b"]


@pytest.fixture(scope="module")
def served(serve_in_thread, server_idle_waiter, default_model_engine_settings):
    engine = LLMEngine(**default_model_engine_settings)
    assert engine.config.dtype == "float32"
    async_engine, app = build_app(engine, ServerSettings(MODEL))
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        yield client, engine
        server_idle_waiter(async_engine)()


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_token_logprobs(hf_model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]


@pytest.mark.parametrize("text", TEXTS)
def test_loglikelihood_request_sums_to_transformers(served, hf_model, text):
    client, engine = served
    ids = engine.tokenizer.encode(text)
    assert len(ids) > engine.config.max_num_batched_tokens or text is TEXTS[1]
    out = client.completions.create(model=MODEL, prompt=text, max_tokens=1, logprobs=1, echo=True, temperature=0)
    logprobs = out.choices[0].logprobs
    prompt_lps = logprobs.token_logprobs[:len(ids)]
    assert prompt_lps[0] is None  # nothing precedes the first token, as OpenAI reports it
    expected = hf_token_logprobs(hf_model, ids)
    assert sum(prompt_lps[1:]) == pytest.approx(sum(expected), abs=1e-3)
    assert max(abs(a - b) for a, b in zip(prompt_lps[1:], expected)) < 1e-3
    # lm-evaluation-harness's is_greedy: the top-1 of each position is the text's own token.
    assert all(len(top) == 1 for top in logprobs.top_logprobs[1:len(ids)])
    assert "".join(logprobs.tokens[:len(ids)]) == text
