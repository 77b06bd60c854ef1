"""Building blocks shared by the model families: norms, RoPE, MLPs, paged attention, and the
scan over stacked layers with their flat all-layer KV cache.

Every layer works on the flattened token axis T (Orca's selective batching): tokens of all
requests, prefill and decode alike, go through one matmul. Only `PagedAttention` looks at the
per-request structure, through the kernel entry point.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from orca_jax import kernels
from orca_jax.distributed import parallel
from orca_jax.kernels import quantization
from orca_jax.config import ModelConfig
from orca_jax.kernels.metadata import AttentionMetadata


def run_layer_stack(block: type[nn.Module], x, kv_cache, metadata: AttentionMetadata, **block_fields):
    """Apply `num_layers` stacked copies of `block` with `nn.scan` (compile time does not grow
    with depth). Call inside a compact method; the parameters live under "layers".

    The KV cache of all layers travels through the scan as one array viewed as
    `num_layers * num_pages` pages, so each layer writes into the same donated buffer in place.
    `block(pages_per_layer=, page_size=, **block_fields)` is called as
    `block((x, kv_pages), layer, metadata) -> ((x, kv_pages), None)`, and points the metadata at
    its own layer's pages (`metadata.for_layer`).
    x [T, D]; kv_cache [L, P, page_size, 2K, H]. Returns (x, kv_cache)."""
    num_layers, num_pages, page_size = kv_cache.shape[:3]
    layers = nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast),
        length=num_layers,
        # The stacked parameters' new leading axis gets its own logical name (parallel.py).
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(pages_per_layer=num_pages, page_size=page_size, **block_fields, name="layers")
    flat_cache = kv_cache.reshape(num_layers * num_pages, *kv_cache.shape[2:])
    (x, flat_cache), _ = layers((x, flat_cache), jnp.arange(num_layers), metadata)
    return x, flat_cache.reshape(kv_cache.shape)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, whose logical name is `axes` (for the sharding rules)."""

    eps: float
    dtype: Any = jnp.float32
    axes: tuple[str] = ("embed",)

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, self.axes),
                           (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # Like transformers: normalise in float32, cast back, then scale in the model dtype.
        return scale * normed.astype(self.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with a bias (GPT-2), statistics in float32."""

    eps: float
    dtype: Any = jnp.float32
    axes: tuple[str] = ("embed",)

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, self.axes),
                           (x.shape[-1],), self.dtype)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.axes),
                          (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        return scale * normed.astype(self.dtype) + bias


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None,
                  freq_factors: tuple[float, ...] | None = None) -> np.ndarray:
    """Inverse frequencies (float32, computed as transformers does), with llama3 scaling given
    either as parameters (HF) or as per-frequency divisors (GGUF)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling:
        inv_freq = _llama3_scale(inv_freq, **scaling)
    if freq_factors is not None:
        inv_freq = (inv_freq / np.asarray(freq_factors, np.float32)).astype(np.float32)
    return inv_freq


def model_inv_freq(config: ModelConfig) -> np.ndarray:
    """The RoPE frequencies of a model (a constant of its config, folded into the program)."""
    return rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling_dict, config.rope_freq_factors)


def _llama3_scale(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    blend in between."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the transformers layout) by each token's own position.
    x [T, N, H], positions i32[T]."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :].astype(x.dtype)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class Einsum(nn.Module):
    """A weight with named axes, applied by an einsum (`"TD,DNH->TNH"`); optional bias over
    the output axes. `axes`: the logical name of each kernel axis (`("embed", "heads",
    "head_dim")`), which the sharding rules map to the mesh (orca_jax/distributed/parallel.py); the bias
    takes the names of the kernel axes it spans. The kernel's contraction axes come first.

    `quantization` (a format of orca_jax.kernels.quantization): the kernel is stored quantized, with
    its `qscale` (and `qzero`) beside it, their output axes named as the kernel's, so they
    shard with it."""

    spec: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    use_bias: bool = False
    dtype: Any = jnp.float32
    quantization: str | None = None

    @nn.compact
    def __call__(self, x):
        num_contract = len(self.shape) - len(self._out_dims())
        if self.quantization is None:
            kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.normal(0.02), self.axes),
                                self.shape, self.dtype)
        else:
            kernel = self._quantized_kernel(num_contract)
        y = quantization.einsum(self.spec, x, kernel)
        if self.use_bias:
            bias_dims = self._out_dims()
            bias_axes = tuple(self.axes[d] for d in bias_dims)
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, bias_axes),
                              tuple(self.shape[d] for d in bias_dims), self.dtype)
            y = y + bias
        return y

    def _out_dims(self) -> list[int]:
        """Kernel dimensions of the output axes, in the output's order."""
        out_axes = self.spec.split("->")[1][1:]  # output axes after the token axis
        kernel_axes = self.spec.split(",")[1].split("->")[0]
        return [kernel_axes.index(a) for a in out_axes]

    def _quantized_kernel(self, num_contract: int) -> quantization.QuantizedKernel:
        if self._out_dims() != list(range(num_contract, len(self.shape))):
            raise ValueError(f"a quantized Einsum needs its contraction axes first and its output axes in order: "
                             f"{self.spec}")
        return quantized_kernel(self, "kernel", "qscale", "qzero", self.shape, self.axes, num_contract,
                                self.quantization)


