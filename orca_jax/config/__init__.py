"""Engine and model configuration.

`ModelConfig` describes a checkpoint's architecture; each model family reads it from HF
`config.json` itself (`orca_jax.models.config_from_hf`, which also checks the family and the
activation against the registries there), GGUF metadata goes through the same parser
(`orca_jax.loading.loader.gguf_config`). `EngineConfig` holds the serving knobs, with vLLM's
names, and derives the shape buckets that bound how many programs XLA compiles;
`speculative.py` beside it holds `SpeculativeConfig`. Every layer reads these, so the package
sits at the bottom of orca_jax, above kernels only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from orca_jax import kernels
from orca_jax.kernels import kv_quant
from orca_jax.cache_dirs import default_compilation_cache_dir, default_model_cache_dir
from orca_jax.config.speculative import SpeculativeConfig

# "request_padded": FasterTransformer as Orca measured it (same-phase rectangles, prompts padded to
# the longest, finished slots computed until the batch ends); "request" keeps selective batching.
SCHEDULING_POLICIES = ("iteration", "request", "request_padded")
# "auto" picks by backend (`kernels.resolve_impl`); the others are the kernel registry's.
ATTENTION_IMPLS = ("auto", *kernels.available_impls())
DTYPES = ("float32", "bfloat16", "float16")
# vLLM's spelling of float16, accepted as it (and made "float16" on construction).
DTYPE_ALIASES = {"half": "float16"}
# The KV cache's dtypes: the model's float ones, and 8-bit values with a scale per token and head
# (orca_jax/kernels/kv_quant.py); "fp8" is vLLM's alias of "fp8_e4m3".
KV_CACHE_DTYPES = (*DTYPES, *kv_quant.KV_CACHE_DTYPES, "fp8")
_KV_CACHE_ALIASES = {"fp8": "fp8_e4m3"}
# A layer's attention, by HF's `layer_types` names.
LAYER_TYPES = ("full_attention", "sliding_attention")
# Weight formats (orca_jax/kernels/quantization.py), by vLLM's `quantization` names.
# "mxfp4" keeps (or packs) a mixture of experts' expert weights 4-bit, the rest float;
# "none" asks for float weights throughout (an MXFP4 checkpoint's experts unpacked at load).
QUANTIZATION_METHODS = ("int8", "fp8", "gguf", "mxfp4", "none")
# Formats of the routed experts' weights (ModelConfig.expert_format).
EXPERT_FORMATS = ("mxfp4",)
# Most cached pages one step takes up (see EngineConfig.cached_pages_per_step): 4 KB of page
# writes per step, 8,192 tokens at the default page size.
MAX_CACHED_PAGES_PER_STEP = 512


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only checkpoint. `model_type` picks the model family (see
    `orca_jax.models.ARCHITECTURES`, which also says which `model_type` and `hidden_act` values
    exist); the other fields are the knobs the families share."""

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
    # RoPE scaling as HF's `rope_scaling` dict holds it, "rope_type" included (linear, dynamic,
    # yarn, longrope, llama3; orca_jax/models/rope.py), as sorted (key, value) items with lists
    # made tuples, so the config stays hashable. None means plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    # The fraction of each head's dimensions that RoPE rotates (Phi-3/4's partial rotary).
    partial_rotary_factor: float = 1.0
    # Gemma 3: the sliding layers' RoPE base, without the scaling the full layers use. None: all
    # layers rotate alike.
    rope_local_theta: float | None = None
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
    # Each layer's attention, HF's `layer_types`: "sliding_attention" (the last `sliding_window`
    # tokens) or "full_attention". None: every layer alike, windowed when `sliding_window` is set.
    layer_types: tuple[str, ...] | None = None
    # Attention scores capped as c * tanh(s / c) before the softmax (HF's name, Gemma 2's).
    attn_logit_softcapping: float | None = None
    # Gemma: scores scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Gemma 2: logits capped as c * tanh(z / c).
    final_logit_softcapping: float | None = None
    # gpt-oss: a learned logit per query head joins each softmax's denominator ("sinks").
    attention_sinks: bool = False
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    # How the weights are stored (a format of orca_jax.kernels.quantization: "int8", "fp8", "gguf");
    # None: floats in the model dtype. Set by the engine (EngineConfig.quantization) or read
    # from a checkpoint's marker (already quantized); the model declares its tree from it.
    quantization: str | None = None
    # Mixture of experts (orca_jax/models/moe.py); num_experts 0: a dense model. Each token goes
    # to `num_experts_per_tok` of `num_experts` gated MLPs of width `moe_intermediate_size`,
    # weighted by the router's `router_scoring` ("softmax" or "sigmoid") scores of its top
    # experts, renormalised to sum to one when `norm_topk_prob`; a shared expert of width
    # `shared_expert_intermediate_size` (0: none), gated by a sigmoid, sees every token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_scoring: str = "softmax"
    # gpt-oss: biases on the router and on every expert's projections; and its clamped SwiGLU
    # (`swiglu_limit` set): gate g clamped to <= limit, up u to [-limit, limit], then
    # (u + 1) * g * sigmoid(alpha * g) (`swiglu_alpha`). None: act(g) * u, as the other families.
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # How the routed experts' weights are stored: None (floats in the model dtype) or "mxfp4"
    # (4-bit codes two per byte with an e8m0 scale per 32, orca_jax/kernels/packed4.py), kept so
    # on the device. Read from the checkpoint (its `quantization_config`), or set by the engine
    # (EngineConfig.quantization "mxfp4" packs float experts, "none" unpacks MXFP4 at load).
    expert_format: str | None = None
    # Set by the engine (EngineConfig.enable_expert_parallel), like `quantization`: the experts
    # are sharded whole over the mesh (expert parallelism) instead of each expert's
    # intermediate axis (tensor parallelism). It changes where the weights live, not their shapes.
    expert_parallel: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                             f"num_experts ({self.num_experts})")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"unsupported layer_types {unknown}; supported: {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.expert_format not in (None, *EXPERT_FORMATS):
            raise ValueError(f"expert_format must be None or one of {EXPERT_FORMATS}, got {self.expert_format!r}")
        if self.expert_format is not None and not self.num_experts:
            raise ValueError(f"expert_format {self.expert_format!r} is the format of a mixture of experts' expert "
                             f"weights; this model has no experts")
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router_scoring must be 'softmax' or 'sigmoid', got {self.router_scoring!r}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: full attention)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if kind == "sliding_attention" else None for kind in self.layer_types)

    def for_layers(self, layers: range) -> "ModelConfig":
        """The config of a run of consecutive layers (a pipeline stage): as many layers, each
        with its own attention type."""
        layer_types = None if self.layer_types is None else self.layer_types[layers.start:layers.stop]
        return dataclasses.replace(self, num_layers=len(layers), layer_types=layer_types)

    @property
    def mixes_attention_types(self) -> bool:
        """Whether some layers slide and others attend in full (the scan then carries each
        layer's window and RoPE as data)."""
        return len(set(self.layer_windows())) > 1

    @property
    def sm_scale(self) -> float:
        """The factor every attention score is scaled by."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


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
    # The tokenizer's directory, file or hub id when it is not the model's (vLLM's --tokenizer).
    tokenizer: str | None = None
    # A hub id's branch, tag or commit (vLLM's --revision); for hub ids only.
    revision: str | None = None
    # Where request defaults for sampling come from (orca_jax.loading.generation_config):
    # "auto" the model's generation_config.json, "vllm" none, or a directory holding one.
    generation_config: str = "auto"
    # "auto": the checkpoint's dtype on GPUs and TPUs, float32 on CPU (orca_jax.loading.dtype_policy);
    # the engine resolves it before loading the model.
    dtype: Literal["auto", "float32", "bfloat16", "float16", "half"] = "auto"
    # "auto": the model dtype, except float32 on CPU, where XLA has no bfloat16 scatter/gather
    # and would convert the whole cache around every KV write and read. "int8" / "fp8_e4m3":
    # 8-bit values with a bfloat16 scale per token and head, about twice the tokens of bfloat16.
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "half", "int8", "fp8_e4m3", "fp8"] = "auto"
    # Weights quantized at load time (orca_jax/kernels/quantization.py): "int8" (per output channel,
    # W8A16), "fp8" (e4m3 where the device has fp8 units, else int8, said in the log), "gguf"
    # (a GGUF file's own Q8_0/Q4_0/Q4_1 blocks kept), "mxfp4" (a mixture of experts' experts
    # 4-bit, orca_jax/kernels/packed4.py: kept from an MXFP4 checkpoint, or packed at load),
    # "none" (floats throughout: an MXFP4 checkpoint's experts unpacked at load). None: floats
    # in `dtype`, or what an already-quantized checkpoint holds.
    quantization: str | None = None
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
    # Inter-layer parallelism (Orca's): the layers split into this many stages, each on its own
    # tensor_parallel_size devices; up to this many batches are in flight, one per stage, and a
    # sequence in an in-flight batch is not scheduled again until its batch returns.
    pipeline_parallel_size: int = 1
    # Replicas of the whole engine in one process (vLLM's --data-parallel-size), each on its own
    # tensor_parallel_size x pipeline_parallel_size devices with its own KV cache and scheduler;
    # requests are routed between them (orca_jax.engine.replicas, orca_jax.engine.router). One
    # LLMEngine is one replica: it takes a config whose data_parallel_size is 1.
    data_parallel_size: int = 1
    # Mixture-of-experts models (vLLM's flag): each of the tensor_parallel_size devices holds
    # whole experts (num_experts / tensor_parallel_size of them) instead of a slice of every
    # expert. The attention stays tensor-parallel on the same devices.
    enable_expert_parallel: bool = False
    scheduling: Literal["iteration", "request", "request_padded"] = "iteration"
    # Overlapped steps (vLLM's async scheduling): the engine dispatches step N+1 before it
    # reads step N's tokens, so the host's work hides behind the device's. Outputs are the
    # same either way; False runs one step at a time.
    async_scheduling: bool = True
    max_logprobs: int = 20
    # Automatic prefix caching (vLLM's default): full KV pages are kept under the hash of their
    # tokens and the tokens before them, and a new sequence starts after the longest prefix
    # found (orca_jax.core.prefix_cache). Only the iteration-level policy looks prefixes up.
    enable_prefix_caching: bool = True
    min_token_bucket: int = 8
    seed: int = 0
    # JAX's persistent compilation cache: a second start loads the step programs instead of
    # compiling them. None turns it off. (orca_jax.cache_dirs says where the default lives.)
    compilation_cache_dir: str | None = field(default_factory=default_compilation_cache_dir)
    # Converted GGUF weights and tokenizer, so a second start skips parsing and dequantizing
    # the file. None turns it off.
    model_cache_dir: str | None = field(default_factory=default_model_cache_dir)
    # Speculative decoding (orca_jax.spec_decode): a dict with vLLM's keys, its JSON text, or
    # a SpeculativeConfig; kept as the dataclass. None: off.
    speculative_config: SpeculativeConfig | None = None
    # Filled in from the model once it is loaded (see `resolve`).
    token_buckets: tuple[int, ...] = field(default=(), compare=False)
    # The model's vocabulary (the logits' width), from `resolve`: the width of each step's
    # token bitmask (constrained decoding).
    vocab_size: int = field(default=0, compare=False)
    # True when `resolve` took max_model_len from the model, so the KV pool may lower it.
    max_model_len_from_model: bool = field(default=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        object.__setattr__(self, "kv_cache_dtype", DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype))
        errors = []
        if self.dtype not in ("auto", *DTYPES):
            errors.append(f"dtype must be 'auto' or one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            errors.append(f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        if self.kv_cache_dtype not in ("auto", *KV_CACHE_DTYPES):
            errors.append(f"kv_cache_dtype must be 'auto' or one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            errors.append(f"quantization must be None or one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        if self.scheduling not in SCHEDULING_POLICIES:
            errors.append(f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            errors.append(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "tensor_parallel_size",
                     "pipeline_parallel_size", "data_parallel_size", "min_token_bucket"):
            if getattr(self, name) < 1:
                errors.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages is not None and self.num_pages < 2:
            errors.append(f"num_pages must be >= 2 (page 0 is the padding sink), got {self.num_pages}")
        for name in ("async_scheduling", "enable_prefix_caching", "enable_expert_parallel"):
            if not isinstance(getattr(self, name), bool):
                errors.append(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            errors.append(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so that every running sequence gets its decode token"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            errors.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.scheduling == "request_padded" and self.speculative_config is not None:
            errors.append("scheduling='request_padded' is FasterTransformer's baseline, which does not speculate; "
                          "speculative decoding runs with 'iteration' or 'request'")
        if self.pipeline_parallel_size > 1 and self.speculative_config is not None:
            errors.append("speculative decoding runs one step at a time; it does not combine with "
                          "pipeline_parallel_size > 1 (whose batches in flight it would serialize)")
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
                                   max_model_len_from_model=from_model, vocab_size=model_config.vocab_size)

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
        """The cache's storage dtype (a numpy dtype name)."""
        assert self.dtype != "auto", "resolve dtype='auto' first (orca_jax.loading.dtype_policy)"
        name = _KV_CACHE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if name in kv_quant.KV_CACHE_DTYPES:
            return kv_quant.KV_CACHE_DTYPES[name].dtype.name
        if name != "auto":
            return name
        return "float32" if backend == "cpu" else self.dtype

    @property
    def max_pages_per_seq(self) -> int:
        assert self.max_model_len, "call resolve() first"
        return -(-self.max_model_len // self.page_size)

    @property
    def cached_pages_per_step(self) -> int:
        """Pages found in the prefix cache that one step may add to page tables: every step's
        inputs carry room for this many page-table writes beyond its own tokens' (8 bytes
        each), so it is bounded, and a longer cached prefix is taken only in part."""
        if not self.enable_prefix_caching or self.scheduling != "iteration":
            return 0
        return min(self.max_pages_per_seq, MAX_CACHED_PAGES_PER_STEP)

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens a sequence may add to one step (0: no speculation)."""
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    def logits_rows(self, token_bucket: int) -> int:
        """Rows of logits the step program of a bucket computes: one per sequence row, and with
        speculation one per verified position too (1 + k per speculating row). A position is a
        token of the step, so the bucket's token count bounds them as well."""
        rows = self.seq_bucket(token_bucket)
        return min(token_bucket, rows * (1 + self.num_speculative_tokens))

    def seq_bucket(self, token_bucket: int) -> int:
        """Sequence rows compiled with a token bucket. A step never holds more sequences than
        tokens, so tying the two keeps one program per token bucket instead of a grid."""
        return min(token_bucket, self.max_num_seqs)
