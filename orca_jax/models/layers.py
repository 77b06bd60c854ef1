"""Building blocks shared by the model families: norms, RoPE, MLPs, paged attention, and the
scan over stacked layers with their flat all-layer KV cache.

Every layer works on the flattened token axis T (Orca's selective batching): tokens of all
requests, prefill and decode alike, go through one matmul. Only `PagedAttention` looks at the
per-request structure, through the kernel entry point.
"""

from __future__ import annotations

import functools
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
from orca_jax.models import rope


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


def layer_window(config: ModelConfig, layer):
    """The attention window of layer `layer` (the scan index): None (full) or an int when all
    layers attend alike, else a traced i32[] read from the per-layer windows, a full layer's
    larger than any context. The windows are a constant of the program, so a model mixing
    sliding and full layers still compiles one step program per shape."""
    windows = config.layer_windows()
    if not config.mixes_attention_types:
        return windows[0]
    full = kernels.FULL_ATTENTION_WINDOW
    return jnp.asarray([full if w is None else w for w in windows], jnp.int32)[layer]


def layer_rope(config: ModelConfig, layer) -> rope.RopeTables:
    """The RoPE tables of layer `layer`: the model's, or (Gemma 3) the local base's on sliding
    layers, picked by the scan index where the model has both."""
    global_tables = model_rope_tables(config)
    if config.rope_local_theta is None:
        return global_tables
    local_tables = model_rope_tables(config, local=True)
    kinds = config.layer_types or ("sliding_attention" if config.sliding_window else "full_attention",)
    if set(kinds) == {"sliding_attention"}:
        return local_tables
    if set(kinds) == {"full_attention"}:
        return global_tables
    is_sliding = jnp.asarray([kind == "sliding_attention" for kind in kinds])[layer]
    return rope.select_tables(is_sliding, local_tables, global_tables)


@functools.lru_cache(maxsize=32)
def model_rope_tables(config: ModelConfig, local: bool = False) -> rope.RopeTables:
    """The RoPE tables of a model (constants of its config, folded into the program); `local`:
    those of Gemma 3's sliding layers, at `rope_local_theta` and without scaling."""
    theta = config.rope_local_theta if local else config.rope_theta
    return rope.rope_tables(config.head_dim, theta, None if local else config.rope_scaling_dict,
                            partial_rotary_factor=config.partial_rotary_factor,
                            max_position_embeddings=config.max_position_embeddings,
                            freq_factors=config.rope_freq_factors)


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


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from one, `(1 + w) * normed`, and the
    whole norm runs in float32 before the cast back (Llama's scales in the model dtype)."""

    eps: float
    dtype: Any = jnp.float32
    axes: tuple[str] = ("embed",)

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.zeros, self.axes),
                           (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)


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

    `qk_norm_eps` set: `norm_cls` (RMSNorm, or Gemma's) on each query and key head before RoPE
    (Qwen3, Gemma 3). `soft_cap` set: attention scores are capped as
    `soft_cap * tanh(s / soft_cap)` (Gemma 2's `attn_logit_softcapping`). `sm_scale` None: scores
    scaled by head_dim ** -0.5. `use_sinks`: a learned logit per query head ("sinks") joins each
    softmax's denominator (gpt-oss).

    Called with the layer's RoPE tables (None: no RoPE, positions are already in x, GPT-2's
    learned embedding) and its window: None (full), an int, or traced (the layer scan's window
    of a model that mixes sliding and full layers)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    qkv_bias: bool = False
    o_bias: bool = False
    soft_cap: float | None = None
    attention_impl: str = "reference"
    dtype: Any = jnp.float32
    qk_norm_eps: float | None = None
    norm_cls: Any = None  # the Q/K norm's class; None: RMSNorm
    sm_scale: float | None = None
    use_sinks: bool = False
    # A device mesh (tensor parallelism): the cache write and attention then run per shard,
    # on each device's own heads. None: one device, the kernels called directly.
    mesh: Any = None
    quantization: str | None = None  # of the four projections (orca_jax.kernels.quantization)

    @nn.compact
    def __call__(self, x, kv_pages, metadata: AttentionMetadata, rope_tables: rope.RopeTables | None,
                 window=None):
        """x [T, D]; kv_pages [pages, page_size, 2K, H] (this layer's, via metadata.for_layer)."""
        D, N, K, H, qz = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.quantization
        q_axes, kv_axes = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        q = Einsum("TD,DNH->TNH", (D, N, H), q_axes, self.qkv_bias, self.dtype, qz, name="q_proj")(x)
        k = Einsum("TD,DKH->TKH", (D, K, H), kv_axes, self.qkv_bias, self.dtype, qz, name="k_proj")(x)
        v = Einsum("TD,DKH->TKH", (D, K, H), kv_axes, self.qkv_bias, self.dtype, qz, name="v_proj")(x)
        if self.qk_norm_eps is not None:
            norm = self.norm_cls or RMSNorm
            q = norm(self.qk_norm_eps, self.dtype, axes=("head_dim",), name="q_norm")(q)
            k = norm(self.qk_norm_eps, self.dtype, axes=("head_dim",), name="k_norm")(k)
        if rope_tables is not None:
            q = rope.apply_rope(q, metadata.positions, rope_tables)
            k = rope.apply_rope(k, metadata.positions, rope_tables)
        sinks = None
        if self.use_sinks:
            sinks = self.param("sinks", nn.with_logical_partitioning(nn.initializers.zeros, ("heads",)), (N,),
                               self.dtype)
        # A static window stays static (it is part of the program, and jax's TPU kernel takes only
        # that); a traced one travels as data, through the shards too.
        traced_window = window if isinstance(window, jax.Array) else None
        attend = functools.partial(self._attend, static_window=None if traced_window is not None else window)
        if self.mesh is not None:
            attend = parallel.per_shard_attention(self.mesh, attend)
        out, kv_pages = attend(q, k, v, kv_pages, metadata, traced_window, sinks)
        o_axes = ("heads", "head_dim", "embed")
        out = Einsum("TNH,NHD->TD", (N, H, D), o_axes, self.o_bias, self.dtype, qz, name="o_proj")(out)
        return out, kv_pages

    @nn.nowrap
    def _attend(self, q, k, v, kv_pages, metadata: AttentionMetadata, traced_window, sinks, *, static_window):
        """Write this step's K/V into the cache, then attend; on one device's heads (and their
        sinks) when sharded (the head counts come from the arrays, not the module)."""
        kv_pages = kernels.write_kv(kv_pages, k, v, metadata)
        out = kernels.ragged_paged_attention(
            q, kv_pages, metadata, sm_scale=self.sm_scale or self.head_dim ** -0.5, sliding_window=static_window if traced_window is None else traced_window,
            soft_cap=self.soft_cap, sinks=sinks, impl=self.attention_impl,
        )
        return out, kv_pages
