"""The model families, by HF `model_type`: which Flax module runs a checkpoint, which function
reads its HF `config.json` into a `ModelConfig`, and which turns its HF tensors into that
module's parameters. The lists of what is supported (`SUPPORTED_MODEL_TYPES`,
`SUPPORTED_ACTIVATIONS`) are read off the registries here, and checked here, where every
configuration from outside (HF config, GGUF metadata via `loader.gguf_config`) comes in."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.distributed import parallel
from orca_jax.kernels import packed4, quantization
from orca_jax.config import EXPERT_FORMATS, ModelConfig
from orca_jax.kernels.metadata import AttentionMetadata
from orca_jax.models import gemma, gpt2, gpt_oss, llama, moe_families, phi3
from orca_jax.models.layers import ACTIVATIONS, activation, model_rope_tables


@dataclass(frozen=True)
class Architecture:
    # Called as model_class(config, attention_impl, dtype, mesh=None); applied as
    # (input_ids, kv_cache, AttentionMetadata, logits_indices) -> (logits, kv_cache).
    model_class: type[nn.Module]
    # (HF config.json dict, model_type) -> ModelConfig
    config_from_hf: Callable[[dict[str, Any], str], ModelConfig]
    # (HF tensors by name, consumed; config) -> {"params": tree of numpy arrays}
    hf_to_params: Callable[[dict[str, np.ndarray], ModelConfig], dict[str, Any]]
    # The transformers class named in config.json's `architectures`, for configs without `model_type`.
    hf_class_name: str


def _llama_family(hf_class_name: str) -> Architecture:
    return Architecture(llama.LlamaForCausalLM, llama.config_from_hf, llama.hf_to_params, hf_class_name)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": _llama_family("LlamaForCausalLM"),
    "mistral": _llama_family("MistralForCausalLM"),  # + sliding window
    "qwen2": _llama_family("Qwen2ForCausalLM"),  # + Q/K/V biases
    "qwen3": _llama_family("Qwen3ForCausalLM"),  # + per-head Q/K RMSNorm
    "gpt2": Architecture(gpt2.GPT2ForCausalLM, gpt2.config_from_hf, gpt2.hf_to_params, "GPT2LMHeadModel"),
    # Gemma 2/3: Gemma's norms, GeGLU, scaled embeddings, sliding and full layers mixed; a
    # `gemma3` (vision-language) checkpoint by its text tower.
    **{name: Architecture(gemma.GemmaForCausalLM, gemma.config_from_hf, gemma.hf_to_params, hf_class)
       for name, hf_class in (("gemma2", "Gemma2ForCausalLM"), ("gemma3_text", "Gemma3ForCausalLM"),
                              ("gemma3", "Gemma3ForConditionalGeneration"))},
    # Phi-3 / Phi-4-mini: the Llama block with fused projections, LongRoPE, partial rotary.
    "phi3": Architecture(llama.LlamaForCausalLM, phi3.config_from_hf, phi3.hf_to_params, "Phi3ForCausalLM"),
    # Mixtures of experts: the attention of mistral / qwen2 / qwen3, a SparseMoE layer as the MLP.
    **{name: Architecture(moe_families.MoEForCausalLM, moe_families.config_from_hf, moe_families.hf_to_params,
                          hf_class) for name, hf_class in (("mixtral", "MixtralForCausalLM"),
                                                           ("qwen2_moe", "Qwen2MoeForCausalLM"),
                                                           ("qwen3_moe", "Qwen3MoeForCausalLM"))},
    # gpt-oss: the MoE block with sinks, alternating 128-token windows, biased router and
    # experts, the clamped SwiGLU, and MXFP4 experts kept packed.
    "gpt_oss": Architecture(gpt_oss.MODEL_CLASS, gpt_oss.config_from_hf, gpt_oss.hf_to_params,
                            "GptOssForCausalLM"),
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
# By transformers' `hidden_act` names; GPT-2's `gelu_new` and `gelu_pytorch_tanh` are the same
# tanh approximation.
SUPPORTED_ACTIVATIONS = tuple(ACTIVATIONS)


def architecture(model_type: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return ARCHITECTURES[model_type]


@functools.lru_cache(maxsize=8)
def abstract_variables(config: ModelConfig) -> dict[str, Any]:
    """The variables the family's model declares for `config`, as its init makes them but
    without computing anything: shapes and dtypes, each parameter boxed with its logical axes
    (`nn.LogicallyPartitioned`; `nn.unbox` gives the plain tree the loaders produce). The
    sharding rules (orca_jax/distributed/parallel.py) and the checkpoint's shape check read it; traced once
    per config and shared, so never modified. The call's inputs are small: no parameter's
    shape depends on them."""
    T, S, num_pages, page_size, max_pages = 8, 2, 4, 8, 4

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    metadata = AttentionMetadata(positions=i32(T), slot_mapping=i32(T), page_table=i32(S, max_pages),
                                 kv_lens=i32(S), cu_q_lens=i32(S + 1), num_seqs=i32(1))
    kv_cache = jax.ShapeDtypeStruct(
        (config.num_layers, num_pages, page_size, 2 * config.num_kv_heads, config.head_dim), jnp.float32
    )
    model = architecture(config.model_type).model_class(config)
    # The key is made inside eval_shape too: made outside, it would be a concrete array, and a
    # program (random seeding) would compile at every start for nothing.
    return jax.eval_shape(lambda *args: model.init(jax.random.key(0), *args), i32(T), kv_cache, metadata, i32(S))


@functools.lru_cache(maxsize=8)
def logical_specs(config: ModelConfig) -> dict[str, Any]:
    """{"params": PartitionSpecs of logical axis names} of the model that `config` builds, as
    its weights declare them, checked against `parallel.LOGICAL_AXIS_RULES` (traced once per
    config; shared, so never modified). What `parallel.param_shardings` and
    `parallel.repeat_kv_heads` take."""
    return parallel.logical_specs(abstract_variables(config))


# Embedding tables: quantized by rows (their contraction axis is the last one, not the first).
_ROW_TABLES = ("embed",)


def quantize_params(params: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """Float host weights ({"params": numpy tree} of the model of `config` without quantization)
    -> the tree of the model of `config` (with `config.quantization` set): every weight the
    quantized model declares with scales beside it is quantized, the rest is left as it is.
    Consumes `params` (each float weight is dropped once quantized)."""
    if config.is_moe:
        raise ValueError(f"weight quantization ({config.quantization}) of mixture-of-experts models is not supported "
                         f"yet ({config.model_type}: its experts are stacked [experts, in, out] and run as grouped "
                         f"matmuls, which take float weights); serve it in float32 or bfloat16 (kv_cache_dtype may "
                         f"still be 8-bit)")
    declared = nn.unbox(abstract_variables(config))["params"]
    logical = logical_specs(config)["params"]

    def walk(tree: dict, shapes: dict, specs: dict) -> None:
        for key in [k for k in shapes if k.endswith("qscale")]:
            base = key[: -len("qscale")].rstrip("_") or "kernel"
            zero = key.replace("qscale", "qzero")
            if base in _ROW_TABLES:
                quantized = quantization.quantize_rows(tree.pop(base), config.quantization)
                tree[base] = quantized.pop("values")
            else:
                lead = 1 if tuple(specs[base])[:1] == ("layers",) else 0
                kernel = tree.pop(base)
                num_contract = kernel.ndim - lead - (len(shapes[key].shape) - lead - 1)
                quantized = quantization.quantize_kernel(kernel, lead, num_contract, config.quantization)
                tree[base] = quantized.pop("kernel")
            tree[key] = quantized["qscale"]
            if "qzero" in quantized:
                tree[zero] = quantized["qzero"]
        for key, value in shapes.items():
            if isinstance(value, dict):
                walk(tree[key], value, specs[key])

    walk(params["params"], declared, logical)
    return params


_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def convert_expert_format(params: dict[str, Any], config: ModelConfig, target: str | None,
                          float_dtype=np.float32) -> dict[str, Any]:
    """The host tree of a mixture of experts' model (`config`, its experts as `config.expert_format`
    says) with the routed experts in `target` instead: None (floats in `float_dtype`,
    [L, E, in, out]) or "mxfp4" (`packed4`: [L, E, out, in / 2] codes and [L, E, out, in / 32]
    scales). Packing rounds each weight to its block's nearest code; unpacking is exact. One
    layer at a time, so the temporaries stay one layer's. In place; returns `params`."""
    moe = params["params"]["layers"]["moe"]
    have = config.expert_format
    if target == have:
        return params
    if target not in (None, *EXPERT_FORMATS):  # packing writes MXFP4 only (`pack_mxfp4`)
        raise ValueError(f"unknown expert format {target!r}; known: {', '.join(EXPERT_FORMATS)}")
    for name in _EXPERT_PROJECTIONS:
        if have is None:
            moe[f"{name}_blocks"], moe[f"{name}_scales"] = _pack_layers(moe.pop(name))
        else:
            moe[name] = _unpack_layers(moe.pop(f"{name}_blocks"), moe.pop(f"{name}_scales"),
                                       packed4.packed_format(have), float_dtype)
    return params


