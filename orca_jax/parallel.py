"""Tensor parallelism on a JAX device mesh: the mesh, where each weight lives, and attention
run per shard.

One mesh axis, "model", of `tensor_parallel_size` devices (Megatron-style, as in Orca's
intra-layer parallelism):

- Q, K, V projections are column-parallel (sharded over heads), and so are the MLP's gate/up
  (fc for GPT-2) projections (sharded over the intermediate axis); no communication.
- The attention output and MLP down (proj) projections are row-parallel: each device holds
  the rows of its own heads / intermediate slice and produces a partial sum; XLA's partitioner
  inserts one all-reduce after each, so a layer costs two all-reduces.
- Embedding table and LM head are sharded over the vocabulary (when it divides by the mesh
  size, else replicated). They are the largest single weights (128k x 4096 for Llama 3), and
  a tied model uses one table for both, so vocabulary sharding saves the most memory with one
  rule. The lookup becomes a masked local gather plus an all-reduce; the head produces
  vocabulary-sharded logits, gathered before sampling so that every device samples the same
  tokens from the same full rows as a single device would.
- Norms, biases of row-parallel layers and learned positions are replicated (small).
- The KV cache `[L, P, page, 2K, H]` is sharded on axis 3: each device holds its own KV heads
  with their K/V slot pairs intact. Attention (`write_kv` + `ragged_paged_attention`) runs
  through `shard_map`, so whatever kernel implementation is chosen sees a plain local cache
  and the query heads that read it. Batch metadata is replicated.

KV heads that do not divide by the mesh size: when the mesh size is a multiple of them, each
KV head is stored `tp / num_kv_heads` times (consecutive copies, so query head n still reads
KV head n // group), one per device, as vLLM does; otherwise the configuration is refused.
Query heads must divide by the mesh size.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from orca_jax.config import ModelConfig

logger = logging.getLogger(__name__)

MODEL_AXIS = "model"

# Spec per parameter, by the path of its name in the Flax tree (without the leading
# layer axis of the stacked "layers/..." parameters). Dimension names of each weight:
# q/k/v kernel [D, heads, H], o kernel [heads, H, D], gate/up/fc [D, F], down/proj [F, D].
_COLUMN_HEADS = (None, MODEL_AXIS, None)
_SHARDING_RULES: tuple[tuple[str, tuple], ...] = (
    (r"^embed$", (MODEL_AXIS, None)),  # [V, D]
    (r"^lm_head$", (None, MODEL_AXIS)),  # [D, V]
    (r"attn/[qkv]_proj/kernel$", _COLUMN_HEADS),
    (r"attn/[qkv]_proj/bias$", (MODEL_AXIS, None)),  # [heads, H]
    (r"attn/o_proj/kernel$", (MODEL_AXIS, None, None)),
    (r"mlp/(gate_proj|up_proj|fc)/kernel$", (None, MODEL_AXIS)),
    (r"mlp/(gate_proj|up_proj|fc)/bias$", (MODEL_AXIS,)),  # [F]
    (r"mlp/(down_proj|proj)/kernel$", (MODEL_AXIS, None)),
)
# Everything else (norm scales, o_proj / down_proj biases, q/k norms, learned positions) is
# replicated: an unmatched path gets P().


# ---- the mesh and the head layout ------------------------------------------------------------
def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """A 1-D mesh of `tensor_parallel_size` devices named "model".

    With several processes (multi-host) the mesh must span every device of every process:
    all of them run each step, and there is no data-parallel axis to put spare ones on."""
    devices = list(devices) if devices is not None else jax.devices()
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} devices, "
            f"but JAX sees {len(devices)} ({devices[0].platform}); on CPU, force more with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tensor_parallel_size}"
        )
    if jax.process_count() > 1 and tensor_parallel_size != len(devices):
        raise ValueError(
            f"with {jax.process_count()} processes, tensor_parallel_size must equal the number of "
            f"devices of all processes ({len(devices)}), got {tensor_parallel_size}"
        )
    # Auto axis: weights and the cache carry NamedShardings, and XLA's partitioner derives the
    # collectives; only attention is written per shard (shard_map).
    return jax.make_mesh((tensor_parallel_size,), (MODEL_AXIS,), axis_types=(AxisType.Auto,),
                         devices=devices[:tensor_parallel_size])


def kv_head_repeats(model: ModelConfig, tensor_parallel_size: int) -> int:
    """How many copies of each KV head the sharded model stores (1: none). Raises ValueError
    for a head count the mesh cannot split."""
    tp, n_q, n_kv = tensor_parallel_size, model.num_heads, model.num_kv_heads
    if n_q % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the number of query heads ({n_q})")
    if n_kv % tp == 0:
        return 1
    if tp % n_kv == 0:
        return tp // n_kv
    raise ValueError(
        f"tensor_parallel_size={tp} and num_kv_heads={n_kv}: the KV heads neither divide by the "
        f"mesh size nor divide it (so they cannot be replicated evenly); use a size that divides "
        f"{n_kv} or a multiple of it that divides {n_q}"
    )


def sharded_model_config(model: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The config the sharded model is built with: KV heads counted after replication."""
    repeats = kv_head_repeats(model, tensor_parallel_size)
    if repeats == 1:
        return model
    logger.info("tensor parallelism: %d KV heads replicated %dx, one per device", model.num_kv_heads, repeats)
    return dataclasses.replace(model, num_kv_heads=model.num_kv_heads * repeats)