def quantized_kernel(module: nn.Module, name: str, scale_name: str, zero_name: str, shape: tuple[int, ...],
                     axes: tuple[str, ...], num_contract: int, method: str) -> quantization.QuantizedKernel:
    """Declare a quantized kernel [*contract, *out] on `module` (inside its compact method): its
    values `name`, its scales `scale_name` [G, *out] (and offsets `zero_name`), the scales'
    output axes named as the kernel's so that they shard with it."""
    contraction = int(np.prod(shape[:num_contract]))
    num_groups = contraction // quantization.group_size(method, contraction)
    # Groups along a sharded contraction (o_proj's heads, down_proj's mlp) shard with it.
    group_axis = axes[0] if num_groups > 1 else "quant_groups"
    scale_shape = (num_groups, *shape[num_contract:])
    scale_axes = (group_axis, *axes[num_contract:])
    values = module.param(name, nn.with_logical_partitioning(nn.initializers.zeros, axes), shape,
                          quantization.VALUE_DTYPES[method])
    return quantization.QuantizedKernel(values, *_scales(module, scale_name, zero_name, scale_shape, scale_axes, method))


def _scales(module: nn.Module, scale_name: str, zero_name: str, shape: tuple[int, ...], axes: tuple[str, ...],
            method: str):
    """Declare a quantized weight's scales (and, for formats with one, offsets): (scale, zero or None)."""
    dtype = quantization.SCALE_DTYPES[method]
    scale = module.param(scale_name, nn.with_logical_partitioning(nn.initializers.ones, axes), shape, dtype)
    zero = None
    if quantization.has_offset(method):
        zero = module.param(zero_name, nn.with_logical_partitioning(nn.initializers.zeros, axes), shape, dtype)
    return scale, zero


def embedding_table(module: nn.Module, name: str, shape: tuple[int, int], axes: tuple[str, str], dtype,
                    method: str | None):
    """An embedding table parameter `name` [V, D] declared on `module` (call inside its compact
    method): a float array, or with `method` a QuantizedTable whose scales are `{name}_qscale`
    (and `{name}_qzero`) [V, G], sharded with the table's rows."""
    if method is None:
        return module.param(name, nn.with_logical_partitioning(nn.initializers.normal(0.02), axes), shape, dtype)
    num_groups = shape[1] // quantization.group_size(method, shape[1])
    scale_axes = (axes[0], axes[1] if num_groups > 1 else "quant_groups")
    values = module.param(name, nn.with_logical_partitioning(nn.initializers.zeros, axes), shape,
                          quantization.VALUE_DTYPES[method])
    return quantization.QuantizedTable(
        values, *_scales(module, f"{name}_qscale", f"{name}_qzero", (shape[0], num_groups), scale_axes, method))


# By transformers' `hidden_act` names (`ModelConfig.hidden_act`).
ACTIVATIONS = {
    "silu": nn.silu,
    "gelu_new": functools.partial(nn.gelu, approximate=True),  # GPT-2's tanh approximation
    "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
    "gelu": functools.partial(nn.gelu, approximate=False),
}


