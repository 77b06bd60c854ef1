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

How a weight gets its sharding: the model declares each weight's logical axes where it
creates it (`nn.with_logical_partitioning`: "vocab", "heads", "kv_heads", "mlp", "embed", ...;
the layer scan puts "layers" in front), `orca_jax.models.logical_specs(config)` reads them off
the model's abstract init once per config, and `LOGICAL_AXIS_RULES` maps each name to the mesh
axis or to none. `param_shardings` applies them to any tree of the model's shape (a loader's
numpy arrays, a checkpoint's metadata), so converted weights and restored checkpoints are
placed by the same function; `repeat_kv_heads` finds the K/V weights by their "kv_heads" axis,
on the host and on device alike. No parameter path is spelled here.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from orca_jax.kernels import quantization
from orca_jax.kernels import grouped_mlp, packed4
from orca_jax.kernels.lowering_target import target_backend
from orca_jax.config import ModelConfig

logger = logging.getLogger(__name__)

MODEL_AXIS = "model"

# Which logical axis of a weight is split over the mesh: the one table. Each weight names its
# axes where the model declares it (`nn.with_logical_partitioning` in orca_jax/models/: the
# `axes` of Einsum and of the norms, the embeddings' own), and the layer scan adds "layers" in
# front of the stacked weights. A name absent from this table is an error, so a new family
# with a new axis fails loudly instead of running unsharded.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", MODEL_AXIS),  # embedding [V, D], LM head [D, V]: vocabulary-parallel
    ("heads", MODEL_AXIS),  # Q projection (column-parallel), attention output (row-parallel)
    ("kv_heads", MODEL_AXIS),  # K, V projections (heads repeated first when fewer than devices)
    ("mlp", MODEL_AXIS),  # the MLP's intermediate axis: gate/up/fc column-, down/proj row-parallel
    ("embed", None),  # the hidden axis: whole on every device (norms, output biases)
    ("head_dim", None),  # within a head (Q/K norms)
    ("positions", None),  # GPT-2's learned position table (small)
    ("layers", None),  # the stacked layer axis (pipeline stages would split this one)
    # Mixture of experts (orca_jax/models/moe.py). Tensor parallelism: every device holds every
    # expert ("experts", and the router's expert axis) and a slice of each one's "mlp" axis.
    # Expert parallelism: each device holds whole experts ("sharded_experts"), not split inside
    # ("expert_mlp").
    ("experts", None),
    ("sharded_experts", MODEL_AXIS),
    ("expert_mlp", None),
    # A quantized weight's one group of per-channel scales (orca_jax.kernels.quantization); GGUF's
    # blocks take the name of the contraction axis they divide, and shard with it.
    ("quant_groups", None),
)
KV_HEADS = "kv_heads"  # the axis that `repeat_kv_heads` repeats


# ---- the mesh and the head layout ------------------------------------------------------------
def make_mesh(tensor_parallel_size: int, devices=None, *, replica: bool = False) -> Mesh:
    """A 1-D mesh of `tensor_parallel_size` devices named "model".

    With several processes (multi-host) the mesh of the one engine must span every device of
    every process: all of them run each step. `replica`: `devices` are a data-parallel
    replica's, all of this process, and the mesh is theirs alone."""
    whole_world = not replica
    devices = list(devices) if devices is not None else jax.devices()
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} devices, "
            f"but JAX sees {len(devices)} ({devices[0].platform}); on CPU, force more with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tensor_parallel_size}"
        )
    if jax.process_count() > 1 and whole_world and tensor_parallel_size != len(devices):
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