def replicate_kv_heads(params: dict, repeats: int) -> dict:
    """Repeat every K/V projection's heads `repeats` times, consecutively (numpy, in place):
    head j becomes heads j*r .. j*r + r - 1, so query head n's KV head is still n // group."""
    if repeats == 1:
        return params
    attn = params["params"]["layers"]["attn"]
    for name in ("k_proj", "v_proj"):
        weights = attn[name]
        weights["kernel"] = np.repeat(weights["kernel"], repeats, axis=2)  # [L, D, K, H]
        if "bias" in weights:
            weights["bias"] = np.repeat(weights["bias"], repeats, axis=1)  # [L, K, H]
    return params


# ---- where each weight lives ---------------------------------------------------------------
def param_spec(path: str, shape: tuple[int, ...], mesh_size: int) -> P:
    """PartitionSpec of the parameter at `path` ("layers/attn/q_proj/kernel", "embed", ...).
    Stacked layer parameters keep their leading layer axis unsharded. A dimension that does
    not divide by the mesh size is not sharded (the weight is replicated instead)."""
    stacked = path.startswith("layers/")
    name = path.removeprefix("layers/")
    for pattern, spec in _SHARDING_RULES:
        if re.search(pattern, name):
            full = ((None,) if stacked else ()) + spec
            if len(full) != len(shape):
                raise ValueError(f"parameter {path} of shape {shape} does not match its rule {spec}")
            if any(axis == MODEL_AXIS and dim % mesh_size for axis, dim in zip(full, shape)):
                logger.warning("parameter %s %s does not divide by %d devices: replicated", path, shape, mesh_size)
                return P()
            return P(*full)
    return P()


def tree_paths(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Flatten a nested dict to {"a/b/c": leaf}."""
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else key
        flat.update(tree_paths(value, path) if isinstance(value, dict) else {path: value})
    return flat


def map_with_path(fn: Callable[[str, Any], Any], tree: dict, prefix: str = "") -> dict:
    """Like jax.tree.map over a nested dict, with each leaf's "a/b/c" path."""
    return {
        key: map_with_path(fn, value, f"{prefix}/{key}" if prefix else key) if isinstance(value, dict)
        else fn(f"{prefix}/{key}" if prefix else key, value)
        for key, value in tree.items()
    }


def param_shardings(params: dict, mesh: Mesh) -> dict:
    """NamedSharding for every leaf of a {"params": ...} tree (leaves need only `.shape`)."""
    size = mesh.shape[MODEL_AXIS]
    return {"params": map_with_path(
        lambda path, leaf: NamedSharding(mesh, param_spec(path, tuple(leaf.shape), size)), params["params"]
    )}


def place_params(params: dict, shardings: dict, dtype) -> dict:
    """Numpy weights -> sharded jax.Arrays, each device receiving only its own slice (this
    also works across processes, each placing its local devices' slices). Consumes `params`:
    each host array is dropped once placed."""
    def place(tree: dict, sharding_tree: dict) -> dict:
        for key in list(tree):
            if isinstance(tree[key], dict):
                tree[key] = place(tree[key], sharding_tree[key])
            else:  # replacing the entry drops the host array
                tree[key] = _put_sharded(np.asarray(tree[key], dtype), sharding_tree[key])
        return tree

    return place(params, shardings)


def _put_sharded(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put_replicated(tree, mesh: Mesh):
    """Host arrays (the same on every process) -> global arrays whole on every device."""
    sharding = replicated(mesh)
    return jax.tree.map(lambda x: _put_sharded(np.asarray(x), sharding), tree)


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """[L, P, page, 2K, H] sharded over the KV-head slots: each device a block of whole heads."""
    return NamedSharding(mesh, P(None, None, None, MODEL_AXIS, None))


def gather_logits(mesh: Mesh, logits: jax.Array) -> jax.Array:
    """Inside jit: logits [S, V] computed vocabulary-sharded (each device its slice of the head),
    then gathered whole onto every device so sampling sees full rows. Pinning the first step
    matters: left alone, XLA may gather the [D, V] head weight instead of the [S, V] logits,
    moving the largest weight over the interconnect every step."""
    if logits.shape[-1] % mesh.shape[MODEL_AXIS] == 0:
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(None, MODEL_AXIS)))
    return jax.lax.with_sharding_constraint(logits, replicated(mesh))


# ---- attention per shard ---------------------------------------------------------------------
def per_shard_attention(mesh: Mesh, attend: Callable) -> Callable:
    """Run `attend(q, k, v, kv_pages, metadata) -> (out, kv_pages)` on each device's own heads:
    q [T, N, H], k/v [T, K, H] and out sharded over heads, the flat cache [pages, page, 2K, H]
    over its head slots, metadata (a pytree of index arrays) replicated.

    check_vma is off: the kernels inside (Pallas calls among them) are written for one device
    and need not declare how their values vary over the mesh; the specs above say it."""
    heads = P(None, MODEL_AXIS, None)
    pages = P(None, None, MODEL_AXIS, None)
    return jax.shard_map(
        attend, mesh=mesh, in_specs=(heads, heads, heads, pages, P()), out_specs=(heads, pages), check_vma=False,
    )
