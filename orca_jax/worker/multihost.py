"""Multi-host serving: the devices of several processes run each step, one process schedules.

JAX runs one program per process ("multi-controller"): every process must call the same
compiled programs, with the same inputs, in the same order. orca_jax keeps one scheduler:

    process 0 (leader)                              processes 1..N-1 (followers)
    HTTP server, scheduler, BatchState.build        load weights (their part), then loop:
    StepChannel.send(inputs) ---- key-value store -> StepChannel.receive() -> inputs
    runner.run(inputs)       <-- collectives --->   runner.run(inputs) (result() waited for)
    ...
    StepChannel.send_stop()  ---- key-value store -> receive() -> None: leave the loop, exit

Tensor parallelism (orca_jax.worker.runner.ModelRunner): one program over every device of every
process, whose all-reduces join them. Pipeline parallelism (orca_jax.worker.pipeline.PipelineRunner):
each process runs its own stages' programs, and the activations and the sampled tokens cross
between processes by small ppermute programs (`StageLink`); the follower keeps as many steps in
flight as there are stages.

The hand-off (`StepChannel`) puts each step's `StepInputs` (a few KB; the token bitmask and the
logit bias only when a row needs them) into jax.distributed's key-value store under the step's number: the
leader's send returns at once and involves no device, so with overlapped steps (and a
pipeline's batches in flight) the leader and the followers go on while earlier steps compute.
Where jax.distributed's client is not available, it falls back to device collectives
(`multihost_utils.broadcast_one_to_all` of a header, then the arrays), which queue behind the
steps in flight: then across processes the host work does not overlap the device, and a
pipeline's batches do not overlap each other (docs/parallelism.md has the numbers). Every
process holds the same persistent batch state (orca_jax.worker.batch_state), updated by the same
inputs, so a token the leader left on the device resolves on every process. The sampled tokens
reach the leader (replicated, or by the pipeline's output link); only it reads them. Nothing
here opens a socket of its own; jax.distributed's coordinator and the backend's collectives
(gloo on CPU, NCCL on GPU, ICI/DCN on TPU) carry everything.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from orca_jax.worker.batch_state import StepInputs, empty_step_inputs, step_flags, unsent_fields
from orca_jax.worker.compile_guard import compile_count
from orca_jax.config import EngineConfig

logger = logging.getLogger(__name__)

_STEP, _STOP = 0, 1
_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepInputs))


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


def _key_value_client():
    """jax.distributed's client of the coordination service (its key-value store), or None
    when jax.distributed is not running (or this JAX keeps it elsewhere)."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    return getattr(distributed.global_state, "client", None)


