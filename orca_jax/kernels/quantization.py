"""Quantized weights: the formats, how a float weight becomes one (numpy, at load time), and how
the model computes with one (jnp, inside the step).

Decode reads every weight once per step, so its speed is weight bytes over memory bandwidth;
8-bit weights halve the bytes of bfloat16 and quarter those of float32. Activations stay in the
model dtype (weight-only, W8A16): a dense layer computes `x @ dequantize(w)`.

A quantized weight is three arrays beside each other in the parameter tree:

    kernel  int8 / float8_e4m3fn  the weight's own shape, contraction axes first, as Einsum declares it
    qscale  float                 [G, *output axes]: one scale per output channel and group
    qzero   float (gguf only)     [G, *output axes]: an offset per group (GGUF's Q4_1 minimum)

and `w = kernel * qscale (+ qzero)`, each group of `group_size` consecutive weights along the
flattened contraction axes sharing one scale (and offset). The formats (`ModelConfig.quantization`):

    "int8"  symmetric int8, one scale per output channel (G = 1): the scale factors out of the
            contraction, so the layer is `(x @ kernel) * qscale` and the weight is only converted
    "fp8"   the same with float8_e4m3fn values (GPUs with fp8 units, H100/H200; TPU v7)
    "gguf"  GGUF's own blocks of 32 along the contraction, float16 scale and offset per block:
            Q8_0 (and any 8-bit-or-finer type) as int8 with its scale, Q4_0/Q4_1 as 4-bit levels
            held one per int8 with scale and minimum; the block dequantizes before the product

An embedding table [V, D] is the same with its rows as output channels and groups along D
(`rows` functions below), so a tied LM head reads the same arrays as the lookup.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.kernels import gpu_info

logger = logging.getLogger(__name__)

METHODS = ("int8", "fp8", "gguf")
# EngineConfig.quantization values that are not a format of the dense weights: the experts kept
# (or packed) in MXFP4, or every weight float (orca_jax/kernels/packed4.py, the loader).
EXPERT_METHODS = ("mxfp4", "none")
GGUF_BLOCK = 32  # GGUF's block size along a row, the same for Q8_0, Q4_0 and Q4_1
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn

VALUE_DTYPES = {"int8": np.int8, "fp8": jnp.float8_e4m3fn, "gguf": np.int8}
SCALE_DTYPES = {"int8": np.float32, "fp8": np.float32, "gguf": np.float16}


def check_method(method: str | None) -> None:
    if method is not None and method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS} or None, got {method!r}")


def group_size(method: str, contraction: int) -> int:
    """Consecutive weights along the flattened contraction that share a scale."""
    if method != "gguf":
        return contraction
    if contraction % GGUF_BLOCK:
        raise ValueError(f"quantization='gguf' needs contraction sizes that are multiples of {GGUF_BLOCK}, "
                         f"got {contraction}")
    return GGUF_BLOCK


def has_offset(method: str | None) -> bool:
    return method == "gguf"


# ---------------------------------------------------------------------------------------------
# Which format runs on this backend
# ---------------------------------------------------------------------------------------------
def resolve_method(method: str | None, device) -> str | None:
    """`method` where this device can run it. fp8 weights need fp8 matrix units (NVIDIA compute
    capability 8.9+, TPU v7); elsewhere the int8 format takes its place (same bytes), said in
    the log. "mxfp4" and "none" (the experts' packed format, or floats throughout) are the
    loader's to apply (orca_jax/loading/loader.py) and run anywhere."""
    if method in EXPERT_METHODS:
        return method
    check_method(method)
    if method != "fp8" or has_fp8_matmul(device):
        return method
    logger.warning("quantization='fp8': %s has no fp8 matrix units; using int8 weights (same size, "
                   "per-channel scales) instead", getattr(device, "device_kind", device.platform))
    return "int8"


def has_fp8_matmul(device) -> bool:
    if device.platform == "gpu":
        return (gpu_info.compute_capability(device) or 0) >= gpu_info.FP8_MATMUL_MIN_CAPABILITY
    if device.platform == "tpu":
        kind = device.device_kind.lower()
        return "v7" in kind or "7x" in kind
    return False


# ---------------------------------------------------------------------------------------------
# Quantizing (numpy, once at load time)
# ---------------------------------------------------------------------------------------------
def quantize_kernel(w: np.ndarray, num_lead: int, num_contract: int, method: str) -> dict[str, np.ndarray]:
    """A float kernel [*lead, *contract, *out] (lead: stacked layers) -> {"kernel", "qscale"[,
    "qzero"]} with qscale/qzero [*lead, G, *out]."""
    lead, contract, out = w.shape[:num_lead], w.shape[num_lead:num_lead + num_contract], w.shape[num_lead + num_contract:]
    k = math.prod(contract)
    g = group_size(method, k)
    # [*lead, G, group, O]: groups along the flattened contraction, output channels last.
    blocks = np.asarray(w, np.float32).reshape(*lead, k // g, g, math.prod(out))
    values, scale, zero = _quantize_blocks(blocks, method, axis=-2)
    quantized = {"kernel": values.reshape(w.shape),
                 "qscale": scale.reshape(*lead, k // g, *out)}
    if zero is not None:
        quantized["qzero"] = zero.reshape(*lead, k // g, *out)
    return quantized


def quantize_rows(table: np.ndarray, method: str) -> dict[str, np.ndarray]:
    """An embedding table [V, D] -> {"values" [V, D], "qscale" [V, G][, "qzero" [V, G]]}, groups
    along D."""
    v, d = table.shape
    g = group_size(method, d)
    blocks = np.asarray(table, np.float32).reshape(v, d // g, g)
    values, scale, zero = _quantize_blocks(blocks, method, axis=-1)
    quantized = {"values": values.reshape(v, d), "qscale": scale.reshape(v, d // g)}
    if zero is not None:
        quantized["qzero"] = zero.reshape(v, d // g)
    return quantized


def _quantize_blocks(blocks: np.ndarray, method: str, axis: int):
    """Quantize along `axis` of float32 `blocks`: (values, scale, zero or None), scale and zero
    with `axis` dropped."""
    if method == "gguf":
        return _quantize_gguf_blocks(blocks, axis)
    limit = INT8_MAX if method == "int8" else FP8_MAX
    amax = np.max(np.abs(blocks), axis=axis, keepdims=True)
    scale = (amax / limit).astype(SCALE_DTYPES[method])
    safe = np.where(scale == 0, 1, scale).astype(np.float32)
    scaled = np.clip(blocks / safe, -limit, limit)
    values = np.rint(scaled).astype(np.int8) if method == "int8" else scaled.astype(VALUE_DTYPES[method])
    return values, np.squeeze(scale, axis), None


def _quantize_gguf_blocks(blocks: np.ndarray, axis: int):
    """GGUF blocks kept as the file had them. A block whose values lie on a 16-level grid from
    its minimum (Q4_1; the loader dequantized it exactly) keeps those 4-bit levels with the grid
    step and minimum; any other block (Q8_0 and finer types, Q4_0) becomes symmetric int8 with
    scale amax / 127 (Q8_0's own rule, so Q8_0 blocks come back bit for bit)."""
    lo = np.min(blocks, axis=axis, keepdims=True)
    hi = np.max(blocks, axis=axis, keepdims=True)
    # float16 scales and offsets, as GGUF stores them; the levels are fitted to the rounded ones.
    step = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    lo16 = lo.astype(np.float16).astype(np.float32)
    levels = np.clip(np.rint((blocks - lo16) / np.where(step == 0, 1, step)), 0, 15)
    grid_error = np.max(np.abs(levels * step + lo16 - blocks), axis=axis, keepdims=True)
    amax = np.maximum(np.abs(lo), np.abs(hi))
    on_grid = grid_error <= 1e-3 * np.maximum(step, 1e-30) + 1e-7 * amax

    scale8 = (amax / INT8_MAX).astype(np.float16).astype(np.float32)
    ints = np.clip(np.rint(blocks / np.where(scale8 == 0, 1, scale8)), -INT8_MAX, INT8_MAX)
    values = np.where(on_grid, levels, ints).astype(np.int8)
    scale = np.where(on_grid, step, scale8).astype(np.float16)
    zero = np.where(on_grid, lo16, 0).astype(np.float16)
    return values, np.squeeze(scale, axis), np.squeeze(zero, axis)


def dequantize_kernel_np(quantized: dict[str, np.ndarray], num_lead: int) -> np.ndarray:
    """float32 weight of `quantize_kernel`'s output (tests, and checkpoints read back as floats)."""
    values, scale = quantized["kernel"], quantized["qscale"]
    lead = values.shape[:num_lead]
    num_groups = scale.shape[num_lead]
    out_shape = scale.shape[num_lead + 1:]
    blocks = values.astype(np.float32).reshape(*lead, num_groups, -1, math.prod(out_shape))
    w = blocks * scale.astype(np.float32).reshape(*lead, num_groups, 1, -1)
    if "qzero" in quantized:
        w = w + quantized["qzero"].astype(np.float32).reshape(*lead, num_groups, 1, -1)
    return w.reshape(values.shape)


# ---------------------------------------------------------------------------------------------
# Computing with them (jnp, inside the step)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantizedKernel:
    """A quantized Einsum kernel as the step sees it (see the module docstring)."""

    values: jax.Array  # [*contract, *out]
    scale: jax.Array  # [G, *out]
    zero: jax.Array | None  # [G, *out] or None

    def dequantize(self, dtype) -> jax.Array:
        """The float weight, group by group."""
        num_groups = self.scale.shape[0]
        out_shape = self.scale.shape[1:]
        blocks = self.values.astype(dtype).reshape(num_groups, -1, *out_shape)
        w = blocks * self.scale.astype(dtype)[:, None]
        if self.zero is not None:
            w = w + self.zero.astype(dtype)[:, None]
        return w.reshape(self.values.shape)


def einsum(spec: str, x: jax.Array, kernel: jax.Array | QuantizedKernel, preferred_element_type=None) -> jax.Array:
    """`jnp.einsum(spec, x, kernel)` for a float or a quantized kernel. With one group (per
    output channel) the scale multiplies the product's output instead of the weight, so the
    kernel is only converted. Whether the conversion fuses into the product is the backend's
    choice: XLA:CPU converts each layer's weight into a float temporary next to the dot (per
    layer, never the stacked weights; docs/benchmarks.md, "Quantized weights and KV cache")."""
    if not isinstance(kernel, QuantizedKernel):
        return jnp.einsum(spec, x, kernel, preferred_element_type=preferred_element_type)
    if kernel.scale.shape[0] == 1 and kernel.zero is None:
        y = jnp.einsum(spec, x, kernel.values.astype(x.dtype), preferred_element_type=preferred_element_type)
        return y * kernel.scale[0].astype(y.dtype)
    return jnp.einsum(spec, x, kernel.dequantize(x.dtype), preferred_element_type=preferred_element_type)


@dataclass(frozen=True)
class QuantizedTable:
    """A quantized embedding table [V, D]: rows are output channels, groups along D."""

    values: jax.Array  # [V, D]
    scale: jax.Array  # [V, G]
    zero: jax.Array | None  # [V, G] or None

    def take(self, ids: jax.Array, dtype) -> jax.Array:
        """Rows `ids` as floats: [T, D]."""
        return _dequantize_rows(jnp.take(self.values, ids, axis=0), jnp.take(self.scale, ids, axis=0),
                                None if self.zero is None else jnp.take(self.zero, ids, axis=0), dtype)

    def logits(self, h: jax.Array) -> jax.Array:
        """h [S, D] against every row (a tied LM head): f32 [S, V]."""
        if self.scale.shape[1] == 1 and self.zero is None:
            y = jnp.einsum("SD,VD->SV", h, self.values.astype(h.dtype), preferred_element_type=jnp.float32)
            return y * self.scale[:, 0].astype(jnp.float32)
        table = _dequantize_rows(self.values, self.scale, self.zero, h.dtype)
        return jnp.einsum("SD,VD->SV", h, table, preferred_element_type=jnp.float32)


def _dequantize_rows(values, scale, zero, dtype):
    rows, d = values.shape
    num_groups = scale.shape[1]
    blocks = values.astype(dtype).reshape(rows, num_groups, d // num_groups) * scale.astype(dtype)[:, :, None]
    if zero is not None:
        blocks = blocks + zero.astype(dtype)[:, :, None]
    return blocks.reshape(rows, d)


def table_logits(h: jax.Array, table: jax.Array | QuantizedTable) -> jax.Array:
    """h [S, D] against every row of an embedding table (a tied LM head): f32 [S, V]."""
    if isinstance(table, QuantizedTable):
        return table.logits(h)
    return jnp.einsum("SD,VD->SV", h, table, preferred_element_type=jnp.float32)


def take_rows(table: jax.Array | QuantizedTable, ids: jax.Array, dtype) -> jax.Array:
    if isinstance(table, QuantizedTable):
        return table.take(ids, dtype)
    return jnp.take(table, ids, axis=0)


def is_quantization_leaf(name: str) -> bool:
    """Scales and offsets keep their own dtype when the model's weights are cast."""
    return name.endswith(("qscale", "qzero"))


def stored_dtype(name: str, leaf_dtype, model_dtype):
    """The dtype a parameter is placed in: floats in the model dtype, but quantized values
    (int8, fp8) and their scales and offsets as they are."""
    leaf_dtype = np.dtype(leaf_dtype)
    if is_quantization_leaf(name) or not np.issubdtype(leaf_dtype, np.floating) or leaf_dtype.itemsize == 1:
        return leaf_dtype
    return np.dtype(model_dtype)
