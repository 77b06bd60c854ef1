"""A pipeline's hand-over between two stages on different processes (multi-host): one small
jitted `ppermute` over the two stages' rows of the mesh. orca_jax/worker/pipeline.py says when it is
used; docs/parallelism.md ("Multi-host serving") has the design and measurements.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from orca_jax.worker.pipeline_layout import STAGE_AXIS

class StageLink:
    """Values crossing from stage `src`'s row of the mesh to stage `dst`'s row when the two
    belong to different processes: activations to the next stage, or the last stage's
    SampleOutput to the leader's. One jitted `ppermute` over the 2 x T mesh of the two rows
    (row 0 `src`, row 1 `dst`), on global arrays [2, ...] sharded over "stage": each process
    contributes its row's block [1, ...] (the sender its value, the receiver zeros), and after
    it the receiver's block holds the value. One program per token bucket; `shapes(bucket)` is
    the tree of the value's ShapeDtypeStructs, without the leading block axis. Only the two
    processes of `src` and `dst` call it, each once per step, in the same order."""

    def __init__(self, src: int, dst: int, mesh: Mesh, shapes, sends: bool, receives: bool, dst_sharding,
                 on_first_use=None):
        self.src, self.dst = src, dst
        self.mesh = mesh
        self.shapes = shapes
        self.sends, self.receives = sends, receives
        self.dst_sharding = dst_sharding  # the receiving stage's replicated sharding (its own row)
        self.sharding = NamedSharding(mesh, P(STAGE_AXIS))
        hop = jax.shard_map(_ppermute_blocks, mesh=mesh, in_specs=P(STAGE_AXIS), out_specs=P(STAGE_AXIS))
        self._jitted = jax.jit(hop, in_shardings=self.sharding, out_shardings=self.sharding)
        self.programs: dict[int, jax.stages.Compiled] = {}
        self._zeros: dict[int, object] = {}
        self._on_first_use = on_first_use  # (what, bucket, seconds) of a program built by a step

    def global_shapes(self, bucket: int):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct((2, *x.shape), x.dtype, sharding=self.sharding),
                            self.shapes(bucket))

    def lower(self, bucket: int) -> jax.stages.Lowered:
        return self._jitted.lower(self.global_shapes(bucket))

    def program(self, bucket: int) -> jax.stages.Compiled:
        if bucket not in self.programs:  # not warmed up: built on first use
            started = time.perf_counter()
            self.programs[bucket] = self.lower(bucket).compile()
            if self._on_first_use is not None:
                self._on_first_use(f"link {self.src} -> {self.dst}", bucket, time.perf_counter() - started)
        return self.programs[bucket]

    def send(self, value, bucket: int):
        """Hand `value` (leaves [1, ...], replicated on src's row) over; returns what the
        collective left on this process (zeros), to wait on."""
        shapes = self.global_shapes(bucket)
        blocks = jax.tree.map(lambda leaf, shape: jax.make_array_from_single_device_arrays(
            shape.shape, self.sharding, [shard.data for shard in leaf.addressable_shards]), value, shapes)
        return self.program(bucket)(blocks)

    def receive(self, bucket: int):
        """The value, as leaves [1, ...] replicated on dst's row."""
        if bucket not in self._zeros:  # placed once per bucket (a transfer, not a program)
            devices = [d for d in self.mesh.devices[1].flat if d.process_index == jax.process_index()]
            self._zeros[bucket] = jax.tree.map(lambda shape: jax.make_array_from_single_device_arrays(
                shape.shape, self.sharding,
                [jax.device_put(np.zeros((1, *shape.shape[1:]), shape.dtype), d) for d in devices]),
                self.global_shapes(bucket))
        received = self.program(bucket)(self._zeros[bucket])
        return jax.tree.map(lambda leaf: jax.make_array_from_single_device_arrays(
            (1, *leaf.shape[1:]), self.dst_sharding, [shard.data for shard in leaf.addressable_shards]), received)


def _ppermute_blocks(tree):
    """Inside the link's shard_map: each row's block, row 0's moved to row 1 (row 0 gets zeros)."""
    return jax.tree.map(lambda x: jax.lax.ppermute(x, STAGE_AXIS, [(0, 1)]), tree)
