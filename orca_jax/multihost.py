"""Multi-host serving: one tensor-parallel program over the devices of several processes.

JAX runs one program per process ("multi-controller"): every process must call the same
compiled step, with the same inputs, in the same order. orca_jax keeps one scheduler:

    process 0 (leader)                              processes 1..P-1 (followers)
    HTTP server, scheduler, BatchState.build        load weights (their shards), then loop:
    StepChannel.send(inputs) ------ broadcast ----> StepChannel.receive() -> inputs
    runner.run(inputs)       <-- all-reduces --->   runner.run(inputs).result()
    ...
    StepChannel.send_stop()  ------ broadcast ----> receive() -> None: leave the loop, exit

The hand-off uses JAX's own collective (`multihost_utils.broadcast_one_to_all`): a fixed-size
header (token bucket, stop flag), then the step's `StepInputs` arrays, whose shapes the bucket
fixes. Every process holds the same persistent batch state (orca_jax.batch_state), updated by
the same inputs, so a token the leader left on the device resolves on every process. The
sampled tokens come out replicated, so only the leader reads them.

With overlapped steps the leader sends step N+1 before it reads step N, but the broadcast is
itself a device collective, queued behind step N on every process: the leader's host work
overlaps its own device, not the collective. Handing the inputs over jax.distributed's
key-value store instead would lift that; it is not done yet. Nothing here opens a
socket of its own; jax.distributed's coordinator and the backend's collectives (gloo on CPU,
NCCL on GPU, ICI/DCN on TPU) carry everything.
"""

from __future__ import annotations

import logging
import os
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from orca_jax.batch_state import StepInputs, empty_step_inputs
from orca_jax.config import EngineConfig

logger = logging.getLogger(__name__)

_STEP, _STOP = 0, 1


def wants_distributed(coordinator_address: str | None, num_processes: int | None) -> bool:
    """Start jax.distributed? Yes when told on the command line or by the environment:
    JAX_COORDINATOR_ADDRESS (any cluster), or a Cloud TPU VM slice of several hosts
    (TPU_WORKER_HOSTNAMES / TPU_PROCESS_ADDRESSES list more than one), where JAX finds the
    coordinator, process count and index itself."""
    if coordinator_address or (num_processes or 1) > 1 or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    hosts = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES") or ""
    return len([h for h in hosts.split(",") if h.strip()]) > 1


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """jax.distributed.initialize, before anything touches a device. Arguments left None are
    found by JAX from the environment (Cloud TPU, Slurm, Open MPI, Kubernetes)."""
    # CPU processes need a cross-process collectives library (the default is none); GPU and
    # TPU backends ignore this setting.
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # a JAX that has no such option (or picks a default itself)
        logger.info("jax_cpu_collectives_implementation not available; using JAX's default")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    logger.info("jax.distributed: process %d of %d, %d local / %d global devices",
                jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())


def is_leader_of_many() -> bool:
    """Process 0 of a multi-process run: the one that schedules."""
    return jax.process_count() > 1 and jax.process_index() == 0


def is_follower() -> bool:
    return jax.process_index() != 0


class StepChannel:
    """Leader -> followers hand-off of each step's batch, over JAX collectives. Every process
    holds one; the leader sends, the followers receive, in lock step."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.stopped = False
        # The engine thread sends steps while shutdown may send stop from another thread: the
        # followers must see one sequence of collectives, so one sender at a time.
        self._sending = threading.Lock()

    def send(self, inputs: StepInputs) -> None:
        with self._sending:
            if self.stopped:
                raise RuntimeError("multi-host: a step after the followers were stopped")
            self._broadcast_header(inputs.num_tokens, _STEP)
            multihost_utils.broadcast_one_to_all(inputs)

    def send_stop(self) -> None:
        """Tell the followers to leave their loop (once; later calls do nothing)."""
        with self._sending:
            if not self.stopped:
                self.stopped = True
                self._broadcast_header(0, _STOP)

    def receive(self) -> StepInputs | None:
        """The leader's next step inputs, or None once it has sent stop."""
        num_tokens, kind = self._broadcast_header(0, _STEP)
        if kind == _STOP:
            self.stopped = True
            return None
        # Same-shaped zeros to receive into: the bucket fixes every array's shape.
        return multihost_utils.broadcast_one_to_all(empty_step_inputs(self.config, num_tokens))

    @staticmethod
    def _broadcast_header(num_tokens: int, kind: int) -> tuple[int, int]:
        header = multihost_utils.broadcast_one_to_all(np.array([num_tokens, kind], np.int32))
        return int(header[0]), int(header[1])


def follow(runner, channel: StepChannel) -> int:
    """A follower's life: run every batch the leader sends, until it sends stop. Returns the
    number of steps run. A step that fails here is not known to have failed on the leader
    (host memory, a device error of this host): it is raised, so the process exits non-zero and
    jax.distributed ends the job rather than leaving the leader waiting in a collective."""
    steps = 0
    while (inputs := channel.receive()) is not None:
        # Each process keeps its own copy of the persistent batch state, updated by the same
        # inputs, so tokens the leader leaves on the device resolve here too. Waiting for the
        # result surfaces this host's errors at the step that caused them.
        runner.run(inputs).result()
        steps += 1
    logger.info("follower %d: stop received after %d steps", jax.process_index(), steps)
    return steps