def activation(name: str):
    """The activation of `hidden_act` `name`; a clear error for one no family implements (a
    ModelConfig built in code is not checked against the registry, an HF config is)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """SwiGLU (with silu): down(act(gate(x)) * up(x))."""

    hidden_size: int
    intermediate_size: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    activation: str = "silu"
    quantization: str | None = None

    @nn.compact
    def __call__(self, x):
        D, F, q = self.hidden_size, self.intermediate_size, self.quantization
        gate = Einsum("TD,DF->TF", (D, F), ("embed", "mlp"), self.use_bias, self.dtype, q, name="gate_proj")(x)
        up = Einsum("TD,DF->TF", (D, F), ("embed", "mlp"), self.use_bias, self.dtype, q, name="up_proj")(x)
        act = activation(self.activation)
        down = Einsum("TF,FD->TD", (F, D), ("mlp", "embed"), self.use_bias, self.dtype, q, name="down_proj")
        return down(act(gate) * up)


class MLP(nn.Module):
    """The original transformer MLP (GPT-2): proj(act(fc(x)))."""

    hidden_size: int
    intermediate_size: int
    use_bias: bool = True
    dtype: Any = jnp.float32
    activation: str = "gelu_new"
    quantization: str | None = None

    @nn.compact
    def __call__(self, x):
        D, F, q = self.hidden_size, self.intermediate_size, self.quantization
        h = Einsum("TD,DF->TF", (D, F), ("embed", "mlp"), self.use_bias, self.dtype, q, name="fc")(x)
        proj = Einsum("TF,FD->TD", (F, D), ("mlp", "embed"), self.use_bias, self.dtype, q, name="proj")
        return proj(activation(self.activation)(h))


class PagedAttention(nn.Module):
    """GQA self-attention over the paged cache. Writes this step's K/V, then attends.

    `qk_norm_eps` set: RMSNorm each query and key head before RoPE (Qwen3). `soft_cap` set:
    attention scores are capped as `soft_cap * tanh(s / soft_cap)` (Gemma 2's
    `attn_logit_softcapping`). Called with `rope_inv_freq` None: no RoPE, positions are
    already in x (GPT-2's learned embedding)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    soft_cap: float | None = None
    attention_impl: str = "reference"
    dtype: Any = jnp.float32
    qk_norm_eps: float | None = None
    # A device mesh (tensor parallelism): the cache write and attention then run per shard,
    # on each device's own heads. None: one device, the kernels called directly.
    mesh: Any = None
    quantization: str | None = None  # of the four projections (orca_jax.kernels.quantization)

    @nn.compact
    def __call__(self, x, kv_pages, metadata: AttentionMetadata, rope_inv_freq: np.ndarray | None):
        """x [T, D]; kv_pages [pages, page_size, 2K, H] (this layer's, via metadata.for_layer)."""
        D, N, K, H, qz = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.quantization
        q_axes, kv_axes = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        q = Einsum("TD,DNH->TNH", (D, N, H), q_axes, self.qkv_bias, self.dtype, qz, name="q_proj")(x)
        k = Einsum("TD,DKH->TKH", (D, K, H), kv_axes, self.qkv_bias, self.dtype, qz, name="k_proj")(x)
        v = Einsum("TD,DKH->TKH", (D, K, H), kv_axes, self.qkv_bias, self.dtype, qz, name="v_proj")(x)
        if self.qk_norm_eps is not None:
            q = RMSNorm(self.qk_norm_eps, self.dtype, axes=("head_dim",), name="q_norm")(q)
            k = RMSNorm(self.qk_norm_eps, self.dtype, axes=("head_dim",), name="k_norm")(k)
        if rope_inv_freq is not None:
            q = apply_rope(q, metadata.positions, rope_inv_freq)
            k = apply_rope(k, metadata.positions, rope_inv_freq)
        attend = self._attend if self.mesh is None else parallel.per_shard_attention(self.mesh, self._attend)
        out, kv_pages = attend(q, k, v, kv_pages, metadata)
        o_axes = ("heads", "head_dim", "embed")
        out = Einsum("TNH,NHD->TD", (N, H, D), o_axes, self.o_bias, self.dtype, qz, name="o_proj")(out)
        return out, kv_pages

    @nn.nowrap
    def _attend(self, q, k, v, kv_pages, metadata: AttentionMetadata):
        """Write this step's K/V into the cache, then attend; on one device's heads when
        sharded (the head counts come from the arrays, not the module)."""
        kv_pages = kernels.write_kv(kv_pages, k, v, metadata)
        out = kernels.ragged_paged_attention(
            q, kv_pages, metadata, sm_scale=self.head_dim ** -0.5, sliding_window=self.sliding_window,
            soft_cap=self.soft_cap, impl=self.attention_impl,
        )
        return out, kv_pages
