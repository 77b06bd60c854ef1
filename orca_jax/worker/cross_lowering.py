"""A runner's step programs lowered for a TPU or an NVIDIA GPU on a host that has neither.

Why: the steps run on CPU in every test, but the TPU and CUDA programs are different programs
(jax's Pallas TPU kernel, the Triton GPU kernel, `ragged_dot` for the experts), and a shape or
dtype those lowerings refuse would first show on a user's TPU VM or GPU server. jax lowers a
jitted function for any platform (`lowering_platforms`); what it needs from the machine is the
device kind its kernels choose by, which an abstract mesh with an abstract device supplies
(jax's TPU lowering reads `tpu_info` from it, its Triton lowering the compute capability, and
orca_jax's own trace-time choices read it through `kernels.lowering_target`).

    steps = lower_steps(runner, TPU_V5E)       # {token bucket: jax.stages.Lowered}
    custom_calls(steps[16])                    # {"tpu_custom_call", ...}

Programs partitioned over a mesh keep it: the runner's mesh (N forced CPU devices for
tensor parallelism N) becomes an abstract mesh of N target devices, the model's `shard_map`s
and the arguments' NamedShardings move onto it, so the program is partitioned for N chips as
it would be on N TPUs (what XLA's partitioner then makes of it is the compile's, not checked).

What lowering cannot check without the device: XLA's compile for it (memory, the Mosaic or
Triton compile of the kernels' bodies: `kernels/triton_compile.py` takes the Triton IR on to
ptxas for GPUs; Mosaic has no host-side compiler), and anything numerical. The runner is a
real one, built on this host's devices: its weights, cache, state and shardings give the shapes
and the partitioning, its attention kernel does not matter (the model is built again with the
target's).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from orca_jax.kernels.triton_compile import TRITON_CUSTOM_CALL
from orca_jax.models import architecture
from orca_jax.worker.batch_state import empty_step_inputs


@dataclass(frozen=True)
class Target:
    """A platform to lower for: jax's platform name, a device kind as jax spells it (its
    kernels' tuning tables are keyed by it), and the attention kernel that serves there."""
    platform: str  # "tpu" or "cuda"
    device_kind: str
    attention_impl: str


TPU_V5E = Target("tpu", "TPU v5 lite", "pallas_tpu")
TPU_V6E = Target("tpu", "TPU v6 lite", "pallas_tpu")
H100 = Target("cuda", "NVIDIA H100", "pallas_gpu")
# The custom calls the targets' attention kernels lower to.
KERNEL_CALLS = {"pallas_tpu": "tpu_custom_call", "pallas_gpu": TRITON_CUSTOM_CALL}


def abstract_mesh(target: Target, mesh: jax.sharding.Mesh | None) -> jax.sharding.AbstractMesh:
    """The runner's mesh (or one device) as an abstract mesh of `target`'s devices."""
    device = jax.sharding.AbstractDevice(device_kind=target.device_kind, num_cores=1 if target.platform == "tpu"
                                         else None, platform=target.platform)
    if mesh is None:
        return jax.sharding.AbstractMesh((1,), ("device",), (jax.sharding.AxisType.Auto,), abstract_device=device)
    return jax.sharding.AbstractMesh(tuple(mesh.shape.values()), tuple(mesh.axis_names),
                                     tuple(jax.sharding.AxisType.Auto for _ in mesh.axis_names),
                                     abstract_device=device)


def lower_steps(runner, target: Target, buckets: Sequence[int] | None = None) -> dict[int, jax.stages.Lowered]:
    """Each token bucket's step of `runner` (a ModelRunner, or anything with its `model_config`,
    `dtype`, `mesh`, `params`, `kv_cache`, `state`, `config` and `step_function`) lowered for
    `target`, nothing compiled. The model is built again with the target's attention kernel
    and the runner's mesh made abstract over the target's devices; the arguments are the
    runner's shapes, dtypes and partitioning."""
    step, mesh = _target_step(runner, target)
    lowered = {}
    with jax.sharding.use_abstract_mesh(mesh):
        for bucket in buckets or runner.config.token_buckets:
            lowered[bucket] = step.trace(*_abstract_args(runner, mesh, bucket)).lower(
                lowering_platforms=(target.platform,))
    return lowered


def export_steps(runner, target: Target, buckets: Sequence[int] | None = None) -> dict[int, jax.export.Exported]:
    """`lower_steps` as `jax.export` artifacts (serializable, `Exported.serialize()`), which a
    process on the target could call without tracing the model."""
    step, mesh = _target_step(runner, target)
    exported = {}
    with jax.sharding.use_abstract_mesh(mesh):
        for bucket in buckets or runner.config.token_buckets:
            exported[bucket] = jax.export.export(step, platforms=(target.platform,))(
                *_abstract_args(runner, mesh, bucket))
    return exported


def _target_step(runner, target: Target):
    mesh = abstract_mesh(target, runner.mesh)
    model = architecture(runner.model_config.model_type).model_class(
        runner.model_config, target.attention_impl, runner.dtype, mesh=None if runner.mesh is None else mesh)
    return jax.jit(runner.step_function(model), donate_argnums=(1, 2)), mesh


def _abstract_args(runner, mesh, bucket: int) -> tuple:
    inputs = jax.tree.map(jnp.asarray, empty_step_inputs(runner.config, bucket))
    return jax.tree.map(functools.partial(_abstract, mesh), (runner.params, runner.kv_cache, runner.state, inputs))


def _abstract(mesh: jax.sharding.AbstractMesh, array) -> jax.ShapeDtypeStruct:
    """An array's shape and dtype, its NamedSharding moved onto the abstract mesh."""
    sharding = getattr(array, "sharding", None)
    moved = NamedSharding(mesh, sharding.spec) if isinstance(sharding, NamedSharding) else None
    return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=moved)


def custom_calls(lowered: jax.stages.Lowered) -> set[str]:
    """The custom-call targets in a lowered program (kernels, and XLA's own helpers)."""
    return set(re.findall(r"custom_call @([\w$.]+)", lowered.as_text()))
