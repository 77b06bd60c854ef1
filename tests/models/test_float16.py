"""dtype="float16" end to end (what `dtype="auto"` runs on GPUs below sm_80: T4, V100; and
`--dtype half`): weights, activations and the KV cache in float16 through the engine, against
Hugging Face transformers in float16 on the CPU (PyTorch runs float16 there), with the logits
compared row by row as in test_model_families.py (chunked prefill, mixed steps, a late arrival).

Tolerance, from transformers' own float16: the float32 engine (within 1e-4 of HF float32,
test_model_families.py) against HF float16 measures HF's float16 rounding error, 5-8e-3 at
these models' logits (|logit| < 4, where a float16 ulp is 2e-3). The float16 engine must be
within 1.5x of that error of HF float16, and within 1e-2 absolute: no worse than HF's float16
is off its own float32. (It is usually closer than 1x: the engine keeps softmax and norms in
float32; HF's eager attention runs its softmax in float16's inputs upcast.)
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

FLOAT16_ATOL = 1e-2
ENGINE = dict(warmup=False, page_size=8, max_num_batched_tokens=16, min_token_bucket=16, max_num_seqs=4,
              num_pages=64, max_model_len=128)
# A dense model and a mixture of experts (the grouped expert matmuls in float16).
FAMILIES = {
    "llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, initializer_range=0.1)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                         intermediate_size=128, moe_intermediate_size=32, norm_topk_prob=True,
                                         initializer_range=0.1)),
}

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _hf(directory, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_float16_engine_matches_transformers_in_float16(name, tiny_hf_model_factory, make_logits_engine,
                                                        engine_parity):
    config_class, settings = FAMILIES[name]
    directory = tiny_hf_model_factory(config_class, seed=2, **settings)
    hf_half = _hf(directory, torch.float16)
    engine = make_logits_engine(model=str(directory), dtype="half", kv_cache_dtype="float16", **ENGINE)
    assert engine.config.dtype == "float16" and engine.runner.kv_dtype == np.dtype("float16")
    matrices = [leaf for leaf in jax.tree.leaves(engine.runner.params) if leaf.ndim >= 2]
    assert matrices and all(leaf.dtype == np.float16 for leaf in matrices), "every weight matrix in float16"
    half = engine_parity(engine, hf_half, np.random.default_rng(3))["max_diff"]

    full_engine = make_logits_engine(model=str(directory), dtype="float32", **ENGINE)
    hf_own_error = engine_parity(full_engine, hf_half, np.random.default_rng(3))["max_diff"]
    print(f"{name}: float16 engine vs HF float16 {half:.2e}; HF float16's own error {hf_own_error:.2e}")
    assert half <= FLOAT16_ATOL and half <= 1.5 * hf_own_error
