"""The model families, by HF `model_type`: which Flax module runs a checkpoint and which
function turns its HF tensors into that module's parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import numpy as np

from orca_jax.config import SUPPORTED_MODEL_TYPES, ModelConfig
from orca_jax.models import gpt2, llama


@dataclass(frozen=True)
class Architecture:
    # Called as model_class(config, attention_impl, dtype, mesh=None); applied as
    # (input_ids, kv_cache, AttentionInputs, logits_indices) -> (logits, kv_cache).
    model_class: type[nn.Module]
    # (HF tensors by name, consumed; config) -> {"params": tree of numpy arrays}
    hf_to_params: Callable[[dict[str, np.ndarray], ModelConfig], dict[str, Any]]


_LLAMA = Architecture(llama.LlamaForCausalLM, llama.hf_to_params)
ARCHITECTURES: dict[str, Architecture] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,  # + sliding window
    "qwen2": _LLAMA,  # + Q/K/V biases
    "qwen3": _LLAMA,  # + per-head Q/K RMSNorm
    "gpt2": Architecture(gpt2.GPT2ForCausalLM, gpt2.hf_to_params),
}
assert tuple(ARCHITECTURES) == SUPPORTED_MODEL_TYPES, "config.SUPPORTED_MODEL_TYPES and the registry disagree"


def architecture(model_type: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]
