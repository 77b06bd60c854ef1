"""What the engine's two runners share (`ModelRunner`, one model on one device or one mesh;
`PipelineRunner`, its layers in stages): the step's way from a scheduled batch to a dispatched
program (`dispatch` -> `send_and_run` -> the runner's own `run`), the host-side numbers the step
timeline reads, the bucket check, the multi-host followers' warm-up, the neutral optional fields placed
once per bucket, and what a dispatched step returns (`PendingStep`)."""

from __future__ import annotations

import dataclasses

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import jax
import numpy as np

from orca_jax.config import EngineConfig
from orca_jax.core.scheduler import ScheduledBatch
from orca_jax.worker.batch_state import BatchState, StepInputs, empty_step_inputs, unsent_fields
from orca_jax.worker.compile_guard import CompileCounts
from orca_jax.worker.sampling import SampleOutput


@dataclass(frozen=True)
class WarmupReport:
    buckets: tuple[int, ...]  # the token buckets built now (those built before are left out)
    seconds: float
    counts: CompileCounts  # programs built, and how many came from the persistent cache


# One XLA CPU compile of a step program keeps ~1.7 cores busy on its own (measured on 2 cores:
# 33-39 s of CPU in 20-23 s for the default model's 7 buckets one at a time). Two at once on 2
# cores took as long and cost 15-30% more CPU, so a compile gets two cores.
CORES_PER_COMPILE = 2


def compile_workers(num_programs: int) -> int:
    """Compiles to run at once: one per CORES_PER_COMPILE cores this process may use (at least
    one, so that lowering the next bucket overlaps compiling the last)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(num_programs, cores // CORES_PER_COMPILE))


class PendingStep:
    """A dispatched step. Its outputs start copying to the host at once; `result()` waits for
    them (numpy SampleOutput). `output` holds the device arrays (the step timeline waits on
    them to time the device)."""

    def __init__(self, output: SampleOutput, wants_prompt: bool = False):
        # The prompt log-probabilities ([T, K]) cross to the host only for a step that asked.
        self.output = output if wants_prompt or output.prompt is None else dataclasses.replace(output, prompt=None)
        for leaf in jax.tree.leaves(self.output):
            leaf.copy_to_host_async()

    def result(self) -> SampleOutput:
        out = jax.tree.map(_to_host, self.output)
        if out.unresolved_tokens is not None and int(out.unresolved_tokens):
            raise RuntimeError(f"{int(out.unresolved_tokens)} token(s) of the step were not on the device: the "
                               "persistent batch state is out of step with the scheduler")
        return out


class RunnerBase:
    """The step path both runners share; a subclass sets `config`, `channel` and `batch_state`
    and implements `run(inputs)` (this process's part of one step; followers call it directly)."""

    config: EngineConfig
    channel: object | None  # the multi-host leader's multihost.StepChannel, else None
    batch_state: BatchState

    def _init_step_numbers(self) -> None:
        # Host side of the step: seconds building the last step's inputs and their bytes (the
        # step timeline reads them), and seconds per bucket built by a step, not by warm-up.
        self.last_build_s = 0.0
        self.last_h2d_bytes = 0
        self.last_h2d_arrays = 0
        self.last_bucket = 0
        self.first_use_build_s: dict[int, float] = {}

    def dispatch(self, scheduled: ScheduledBatch) -> PendingStep:
        """Build the step's inputs and enqueue its program(s); returns without waiting."""
        start = time.perf_counter()
        inputs = self.batch_state.build(scheduled)
        self.last_build_s = time.perf_counter() - start
        return self.send_and_run(inputs)

    def send_and_run(self, inputs: StepInputs) -> PendingStep:
        """Run one step; a multi-host leader first hands the inputs to the other processes."""
        if self.channel is not None:
            self.channel.send(inputs)
        return self.run(inputs)

    def run(self, inputs: StepInputs):
        raise NotImplementedError

    def _note_inputs(self, inputs: StepInputs) -> None:
        """The step's host -> device transfer, as the step timeline reports it."""
        leaves = [leaf for leaf in jax.tree.leaves(inputs) if isinstance(leaf, np.ndarray)]
        self.last_h2d_bytes, self.last_h2d_arrays = sum(leaf.nbytes for leaf in leaves), len(leaves)
        self.last_bucket = inputs.num_tokens

    def _check_bucket(self, bucket: int) -> None:
        if bucket not in self.config.token_buckets:
            raise ValueError(f"batch of {bucket} tokens is not a compiled bucket {self.config.token_buckets}")

    def _warm_followers(self, buckets: Iterable[int]) -> None:
        """Multi-host followers build their programs on first use: one padding step per bucket
        has them build all of them now rather than in the first requests."""
        if self.channel is not None:
            for bucket in buckets:
                self.send_and_run(empty_step_inputs(self.config, bucket)).result()


def with_placed_neutral_fields(cache: dict[tuple[int, str], jax.Array], inputs: StepInputs,
                               place: Callable[[np.ndarray], jax.Array]) -> StepInputs:
    """`inputs` with each optional field no row needs (batch_state.unsent_fields: the grammar
    bitmask, the logit bias) replaced by the bucket's neutral copy, placed on the device(s) the
    first time it is seen. device_put, not jnp.asarray: the latter runs a copy program, a compile
    while serving."""
    unsent = unsent_fields(inputs)
    if not unsent:
        return inputs
    fields = {}
    for name in unsent:
        key = (inputs.num_tokens, name)
        if key not in cache:
            cache[key] = place(np.array(getattr(inputs, name)))
        fields[name] = cache[key]
    return dataclasses.replace(inputs, **fields)


def _to_host(x: jax.Array) -> np.ndarray:
    """A replicated result as numpy. Its first local shard is the whole value, which also holds
    when other processes own some of its devices (then np.asarray(x) would refuse)."""
    return np.asarray(x.addressable_data(0))
