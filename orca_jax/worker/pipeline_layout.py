"""Where a pipeline's stages live: the stage x model device mesh, which process owns each
stage (row), which contiguous slice of the layers each holds, and which of the weights.
orca_jax/worker/pipeline.py runs them; docs/parallelism.md has the design.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from orca_jax.distributed import parallel

STAGE_AXIS = "stage"


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer slices, one per stage. When the stages do not divide the layers, the
    first `num_layers % num_stages` stages take one layer more (the last stage also runs the
    LM head, so it is the one left lighter)."""
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={num_stages} exceeds the model's {num_layers} layers: "
                         "every stage needs at least one layer")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        size = base + (s < extra)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def make_pipeline_mesh(pipeline_parallel_size: int, tensor_parallel_size: int, devices=None, *,
                       replica: bool = False) -> Mesh:
    """The stage x model mesh: row s is stage s's devices, `tensor_parallel_size` of them.
    `replica`: `devices` are a data-parallel replica's, all of this process, rather than the
    one engine's of every process."""
    whole_world = not replica
    devices = list(devices) if devices is not None else jax.devices()
    needed = pipeline_parallel_size * tensor_parallel_size
    if needed > len(devices):
        raise ValueError(
            f"pipeline_parallel_size={pipeline_parallel_size} x tensor_parallel_size={tensor_parallel_size} needs "
            f"{needed} devices, but JAX sees {len(devices)} ({devices[0].platform}); on CPU, force more with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed}")
    if jax.process_count() > 1 and whole_world:
        # Multi-host: every device runs a stage (no data-parallel axis for spare ones), and each
        # row is one process's devices (in process order), so that a stage never spans hosts.
        if needed != len(devices):
            raise ValueError(
                f"with {jax.process_count()} processes, pipeline_parallel_size x tensor_parallel_size must equal "
                f"the number of devices of all processes ({len(devices)}), got {pipeline_parallel_size} x "
                f"{tensor_parallel_size}")
        grid = np.array(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(
            pipeline_parallel_size, tensor_parallel_size)
        mesh = Mesh(grid, (STAGE_AXIS, parallel.MODEL_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))
        stage_processes(mesh)  # refuse a stage across processes, naming it
        return mesh
    return jax.make_mesh((pipeline_parallel_size, tensor_parallel_size), (STAGE_AXIS, parallel.MODEL_AXIS),
                         axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[:needed])


def stage_processes(mesh: Mesh) -> list[int]:
    """The process that owns each stage (row) of the pipeline mesh. A row whose devices belong
    to several processes is refused: a stage's program runs on one process."""
    owners = []
    for s, row in enumerate(mesh.devices):
        processes = sorted({d.process_index for d in row.flat})
        if len(processes) > 1:
            raise ValueError(
                f"pipeline stage {s} spans processes {processes} (devices {[d.id for d in row.flat]}): every "
                f"stage's devices must belong to one process; make tensor_parallel_size ({row.size}) divide "
                f"each process's device count ({jax.local_device_count()})")
        owners.append(processes[0])
    return owners


def stage_mesh(mesh: Mesh, stage: int) -> Mesh:
    """Stage `stage`'s row of the pipeline mesh, as the 1-D "model" mesh tensor parallelism uses."""
    return Mesh(mesh.devices[stage], (parallel.MODEL_AXIS,), axis_types=(AxisType.Auto,))


def stage_holds(key: str, first: bool, last: bool, tied: bool) -> bool:
    """Whether a stage holds the top-level weight `key` (other than the stacked "layers", which
    every stage slices): the head ("final_norm", "lm_head*") on the last stage, the embedding
    tables on the first (and the last, when the head is tied to the token table)."""
    if key == "final_norm" or key.startswith("lm_head"):
        return last
    return first or (last and tied and key.startswith("embed"))


def slice_stage_params(params: dict, layers: range, first: bool, last: bool, tied: bool) -> dict:
    """A stage's part of a host {"params": ...} tree: its slice of every stacked layer weight,
    and the top-level weights it holds (`stage_holds`)."""
    stage: dict = {}
    for key, value in params["params"].items():
        if key == "layers":
            stage[key] = jax.tree.map(lambda leaf: leaf[layers.start:layers.stop], value)
        elif stage_holds(key, first, last, tied):
            stage[key] = value
    return {"params": stage}
