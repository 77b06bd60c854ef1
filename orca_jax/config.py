"""Engine and model configuration.

`ModelConfig` describes a checkpoint's architecture (read from HF `config.json` or GGUF
metadata). `EngineConfig` holds the serving knobs, with vLLM's names, and derives the shape
buckets that bound how many programs XLA compiles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from orca_jax.cache_dirs import default_compilation_cache_dir, default_model_cache_dir

SCHEDULING_POLICIES = ("iteration", "request")
ATTENTION_IMPLS = ("auto", "reference", "pallas_gpu", "pallas_tpu")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only checkpoint. `model_type` picks the model family (see
    `orca_jax.models.ARCHITECTURES`); the other fields are the knobs the families share."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Epsilon of every norm in the model: RMSNorm for the Llama family, LayerNorm for GPT-2
    # (named after the Llama field, which came first).
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # llama3-style frequency scaling: dict with factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings. None means plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    # Per-frequency divisors stored in llama.cpp files (GGUF `rope_freqs.weight`, written for
    # llama3-scaled models instead of the scaling parameters).
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Biases of the attention projections, apart because families differ: Llama's
    # `attention_bias` sets both, Qwen2 has them on Q, K, V only, GPT-2 everywhere.
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each query and key head, before RoPE
    hidden_act: str = "silu"  # the MLP's activation, by its transformers name
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )

    @property
    def attention_bias(self) -> bool:
        """HF's `attention_bias` (Llama, Qwen3): biases on all four attention projections."""
        return self.qkv_bias and self.o_bias

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a transformers `config.json` dict. The family comes from `model_type`,
        else from `architectures`, else Llama."""
        model_type = _model_type_from_hf(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        fields = _gpt2_fields(cfg) if model_type == "gpt2" else _llama_family_fields(cfg, model_type)
        return cls(**fields, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, model_type=model_type)


# Families whose model is in `orca_jax.models` (the registry there must list the same ones).
# Mistral, Qwen2 and Qwen3 are the Llama block with a few switches; GPT-2 is its own family.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
# transformers `architectures` names, for configs that lack `model_type`.
_ARCHITECTURE_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GPT2LMHeadModel": "gpt2",
}
# GPT-2's `gelu_new` and `gelu_pytorch_tanh` are the same tanh approximation.
SUPPORTED_ACTIVATIONS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu")


def _model_type_from_hf(cfg: dict[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type is None:
        known = [_ARCHITECTURE_MODEL_TYPES[a] for a in cfg.get("architectures") or [] if a in _ARCHITECTURE_MODEL_TYPES]
        model_type = known[0] if known else "llama"
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return model_type


def _llama_family_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Llama, Mistral, Qwen2, Qwen3: the same block, configured."""
    num_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    rope_theta, rope_scaling = _rope_from_hf(cfg)
    attention_bias = cfg.get("attention_bias", False)
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or hidden // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        # Qwen2 always has Q, K, V biases and never an output bias (its config has no switch).
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=cfg.get("mlp_bias", False),
        qk_norm=model_type == "qwen3",
        hidden_act=cfg.get("hidden_act", "silu"),
        sliding_window=_sliding_window_from_hf(cfg),
    )


def _sliding_window_from_hf(cfg: dict[str, Any]) -> int | None:
    """The window every layer uses, or None. Qwen2/3 window only when `use_sliding_window` is
    true, and then only layers from `max_window_layers` on (spelled out in `layer_types`);
    Mistral windows every layer whenever `sliding_window` is set."""
    window = cfg.get("sliding_window")
    if window is None or not cfg.get("use_sliding_window", True):
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is None and "max_window_layers" in cfg:
        layer_types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention"
                       for i in range(cfg["num_hidden_layers"])]
    kinds = set(layer_types or ["sliding_attention"])
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return window
    # The layers run as one scan with one static window; a mix would need a window per layer.
    raise ValueError(f"sliding window on some layers only (layer_types {sorted(kinds)}) is not supported")


def _gpt2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-2: learned positions, LayerNorm, GELU MLP, multi-head attention with biases."""
    if cfg.get("scale_attn_by_inverse_layer_idx") or not cfg.get("scale_attn_weights", True):
        raise ValueError("GPT-2 attention scaled other than by 1/sqrt(head_dim) is not supported")
    hidden, num_heads = cfg["n_embd"], cfg["n_head"]
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg.get("n_inner") or 4 * hidden,
        num_layers=cfg["n_layer"],
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        max_position_embeddings=cfg.get("n_positions", 1024),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        hidden_act=cfg.get("activation_function", "gelu_new"),
    )


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, tuple | None]:
    """Read RoPE settings from either the old (`rope_theta` + `rope_scaling`) or the new
    (`rope_parameters`) transformers layout."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: default, llama3")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), tuple((k, scaling[k]) for k in keys)