def expert_layout(model: ModelConfig, tensor_parallel_size: int, expert_parallel: bool) -> ModelConfig:
    """The config of the model as placed on a mesh of `tensor_parallel_size`: for a mixture of
    experts, whether its experts are split whole over the devices (`expert_parallel`) or each
    split along its intermediate axis. Raises ValueError for a layout the sizes do not allow,
    and for expert parallelism on a dense model."""
    if not model.is_moe:
        if expert_parallel:
            raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model; {model.model_type} is dense")
        return model
    tp = tensor_parallel_size
    if expert_parallel and model.num_experts % tp:
        raise ValueError(f"expert parallelism over {tp} devices needs the experts ({model.num_experts}) to divide "
                         f"by it; use a tensor_parallel_size that divides {model.num_experts}, or leave "
                         f"enable_expert_parallel off to split each expert instead")
    if not expert_parallel and model.moe_intermediate_size % tp:
        raise ValueError(f"tensor parallelism over {tp} devices splits each expert's intermediate axis "
                         f"({model.moe_intermediate_size}), which does not divide by it; enable_expert_parallel "
                         f"places whole experts instead")
    if not expert_parallel and model.expert_format is not None and tp > 1:
        block = packed4.packed_format(model.expert_format).block_size
        if (model.moe_intermediate_size // block) % tp:
            raise ValueError(f"tensor parallelism over {tp} devices splits each {model.expert_format} expert's "
                             f"down projection along its packed axis: {model.moe_intermediate_size // block} blocks "
                             f"of {block}, which do not divide by {tp}; enable_expert_parallel places whole experts "
                             f"instead")
    if tp == 1:
        layout = "one device"
    elif expert_parallel:
        layout = f"expert-parallel, {model.num_experts // tp} whole experts on each of {tp} devices"
    else:
        layout = f"tensor-parallel, 1/{tp} of every expert's width on each device"
    logger.info("mixture of experts: %d experts, top-%d per token, grouped matmuls by %s; %s", model.num_experts,
                model.num_experts_per_tok, grouped_mlp.resolve_impl("auto", target_backend()), layout)
    return dataclasses.replace(model, expert_parallel=expert_parallel)


def repeat_kv_heads(params: dict, logical: dict, repeats: int, xp=np) -> dict:
    """Repeat the heads of every weight with a "kv_heads" axis (the K/V projections and their
    biases, as the model declares them) `repeats` times, consecutively: head j becomes heads
    j*r .. j*r + r - 1, so query head n's KV head is still n // group. The one place that knows
    which weights hold KV heads and on which axis.

    `xp` is the array module: numpy for host arrays (the default), jax.numpy for device arrays
    (inside jit, see `checkpoint.Checkpoint.restore`). Works in place on the nested dicts of
    `params` ({"params": ...}, the tree the model's init makes), so each replaced host array is
    dropped; returns `params`. `logical`: the model's logical specs
    (`orca_jax.models.logical_specs(config)`)."""
    if repeats == 1:
        return params
    logical = logical["params"]

    def repeat(tree: dict, specs: dict, prefix: str) -> None:
        for key, value in tree.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                repeat(value, _declared(specs, key, name), f"{name}/")
            elif (axis := kv_head_axis(_declared(specs, key, name))) is not None:
                tree[key] = xp.repeat(value, repeats, axis=axis)

    repeat(params["params"], logical, "")
    return params


def kv_head_axis(logical: P) -> int | None:
    """The axis of a weight's KV heads, from its logical axes (None: it has none)."""
    names = tuple(logical)
    return names.index(KV_HEADS) if KV_HEADS in names else None


# ---- where each weight lives ---------------------------------------------------------------
def logical_specs(variables: dict) -> dict:
    """{"params": tree of PartitionSpecs of logical axis names}, read off a model's variables as
    its init makes them (boxed, `nn.LogicallyPartitioned`; the abstract ones of
    `jax.eval_shape` do). Raises ValueError naming a parameter that declares no logical axes,
    declares a number of them other than its rank, or uses a name LOGICAL_AXIS_RULES lacks."""
    rules = dict(LOGICAL_AXIS_RULES)

    def spec(path, leaf) -> P:
        name = "/".join(str(getattr(key, "key", key)) for key in path)
        if not isinstance(leaf, nn.LogicallyPartitioned):
            raise ValueError(
                f"parameter {name} declares no logical axes: declare them with nn.with_logical_partitioning "
                f"(or the `axes` of Einsum and the norms) so that parallel.LOGICAL_AXIS_RULES can place it"
            )
        names, shape = tuple(leaf.names), tuple(leaf.value.shape)
        if len(names) != len(shape):
            raise ValueError(f"parameter {name} of shape {shape} declares {len(names)} logical axes {names}")
        unknown = [axis for axis in names if axis not in rules]
        if unknown:
            raise ValueError(
                f"parameter {name} has logical axes {unknown} that parallel.LOGICAL_AXIS_RULES does not map "
                f"(it maps {', '.join(rules)})"
            )
        return P(*names)

    specs = jax.tree_util.tree_map_with_path(
        spec, variables["params"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )
    return {"params": specs}


def param_spec(name: str, logical: P, shape: tuple[int, ...], mesh_size: int) -> P:
    """PartitionSpec of the parameter `name` (named in messages) from its logical axes, through
    LOGICAL_AXIS_RULES. A weight with a split axis that does not divide by the mesh size is
    replicated instead (with a warning), and so is one without a split axis: P()."""
    if len(logical) != len(shape):
        raise ValueError(f"parameter {name} of shape {shape} does not match its logical axes {logical}")
    axes = tuple(mesh_spec(tuple(logical)))
    split = [axis for axis in axes if axis is not None]
    if len(split) != len(set(split)):
        raise ValueError(f"parameter {name}: logical axes {logical} put one mesh axis on two dimensions")
    if not split:
        return P()
    if any(axis is not None and dim % mesh_size for axis, dim in zip(axes, shape)):
        logger.warning("parameter %s %s does not divide by %d devices: replicated", name, shape, mesh_size)
        return P()
    return P(*axes)


def param_specs(params: dict, logical: dict, mesh_size: int, *, whole_kv_heads: bool = False) -> dict:
    """PartitionSpec of every leaf of a {"params": ...} tree whose leaves need only `.shape`
    (a loader's numpy arrays, orbax's metadata of a checkpoint, abstract arrays), from the
    logical axes the model declares (`logical`: `orca_jax.models.logical_specs(config)`).
    `whole_kv_heads`: weights with KV heads stay whole (P()), to be repeated on device and
    sharded afterwards."""
    logical = logical["params"]

    def spec(name: str, leaf) -> P:
        declared = _declared_at(logical, name)
        if whole_kv_heads and kv_head_axis(declared) is not None:
            return P()
        return param_spec(name, declared, tuple(leaf.shape), mesh_size)

    return {"params": map_with_path(spec, params["params"])}


def param_shardings(params: dict, mesh: Mesh, logical: dict, *, whole_kv_heads: bool = False) -> dict:
    """NamedSharding of every leaf of a {"params": ...} tree (see `param_specs`)."""
    specs = param_specs(params, logical, mesh.shape[MODEL_AXIS], whole_kv_heads=whole_kv_heads)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


def _declared_at(logical: dict, name: str) -> P:
    node = logical
    for key in name.split("/"):
        node = _declared(node, key, name)
    return node


def _declared(specs, key: str, name: str):
    if not isinstance(specs, dict) or key not in specs:
        raise ValueError(f"parameter {name} is not one the model declares")
    return specs[key]


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


def place_params(params: dict, shardings: dict, dtype) -> dict:
    """Numpy weights -> sharded jax.Arrays, each device receiving only its own slice (this
    also works across processes, each placing its local devices' slices). Consumes `params`:
    each host array is dropped once placed."""
    def place(tree: dict, sharding_tree: dict) -> dict:
        for key in list(tree):
            if isinstance(tree[key], dict):
                tree[key] = place(tree[key], sharding_tree[key])
            else:  # replacing the entry drops the host array; quantized leaves keep their dtype
                leaf_dtype = quantization.stored_dtype(key, np.asarray(tree[key]).dtype, dtype)
                tree[key] = _put_sharded(np.asarray(tree[key], leaf_dtype), sharding_tree[key])
        return tree

    return place(params, shardings)


def _put_sharded(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def is_process_local(mesh: Mesh | None) -> bool:
    """True when this process owns every device of `mesh` (one device, a replica's mesh), so
    no other process takes part in its programs."""
    if mesh is None:
        return jax.process_count() == 1
    return all(d.process_index == jax.process_index() for d in mesh.devices.flat)


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
    """Run `attend(q, k, v, kv_pages, metadata, window, sinks) -> (out, kv_pages)` on each
    device's own heads: q [T, N, H], k/v [T, K, H] and out sharded over heads, the flat cache
    [pages, page, 2K, H] over its head slots, metadata (a pytree of index arrays) and the
    layer's traced window (i32[] or None) replicated, the sinks [N] (or None) with their heads.

    check_vma is off: the kernels inside (Pallas calls among them) are written for one device
    and need not declare how their values vary over the mesh; the specs above say it."""
    heads = P(None, MODEL_AXIS, None)
    pages = P(None, None, MODEL_AXIS, None)
    return jax.shard_map(
        attend, mesh=mesh, in_specs=(heads, heads, heads, pages, P(), P(), P(MODEL_AXIS)), out_specs=(heads, pages),
        check_vma=False,
    )


def mesh_spec(logical_axes: tuple[str, ...]) -> P:
    """The PartitionSpec over the mesh of an array with these logical axes (one layer's weight
    inside the layer scan, say), through LOGICAL_AXIS_RULES."""
    rules = dict(LOGICAL_AXIS_RULES)
    return P(*(rules[axis] for axis in logical_axes))


# ---- experts per shard -----------------------------------------------------------------------
def per_shard_experts(mesh: Mesh, expert_specs: Any, expert_parallel: bool, routed: Callable) -> Callable:
    """Run a mixture-of-experts layer's routed experts on each device's share of them and sum
    the shares: `routed(x, weights, experts, num_tokens, expert_weights, first_expert=) -> [T, D]`
    sees the whole activations and routing (replicated) and this device's expert weights (a
    pytree, each leaf placed as its PartitionSpec in `expert_specs`, the same structure): all
    experts with a slice of each intermediate axis (tensor parallelism), or whole experts
    numbered from `first_expert` (expert parallelism). One all-reduce of [T, D] combines them
    (see orca_jax/models/moe.py for why not an all-to-all)."""
    def local(x, weights, experts, num_tokens, expert_weights):
        num_local = jax.tree.leaves(expert_weights)[0].shape[0]
        first = jax.lax.axis_index(MODEL_AXIS) * num_local if expert_parallel else 0
        return jax.lax.psum(routed(x, weights, experts, num_tokens, expert_weights, first_expert=first), MODEL_AXIS)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P(), expert_specs),
                         out_specs=P(), check_vma=False)
