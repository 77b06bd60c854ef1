"""Tiny random checkpoints of every model family, with no download and no PyTorch.

An accelerator session has no network, and a TPU VM may have no torch, so the feature check
(benchmarks/feature_check.py) cannot save models with transformers as the tests do. Instead each
family's HF config goes through the family's own parser (`orca_jax.models.config_from_hf`), the
model's declared tree (`abstract_variables`, traced, nothing computed) is filled with random
values, and the result is written as an orca_jax checkpoint (orbax + a byte-level tokenizer)
that `LLMEngine(model=directory)` loads like any other.

Shapes are chosen for the kernels, not for size: head_dim 128 (the TPU kernel needs a multiple of
the 128 lanes, the GPU one a power of two) and 8 KV head slots (K and V of 4 heads, which tile a
TPU's sublanes), so that the accelerator's own attention kernel serves the engine rather than
the reference it falls back to.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

# A byte-level tokenizer (3 specials + 256 bytes) detokenizes every id below 259; the few ids
# above it are padding, as real vocabularies are padded to a multiple of 16.
VOCAB_SIZE = 272
_SHARED = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=1024,
               rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)

# HF config.json of one tiny model per family; what each adds to Llama's block in the comment.
FAMILIES: dict[str, dict] = {
    "llama": dict(_SHARED, model_type="llama"),
    "qwen3": dict(_SHARED, model_type="qwen3"),  # RMSNorm on each query and key head
    # Sliding and full layers alternating, scores and logits soft-capped, (1 + w) norms.
    "gemma2": dict(_SHARED, model_type="gemma2", sliding_window=16, query_pre_attn_scalar=128,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gpt2": dict(vocab_size=VOCAB_SIZE, n_embd=256, n_layer=2, n_head=2, n_positions=1024, model_type="gpt2",
                 bos_token_id=1, eos_token_id=2),  # LayerNorm, learned positions, biases everywhere
    "qwen3_moe": dict(_SHARED, model_type="qwen3_moe", norm_topk_prob=True, **_MOE),  # routed experts
    # Experts with biases and a clamped SwiGLU, attention sinks, sliding and full layers.
    "gpt_oss": dict(_SHARED, model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=128, sliding_window=16),
}

# Random weights of this spread keep activations near unit size through the tiny blocks, so the
# logits spread over a few units and greedy choices are rarely near-ties (at 0.02, as an init
# draws them, every logit sits within a few hundredths of the others).
WEIGHT_STD = 0.1


def model_config(family: str):
    """The ModelConfig the family's parser makes of its tiny HF config."""
    from orca_jax.models import config_from_hf

    return config_from_hf(dict(FAMILIES[family]))


def random_params(config, seed: int = 0) -> dict:
    """The tree the model declares for `config`, filled: norm scales one, every other leaf
    normal(0, WEIGHT_STD), in float32 on the host."""
    import flax.linen as nn
    import jax

    from orca_jax.models import abstract_variables

    shapes = nn.unbox(abstract_variables(config))
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        if getattr(path[-1], "key", None) == "scale":
            return np.ones(leaf.shape, np.float32)
        return (rng.standard_normal(leaf.shape, np.float32) * WEIGHT_STD).astype(np.float32)

    return jax.tree_util.tree_map_with_path(fill, shapes)


def byte_tokenizer():
    """The byte-level tokenizer orca_jax.bench.random_model writes, loaded back."""
    from orca_jax.bench.random_model import write_byte_tokenizer
    from orca_jax.loading.loader import load_tokenizer_from

    with tempfile.TemporaryDirectory() as tmp:
        write_byte_tokenizer(Path(tmp))
        return load_tokenizer_from(tmp)


def write_family_checkpoint(directory: Path, family: str, seed: int = 0) -> Path:
    """A float32 orca_jax checkpoint of the family's tiny random model in `directory`."""
    from orca_jax.loading.checkpoint import save_checkpoint

    config = model_config(family)
    save_checkpoint(directory, random_params(config, seed), byte_tokenizer(), config, "float32",
                    source=f"random tiny {family} (benchmarks/tiny_families.py)", compress=False)
    return Path(directory)
