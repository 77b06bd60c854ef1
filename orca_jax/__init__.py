"""orca_jax: iteration-level scheduling and selective batching (Orca, OSDI 2022) in JAX."""

from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.engine import LLMEngine
from orca_jax.llm import LLM
from orca_jax.outputs import CompletionOutput, RequestOutput
from orca_jax.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "ModelConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
]
__version__ = "0.1.0"