class StepChannel:
    """Leader -> followers hand-off of each step's batch. Every process holds one; the leader
    sends, the followers receive, in the same order.

    Transport "kv" (whenever jax.distributed runs): each step is one value in jax.distributed's
    key-value store (the coordination service), under the step's number; the leader's send
    returns at once and no device collective is involved, so the hand-off waits for no step in
    flight. The optional fields (the token bitmask, the logit bias) travel only in steps with a
    row that needs them (elsewhere the receiver takes their neutral value). The leader deletes step n - KEEP_STEPS when it sends step n: a
    follower is never that far behind, as every step's collectives (the tensor-parallel
    all-reduces, the pipeline's links) need every process, and the leader completes all but the
    last few steps it sent. Transport "collectives": a header, then the arrays, with
    `multihost_utils.broadcast_one_to_all` (device collectives, queued behind the steps in
    flight)."""

    KEEP_STEPS = 64
    GET_TIMEOUT_MS = 60_000  # a follower's wait for the next step, renewed while the leader idles

    def __init__(self, config: EngineConfig, transport: str | None = None):
        self.config = config
        self.stopped = False
        # The engine thread sends steps while shutdown may send stop from another thread: the
        # followers must see one sequence of steps, so one sender at a time.
        self._sending = threading.Lock()
        self._client = _key_value_client() if transport != "collectives" else None
        if transport == "kv" and self._client is None:
            raise RuntimeError("multi-host: the key-value transport needs jax.distributed to be running")
        self.transport = "kv" if self._client is not None else "collectives"
        logger.info("multi-host: steps handed over by %s", "jax.distributed's key-value store"
                    if self.transport == "kv" else "device collectives (broadcast_one_to_all)")
        self._next_step = 0  # the key-value store's step number, on every process
        self._templates: dict[int, StepInputs] = {}  # per token bucket, a padding step (shapes, dtypes)

    def send(self, inputs: StepInputs) -> None:
        with self._sending:
            if self.stopped:
                raise RuntimeError("multi-host: a step after the followers were stopped")
            if self._client is not None:
                self._put(_STEP, inputs)
                return
            self._broadcast_header(inputs.num_tokens, _STEP)
            multihost_utils.broadcast_one_to_all(inputs)

    def send_stop(self) -> None:
        """Tell the followers to leave their loop (once; later calls do nothing)."""
        with self._sending:
            if not self.stopped:
                self.stopped = True
                if self._client is not None:
                    self._put(_STOP, None)
                else:
                    self._broadcast_header(0, _STOP)

    def receive(self) -> StepInputs | None:
        """The leader's next step inputs, or None once it has sent stop."""
        if self._client is not None:
            return self._get()
        num_tokens, kind = self._broadcast_header(0, _STEP)
        if kind == _STOP:
            self.stopped = True
            return None
        # Same-shaped zeros to receive into: the bucket fixes every array's shape.
        return multihost_utils.broadcast_one_to_all(empty_step_inputs(self.config, num_tokens))

    # ---- the key-value transport ----------------------------------------------------------------
    @staticmethod
    def _key(step: int) -> str:
        return f"orca_jax/step/{step}"

    def _put(self, kind: int, inputs: StepInputs | None) -> None:
        """One value: a header (kind, token bucket, the step's row flags), then the arrays' bytes in
        field order, the unsent optional fields left out."""
        if inputs is None:
            payload = np.array([kind, 0, 0], np.int32).tobytes()
        else:
            flags = step_flags(inputs)
            unsent = unsent_fields(flags=flags)
            parts = [np.array([kind, inputs.num_tokens, flags], np.int32).tobytes()]
            parts += [np.ascontiguousarray(getattr(inputs, name)).tobytes() for name in _STEP_FIELDS
                      if name not in unsent]
            payload = b"".join(parts)
        step = self._next_step
        self._client.key_value_set_bytes(self._key(step), payload)
        if step >= self.KEEP_STEPS:
            self._client.key_value_delete(self._key(step - self.KEEP_STEPS))
        self._next_step += 1

    def _get(self) -> StepInputs | None:
        key = self._key(self._next_step)
        while True:
            try:
                payload = self._client.blocking_key_value_get_bytes(key, self.GET_TIMEOUT_MS)
                break
            except RuntimeError as error:  # JaxRuntimeError. An idle leader: wait on; anything else ends us
                if "DEADLINE_EXCEEDED" not in str(error):
                    raise
        self._next_step += 1
        kind, num_tokens, flags = (int(x) for x in np.frombuffer(payload, np.int32, count=3))
        if kind == _STOP:
            self.stopped = True
            return None
        if num_tokens not in self._templates:
            self._templates[num_tokens] = empty_step_inputs(self.config, num_tokens)
        template, offset, fields = self._templates[num_tokens], 12, {}
        unsent = unsent_fields(flags=flags)
        for name in _STEP_FIELDS:
            like = getattr(template, name)
            if name in unsent:  # neutral: no row needs it
                fields[name] = like
                continue
            fields[name] = np.frombuffer(payload, like.dtype, count=like.size, offset=offset).reshape(like.shape)
            offset += like.nbytes
        if offset != len(payload):
            raise RuntimeError(f"multi-host: step {self._next_step - 1} holds {len(payload)} bytes, expected {offset} "
                               f"for token bucket {num_tokens}: the processes run different configurations")
        return StepInputs(**fields)

    @staticmethod
    def _broadcast_header(num_tokens: int, kind: int) -> tuple[int, int]:
        header = multihost_utils.broadcast_one_to_all(np.array([num_tokens, kind], np.int32))
        return int(header[0]), int(header[1])


def follow(runner, channel: StepChannel) -> int:
    """A follower's life: run every batch the leader sends, until it sends stop. Returns the
    number of steps run. A step that fails here is not known to have failed on the leader
    (host memory, a device error of this host): it is raised, so the process exits non-zero and
    jax.distributed ends the job rather than leaving the leader waiting in a collective.

    A pipeline's follower (`runner.num_stages` > 1) keeps up to that many steps in flight, as
    the leader does, so that taking the next step from the channel and enqueueing it overlaps
    its stages computing the one before; otherwise each step is waited for before the next."""
    steps, serving_since = 0, None
    depth = max(1, getattr(runner, "num_stages", 1))
    in_flight: collections.deque = collections.deque()
    while (inputs := channel.receive()) is not None:
        if serving_since is None and int(inputs.num_seqs[0]) > 0:
            # The leader's warm-up sends padding steps only (no rows): from its first real step
            # on, this process should build nothing more.
            serving_since = compile_count()
        # Each process keeps its own copy of the persistent batch state, updated by the same
        # inputs, so tokens the leader leaves on the device resolve here too. Waiting for the
        # result surfaces this host's errors at the step that caused them (or a few later).
        in_flight.append(runner.run(inputs))
        while len(in_flight) >= depth:
            in_flight.popleft().result()
        steps += 1
    while in_flight:
        in_flight.popleft().result()
    built = 0 if serving_since is None else compile_count() - serving_since
    logger.info("follower %d: stop received after %d steps; %d programs built while serving", jax.process_index(),
                steps, built)
    return steps