def kv_pool_tokens(num_pages: int, page_size: int) -> int:
    """Tokens a pool of `num_pages` holds for sequences: page 0 is the padding sink."""
    return (num_pages - 1) * page_size


def _powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    """start, 2*start, ... and finally `limit` itself, so the largest bucket is exact."""
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    sizes.append(limit)
    return tuple(sizes)


@dataclass(frozen=True)
class EngineConfig:
    """Serving settings. Names follow vLLM where vLLM has the knob."""

    model: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    # "auto": the model dtype, except float32 on CPU, where XLA has no bfloat16 scatter/gather
    # and would convert the whole cache around every KV write and read.
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    # None: the model's context length, lowered to what the KV pool holds if one sequence of
    # that length would not fit (see `fit_kv_pool`).
    max_model_len: int | None = None
    page_size: int = 16
    num_pages: int | None = None  # None: sized from the memory budget below
    kv_cache_memory_bytes: int = 1 << 30  # budget on CPU, where free memory is not reported
    gpu_memory_utilization: float = 0.9  # fraction of free accelerator memory for the cache
    attention_impl: str = "auto"
    tensor_parallel_size: int = 1
    scheduling: Literal["iteration", "request"] = "iteration"
    max_logprobs: int = 20
    min_token_bucket: int = 8
    seed: int = 0
    # JAX's persistent compilation cache: a second start loads the step programs instead of
    # compiling them. None turns it off. (orca_jax.cache_dirs says where the default lives.)
    compilation_cache_dir: str | None = field(default_factory=default_compilation_cache_dir)
    # Converted GGUF weights and tokenizer, so a second start skips parsing and dequantizing
    # the file. None turns it off.
    model_cache_dir: str | None = field(default_factory=default_model_cache_dir)
    # Filled in from the model once it is loaded (see `resolve`).
    token_buckets: tuple[int, ...] = field(default=(), compare=False)
    # True when `resolve` took max_model_len from the model, so the KV pool may lower it.
    max_model_len_from_model: bool = field(default=False, compare=False)

    def __post_init__(self):
        errors = []
        if self.dtype not in DTYPES:
            errors.append(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", *DTYPES):
            errors.append(f"kv_cache_dtype must be 'auto' or one of {DTYPES}, got {self.kv_cache_dtype!r}")
        if self.scheduling not in SCHEDULING_POLICIES:
            errors.append(f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            errors.append(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "tensor_parallel_size",
                     "min_token_bucket"):
            if getattr(self, name) < 1:
                errors.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages is not None and self.num_pages < 2:
            errors.append(f"num_pages must be >= 2 (page 0 is the padding sink), got {self.num_pages}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            errors.append(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so that every running sequence gets its decode token"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            errors.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if errors:
            raise ValueError("invalid engine config: " + "; ".join(errors))

    def resolve(self, model_config: ModelConfig) -> "EngineConfig":
        """Fix the settings that depend on the model: context length and shape buckets."""
        max_len = self.max_model_len or model_config.max_position_embeddings
        if max_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's context "
                f"({model_config.max_position_embeddings})"
            )
        buckets = _powers_of_two_up_to(
            self.max_num_batched_tokens, min(self.min_token_bucket, self.max_num_batched_tokens)
        )
        from_model = self.max_model_len is None or self.max_model_len_from_model
        return dataclasses.replace(self, max_model_len=max_len, token_buckets=buckets,
                                   max_model_len_from_model=from_model)

    def fit_kv_pool(self, num_pages: int) -> "EngineConfig":
        """The settings for a KV pool of `num_pages`: the model's context length, lowered (to
        whole pages) when the pool cannot hold one sequence of it. A max_model_len that was
        set explicitly is kept; requests longer than the pool are then refused one by one."""
        assert self.max_model_len, "call resolve() first"
        pool_tokens = kv_pool_tokens(num_pages, self.page_size)
        if not self.max_model_len_from_model or self.max_model_len <= pool_tokens:
            return self
        return dataclasses.replace(self, max_model_len=pool_tokens)

    def resolved_kv_cache_dtype(self, backend: str) -> str:
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        return "float32" if backend == "cpu" else self.dtype

    @property
    def max_pages_per_seq(self) -> int:
        assert self.max_model_len, "call resolve() first"
        return -(-self.max_model_len // self.page_size)

    def seq_bucket(self, token_bucket: int) -> int:
        """Sequence rows compiled with a token bucket. A step never holds more sequences than
        tokens, so tying the two keeps one program per token bucket instead of a grid."""
        return min(token_bucket, self.max_num_seqs)