def _pack_layers(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float [L, E, in, out] -> MXFP4 rows of each transposed matrix, layer by layer."""
    packed = [packed4.pack_mxfp4(np.swapaxes(np.asarray(layer, np.float32), -1, -2)) for layer in weights]
    return np.stack([b for b, _ in packed]), np.stack([s for _, s in packed])


def _unpack_layers(blocks: np.ndarray, scales: np.ndarray, fmt: packed4.Packed4Format, dtype) -> np.ndarray:
    L, E, rows, half = blocks.shape
    out = np.empty((L, E, 2 * half, rows), dtype)
    for layer in range(L):
        out[layer] = np.swapaxes(np.asarray(packed4.unpack(blocks[layer], scales[layer], fmt, jnp.float32)), -1, -2)
    return out


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """A transformers `config.json` dict -> ModelConfig, read by its family's parser. The family
    comes from `model_type`, else from `architectures`, else Llama."""
    model_type = _model_type_from_hf(cfg)
    return check_supported(architecture(model_type).config_from_hf(cfg, model_type))


def check_supported(config: ModelConfig) -> ModelConfig:
    """`config` itself, once its family and activation are known to the registries and its
    RoPE tables can be built (every config from outside passes here: HF, GGUF, a checkpoint's
    marker), so that a bad config fails at parse, naming what is wrong. Raises ValueError."""
    architecture(config.model_type)
    activation(config.hidden_act)
    model_rope_tables(config)
    return config


def _model_type_from_hf(cfg: dict[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type is not None:
        return model_type
    by_class = {arch.hf_class_name: name for name, arch in ARCHITECTURES.items()}
    known = [by_class[a] for a in cfg.get("architectures") or [] if a in by_class]
    return known[0] if known else "llama"
