"""orca_jax: iteration-level scheduling and selective batching (Orca, OSDI 2022) in JAX."""

import os

# orca_jax uses transformers for tokenizers and configs only, never its PyTorch models, so its
# "PyTorch was not found" advice on import is noise to our users (a user's own setting wins).
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.engine.engine import LLMEngine
from orca_jax.entrypoints.llm import LLM
from orca_jax.engine.outputs import CompletionOutput, RequestOutput
from orca_jax.core.sampling_params import SamplingParams
from orca_jax.structured.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "ModelConfig",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
]
__version__ = "0.1.0"
