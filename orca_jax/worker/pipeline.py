"""Pipeline parallelism: Orca's inter-layer parallelism, with one batch in flight per stage.

The devices form a two-axis mesh, stage x model (`make_pipeline_mesh`). Stage s holds a
contiguous slice of the layers (`stage_layer_ranges`: the first L % P stages one layer more),
their weights and their part of the KV cache, on its own row of the mesh, tensor-parallel
over that row exactly as one whole model is over a 1-D mesh (orca_jax/distributed/parallel.py). Each
stage is its own compiled program per token bucket:

    stage 0:      expand -> embed -> its layers                     -> activations [T, D]
    stage s:      expand -> its layers (from the activations)       -> activations [T, D]
    stage P - 1:  expand -> its layers -> final norm, logits -> sample -> SampleOutput

A batch moves by JAX's asynchronous dispatch alone: `dispatch` enqueues stage 0's program on
stage 0's devices, `jax.device_put`s its activations onto stage 1's devices (a device-to-device
copy, never through the host), enqueues stage 1's program, and so on, and returns at once.
Each device runs its queue in order, so while stage 1 computes batch A, stage 0 already
computes batch B, dispatched next: the engine keeps up to P batches in flight
(orca_jax/engine/engine.py), and the scheduler never puts a sequence in a batch while it is in one in
flight (`Scheduler.excludes_in_flight`), so the batches in flight are disjoint.

Every stage keeps its own copy of the persistent batch state (page tables, penalty counts) and
applies the same `StepInputs` to it in the same order, so each derives the step's metadata
itself: only the activations cross between stages. Under Orca's rule the host knows every
token it feeds (a sequence's batch returned before it is scheduled again), so the first stage
needs no token from the last (`BatchState.tokens_from_host`). With P = 1 the engine uses
`orca_jax.worker.runner.ModelRunner`, unchanged. docs/parallelism.md has the design and measurements.

Across processes (multi-host, jax.distributed), each stage's devices belong to one process,
which alone builds that stage (weights, cache, state, programs). Process 0 schedules and hands
every step's `StepInputs` to the others (`orca_jax.worker.multihost.StepChannel`); every process then
enqueues, in stage order, its own stages' programs and the `StageLink`s it takes part in:

    process A (stages ..s)                         process B (stages s+1..)
    stage s program -> [1, T, D] ----------------> link s: ppermute over rows s, s+1 ----> stage s+1 program
                                                   ...
    leader's stage  <--- output link: ppermute over the last row, the leader's row <---- last stage -> SampleOutput

A link is one small jitted `shard_map` over the 2 x T mesh of the two rows: a global [2, ...]
array sharded over "stage", built from each process's own block (the sender's value, the
receiver's zeros), `ppermute`d from row 0 to row 1. Stages next to each other on one process
still hand over with `jax.device_put`. The last stage's `SampleOutput` reaches the leader by an
output link; the other processes drop it. Every process enqueues the links in the same order
(by stage), so the collectives match.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh

from orca_jax.distributed import parallel
from orca_jax.worker.batch_state import (BatchState, StepInputs, create_device_state, create_token_counts,
                                  empty_step_inputs, expand, record_sampled)
from orca_jax.loading.checkpoint import place_host_params
from orca_jax.worker.compile_guard import compile_counts
from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.core.kv_cache import choose_num_pages, create_kv_cache, fit_context_to_pool
from orca_jax.models import abstract_variables, architecture
from orca_jax.worker.pipeline_layout import (STAGE_AXIS, make_pipeline_mesh, slice_stage_params, stage_holds,
                                      stage_layer_ranges, stage_mesh, stage_processes)
from orca_jax.worker.runner_base import PendingStep, RunnerBase, WarmupReport, compile_workers, with_placed_neutral_fields
from orca_jax.worker.sampling import SampleOutput, sample
from orca_jax.worker.stage_link import StageLink

logger = logging.getLogger(__name__)

@dataclass
class Stage:
    """One pipeline stage: its devices, layers, weights, cache, state and programs."""

    index: int
    layers: range
    mesh: Mesh
    model_config: ModelConfig  # the stage's share of the layers, KV heads as stored
    model: object
    params: dict
    first: bool
    last: bool
    kv_cache: jax.Array | None = None
    state: object = None
    step: object = None  # the jitted stage program
    programs: dict[int, jax.stages.Compiled] = field(default_factory=dict)
    neutral_fields: dict[tuple[int, str], jax.Array] = field(default_factory=dict)  # with_placed_neutral_fields

    @property
    def replicated(self):
        return parallel.replicated(self.mesh)


def stage_step(model, first: bool, last: bool, max_logprobs: int, keep_logits: bool, page_size: int,
               params, kv_cache, state, inputs: StepInputs, hidden=None):
    """One stage of one step. Every stage expands the inputs against its own copy of the
    persistent state (the same inputs in the same order keep the copies equal), so each has the
    step's metadata without receiving it. Returns (kv_cache, state, activations) before the
    last stage and (kv_cache, state, SampleOutput) on it."""
    state, batch, counts, unresolved = expand(state, inputs, page_size)
    if not last:
        x, kv_cache = model.apply(params, batch.input_ids, kv_cache, batch.metadata, None,
                                  hidden=None if first else hidden)
        return kv_cache, state, x
    logits, kv_cache = model.apply(params, batch.input_ids, kv_cache, batch.metadata, batch.logits_indices,
                                   hidden=None if first else hidden)
    out = sample(logits, batch.sampling, max_logprobs, counts)
    state = record_sampled(state, inputs, out.tokens)
    out = dataclasses.replace(out, unresolved_tokens=unresolved, logits=logits if keep_logits else None)
    return kv_cache, state, out


class StageTimeline:
    """When enabled, when each stage of each batch was enqueued and when its output was ready
    (one watcher thread per stage waits on its outputs in order: a stage runs its batches in
    order). `records`: (batch, stage, dispatched_at, done_at), perf_counter seconds."""

    def __init__(self, num_stages: int):
        self.enabled = False
        self.records: list[tuple[int, int, float, float]] = []
        self._queues = [queue.SimpleQueue() for _ in range(num_stages)]
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def watch(self, batch: int, stage: int, output, enqueued_at: float | None = None) -> None:
        """Record when `output` is ready; `enqueued_at`: when its program was called (default
        now: a program call may return only after its inputs were placed)."""
        if not self.enabled:
            return
        if not self._threads:
            for s, q in enumerate(self._queues):
                thread = threading.Thread(target=self._wait_loop, args=(q,), daemon=True, name=f"stage-clock-{s}")
                thread.start()
                self._threads.append(thread)
        self._queues[stage].put((batch, stage, enqueued_at or time.perf_counter(), output))

    def _wait_loop(self, q: queue.SimpleQueue) -> None:
        while True:
            batch, stage, dispatched_at, output = q.get()
            jax.block_until_ready(output)
            with self._lock:
                self.records.append((batch, stage, dispatched_at, time.perf_counter()))

    def drain(self, timeout_s: float = 60.0) -> list[tuple[int, int, float, float]]:
        """The records once every watched output is ready."""
        deadline = time.monotonic() + timeout_s
        while any(not q.empty() for q in self._queues) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.01)  # the last get() may still be waiting on its output
        with self._lock:
            return sorted(self.records)


class PipelineRunner(RunnerBase):
    """The engine's runner (`orca_jax.engine.step.EngineRunner`) for pipeline_parallel_size > 1: the
    stages of `make_pipeline_mesh`, each with its programs, chained by device-to-device copies.
    `params`: the converted weights as numpy ({"params": ...}) or a checkpoint; each stage's
    part lands on its own devices only (`_place_weights`).

    Several processes (jax.distributed): `stages` holds this process's stages only, and
    `links` the `StageLink`s it takes part in (keyed by the sending stage; the output link,
    last stage -> the leader's first stage, under `num_stages - 1`). `channel` (the leader's
    `multihost.StepChannel`): `dispatch` hands each step's inputs to the other processes before
    running its own stages; the others call `run` from `multihost.follow`."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, params, attention_impl: str,
                 mesh: Mesh | None = None, channel=None, *, keep_logits: bool = False):
        num_stages, tp = config.pipeline_parallel_size, config.tensor_parallel_size
        self.mesh = mesh if mesh is not None else make_pipeline_mesh(num_stages, tp)
        self.num_stages = num_stages
        self.stage_process = stage_processes(self.mesh)
        # The scheduling process: 0 for a pipeline across processes; this one for a data-parallel
        # replica's, whose stages are all its own.
        leader = jax.process_index() if parallel.is_process_local(self.mesh) else 0
        if leader not in self.stage_process:
            raise ValueError(f"no pipeline stage is on process {leader} (stages' processes {self.stage_process}): "
                             "the leader must hold one, to receive the last stage's output")
        # The stage the last stage's output goes to: the leader's first (stage 0 on the default mesh).
        self.leader_stage = self.stage_process.index(leader)
        self.channel = channel
        self.config = config
        self.dtype = jnp.dtype(config.dtype)
        self.keep_logits = keep_logits
        ranges = stage_layer_ranges(model_config.num_layers, num_stages)
        if len({len(r) for r in ranges}) > 1:
            logger.info("pipeline: %d layers do not divide into %d stages; stage sizes %s (the first stages take "
                        "one more)", model_config.num_layers, num_stages, [len(r) for r in ranges])
        # A mixture of experts' experts: split whole over each stage's row, or each along its width.
        model_config = parallel.expert_layout(model_config, tp, config.enable_expert_parallel)
        stored = parallel.sharded_model_config(model_config, tp)
        self.model_config = stored
        repeats = parallel.kv_head_repeats(model_config, tp)
        start = time.perf_counter()
        # Each process builds the stages whose devices it owns (all of them on one process).
        local = [s for s in range(num_stages) if self.stage_process[s] == jax.process_index()]
        weights = self._place_weights(params, model_config, ranges, local, repeats)
        del params
        self.stages = [self._make_stage(s, ranges[s], num_stages, stored, model_config, attention_impl, weights.pop(s))
                       for s in local]
        jax.block_until_ready([stage.params for stage in self.stages])
        self.timings = {"weights_to_device_s": time.perf_counter() - start}
        self.kv_dtype = jnp.dtype(config.resolved_kv_cache_dtype(jax.default_backend()))
        # Every stage holds the same pages (page ids index each stage's own layers); the largest
        # stage sizes the pool.
        largest = max(self.stages, key=lambda stage: len(stage.layers))
        self.num_pages = choose_num_pages(config, largest.model_config, self.kv_dtype,
                                          device=largest.mesh.devices.flat[0], num_shards=tp)
        if not parallel.is_process_local(self.mesh):
            # Each process sized the pool from its own stages and memory; the leader's page
            # tables index every stage's cache, so all take the leader's count (as ModelRunner).
            self.num_pages = int(multihost_utils.broadcast_one_to_all(np.int32(self.num_pages)))
        self.config = fit_context_to_pool(config, self.num_pages)
        start = time.perf_counter()
        self.reset_kv_cache()
        self.timings["kv_cache_alloc_s"] = time.perf_counter() - start
        self.links = self._make_links()
        for stage in self.stages:
            stage.step = self._jit_stage(stage)
        self.timeline = StageTimeline(num_stages)
        self.num_dispatched = 0
        self._init_step_numbers()
        logger.info("pipeline: %d stages x %d devices (mesh %s), layers per stage %s", num_stages, tp,
                    dict(self.mesh.shape), [len(r) for r in ranges])
        if not parallel.is_process_local(self.mesh):
            logger.info("pipeline: process %d of %d holds stages %s (stages' processes %s); links %s",
                        jax.process_index(), jax.process_count(), [stage.index for stage in self.stages],
                        self.stage_process, [(link.src, link.dst) for link in self.links.values()])

    # ---- across processes ---------------------------------------------------------------------
    def _make_links(self) -> dict[int, StageLink]:
        """The links this process takes part in: stage s -> s + 1 where the two are on different
        processes, and the last stage -> the leader's stage when the leader does not hold it."""
        me, owner = jax.process_index(), self.stage_process
        pairs = [(s, s + 1, self._activation_shapes) for s in range(self.num_stages - 1) if owner[s] != owner[s + 1]]
        last = self.num_stages - 1
        if owner[last] != owner[self.leader_stage]:
            pairs.append((last, self.leader_stage, self._output_shapes))
        links = {}
        for src, dst, shapes in pairs:
            if me not in (owner[src], owner[dst]):
                continue
            rows = Mesh(np.stack([self.mesh.devices[src], self.mesh.devices[dst]]), (STAGE_AXIS, parallel.MODEL_AXIS),
                        axis_types=(AxisType.Auto, AxisType.Auto))
            links[src] = StageLink(src, dst, rows, shapes, sends=owner[src] == me, receives=owner[dst] == me,
                                   dst_sharding=parallel.replicated(stage_mesh(self.mesh, dst)),
                                   on_first_use=self._built_on_first_use)
        return links

    def _activation_shapes(self, bucket: int):
        return jax.ShapeDtypeStruct((bucket, self.model_config.hidden_size), self.dtype)

    def _output_shapes(self, bucket: int) -> SampleOutput:
        """The last stage's SampleOutput of a bucket, as its program makes it (checked against
        the program where it is built: `_check_sent_shapes`)."""
        rows, k = self.config.seq_bucket(bucket), self.config.max_logprobs
        i32, f32 = jnp.int32, jnp.float32
        logits = jax.ShapeDtypeStruct((rows, self.model_config.vocab_size), f32) if self.keep_logits else None
        return SampleOutput(tokens=jax.ShapeDtypeStruct((rows,), i32), logprobs=jax.ShapeDtypeStruct((rows,), f32),
                            top_ids=jax.ShapeDtypeStruct((rows, k), i32),
                            top_logprobs=jax.ShapeDtypeStruct((rows, k), f32), logits=logits,
                            unresolved_tokens=jax.ShapeDtypeStruct((), i32))

    def _sends(self, stage: Stage) -> bool:
        return stage.index in self.links

    def _receives(self, stage: Stage) -> bool:
        return not stage.first and stage.index - 1 in self.links

    def _place_weights(self, params, model_config: ModelConfig, ranges: list[range], local: list[int],
                       repeats: int) -> dict[int, dict]:
        """Each local stage's weights, on its own row only. Host weights are sliced per stage and
        placed (tensor-parallel within the row). A checkpoint is read by orbax sharded over the
        stage axis, each row reading only its layers (`Checkpoint.restore_stages`), when the
        stages divide the layers, no KV head is repeated and one process holds every stage;
        otherwise it is restored to the host first, and sliced the same way."""
        num_stages, tied = len(ranges), model_config.tie_word_embeddings
        if not isinstance(params, dict):
            why_not = ("the stages do not divide the layers" if model_config.num_layers % num_stages
                       else "KV heads are repeated over the devices" if repeats > 1
                       else "the stages span processes" if not parallel.is_process_local(self.mesh) else None)
            if why_not is None:
                holders = {key: [s for s in range(num_stages) if stage_holds(key, s == 0, s == num_stages - 1, tied)]
                           for key in nn.unbox(abstract_variables(model_config))["params"] if key != "layers"}
                rows = [stage_mesh(self.mesh, s) for s in range(num_stages)]
                placed = dataclasses.replace(params, config=model_config)  # laid out as here (expert parallelism)
                return dict(enumerate(placed.restore_stages(self.dtype, self.mesh, rows, holders)))
            logger.info("pipeline: checkpoint restored to the host, then sliced per stage (%s)", why_not)
            params = params.restore_host(self.dtype)
        # The full model's config names the weights' logical axes; a stage's slice has the same
        # names and fewer layers.
        return {s: place_host_params(slice_stage_params(params, ranges[s], s == 0, s == num_stages - 1, tied),
                                     self.dtype, stage_mesh(self.mesh, s), repeats, config=model_config)
                for s in local}

    def _make_stage(self, s: int, layers: range, num_stages: int, stored: ModelConfig, model_config: ModelConfig,
                    attention_impl: str, placed: dict) -> Stage:
        first, last = s == 0, s == num_stages - 1
        mesh = stage_mesh(self.mesh, s)
        stage_config = stored.for_layers(layers)
        model = architecture(model_config.model_type).model_class(stage_config, attention_impl, self.dtype, mesh=mesh)
        return Stage(s, layers, mesh, stage_config, model, placed, first, last)

    def _jit_stage(self, stage: Stage):
        step = functools.partial(stage_step, stage.model, stage.first, stage.last, self.config.max_logprobs,
                                 self.keep_logits, self.config.page_size)
        replicated = stage.replicated
        param_shardings = jax.tree.map(lambda a: a.sharding, stage.params)
        kv_sharding = parallel.kv_cache_sharding(stage.mesh)
        in_shardings = (param_shardings, kv_sharding, replicated, replicated)
        if self._receives(stage) or self._sends(stage):  # a neighbour on another process
            step = _linked(step, self._receives(stage), self._sends(stage))
        if not stage.first:
            in_shardings += (replicated,)
        else:
            step = _without_hidden(step)
        # Donated cache and state, out sharding == in sharding: updated in place.
        return jax.jit(step, in_shardings=in_shardings, out_shardings=(kv_sharding, replicated, replicated),
                       donate_argnames=("kv_cache", "state"))

    # ---- the cache and the state ----------------------------------------------------------------
    @property
    def kv_cache_lost(self) -> bool:
        return any(stage.kv_cache.is_deleted() or any(leaf.is_deleted() for leaf in jax.tree.leaves(stage.state))
                   for stage in self.stages)

    def reset_kv_cache(self) -> None:
        """Fresh, zeroed caches and batch states on every stage (at start-up, and after a failed
        step consumed donated ones)."""
        for stage in self.stages:
            stage.kv_cache = create_kv_cache(stage.model_config, self.num_pages, self.config.page_size, self.kv_dtype,
                                             sharding=parallel.kv_cache_sharding(stage.mesh)).block_until_ready()
            counts = create_token_counts(self.config, stage.model_config.vocab_size, stage.replicated)
            stage.state = jax.block_until_ready(create_device_state(self.config, counts, stage.replicated))
        self.batch_state = BatchState(self.config)

    # ---- programs -----------------------------------------------------------------------------
    def warmup(self, buckets: Sequence[int] | None = None) -> WarmupReport:
        """Build every stage's program of each token bucket before serving (compiles overlap in
        a thread pool, as ModelRunner.warmup)."""
        start, counts_before = time.perf_counter(), compile_counts()
        wanted = self.config.token_buckets if buckets is None else buckets
        todo = [(stage, b) for b in dict.fromkeys(wanted) for stage in self.stages if b not in stage.programs]
        links = [(link, b) for b in dict.fromkeys(wanted) for link in self.links.values() if b not in link.programs]
        with ThreadPoolExecutor(max_workers=compile_workers(len(todo) + len(links)),
                                thread_name_prefix="compile") as pool:
            futures = [(stage, b, pool.submit(self._lower(stage, b).compile)) for stage, b in todo]
            link_futures = [(link, b, pool.submit(link.lower(b).compile)) for link, b in links]
            for stage, bucket, future in futures:
                stage.programs[bucket] = future.result()
            for link, bucket, future in link_futures:
                link.programs[bucket] = future.result()
        built = tuple(dict.fromkeys(b for _, b in todo + links))
        self._warm_followers(built)  # and their links'
        report = WarmupReport(built, time.perf_counter() - start, compile_counts() - counts_before)
        logger.info("warm-up: %d stage programs (%d stages, token buckets %s) in %.1f s: %d compiled, %d from the "
                    "compilation cache", len(todo), len(self.stages), list(built), report.seconds,
                    report.counts.compiled, report.counts.cache_hits)
        return report

    def _lower(self, stage: Stage, bucket: int) -> jax.stages.Lowered:
        self._check_bucket(bucket)
        args = [stage.params, stage.kv_cache, stage.state, empty_step_inputs(self.config, bucket)]
        if not stage.first:
            d = self.model_config.hidden_size
            shape = (1, bucket, d) if self._receives(stage) else (bucket, d)
            args.append(jax.ShapeDtypeStruct(shape, self.dtype, sharding=stage.replicated))
        lowered = stage.step.lower(*args)
        if self._sends(stage):
            self._check_sent_shapes(stage, bucket, lowered.out_info[2])
        return lowered

    def _check_sent_shapes(self, stage: Stage, bucket: int, made) -> None:
        """What a stage's program makes must be what its link's other end expects (the leader
        knows the last stage's output only from the config); a mismatch would hang the link."""
        expected = jax.tree.map(lambda x: ((1, *x.shape), jnp.dtype(x.dtype)), self.links[stage.index].shapes(bucket))
        got = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), made)
        if got != expected:
            raise RuntimeError(f"pipeline stage {stage.index} makes {got} for bucket {bucket}, but the process it "
                               f"sends to expects {expected}")

    def _program(self, stage: Stage, bucket: int) -> jax.stages.Compiled:
        if bucket not in stage.programs:  # not warmed up: built on first use
            started = time.perf_counter()
            stage.programs[bucket] = self._lower(stage, bucket).compile()
            self._built_on_first_use(f"stage {stage.index}'s program", bucket, time.perf_counter() - started)
        return stage.programs[bucket]

    def _built_on_first_use(self, what: str, bucket: int, seconds: float) -> None:
        self.first_use_build_s[bucket] = self.first_use_build_s.get(bucket, 0.0) + seconds
        if jax.process_count() > 1:  # a follower's warm-up; on the leader, a program warm-up missed
            logger.info("pipeline: %s for bucket %d built on first use (%.2f s)", what, bucket, seconds)

    # ---- one step -------------------------------------------------------------------------------
    def run(self, inputs: StepInputs) -> PendingStep:
        """Enqueue this process's stages of one step (all of them on one process), and the links
        it takes part in, in stage order; followers call this directly. Returns the step's
        SampleOutput where it lands (the leader), elsewhere a step whose result() only waits."""
        bucket = inputs.num_tokens
        self._note_inputs(inputs)
        batch, hidden, out = self.num_dispatched, None, None
        self.num_dispatched += 1
        waits = []  # across processes: what this process enqueued, for a follower to wait on
        for stage in self.stages:
            program = self._program(stage, bucket)
            stage_inputs = with_placed_neutral_fields(stage.neutral_fields, inputs,
                                                      lambda value: parallel.put_replicated(value, stage.mesh))
            args = [stage.params, stage.kv_cache, stage.state, _put_host_leaves(stage_inputs, stage.mesh)]
            if self._receives(stage):
                # From the previous stage's process: [1, T, D], already on this stage's row.
                args.append(self.links[stage.index - 1].receive(bucket))
            elif not stage.first:
                # The previous stage's activations, copied device to device onto this stage's row.
                args.append(jax.device_put(hidden, stage.replicated))
            enqueued_at = time.perf_counter()
            stage.kv_cache, stage.state, result = program(*args)
            self.timeline.watch(batch, stage.index, result, enqueued_at)
            if self._sends(stage):  # to the next stage's process, or the output to the leader's
                waits.append(self.links[stage.index].send(result, bucket))
            elif stage.last:
                out = result
            else:
                hidden = result
        output_link = self.links.get(self.num_stages - 1)
        if output_link is not None and output_link.receives:  # the leader, without the last stage
            received = output_link.receive(bucket)
            self.timeline.watch(batch, self.num_stages - 1, received)  # when the output arrived
            return _ReceivedStep(received)
        if out is None:
            return _FollowerStep(waits)
        return PendingStep(out)


class _ReceivedStep(PendingStep):
    """The last stage's SampleOutput as the leader received it from another process: each leaf
    with a leading block axis of 1."""

    def result(self) -> SampleOutput:
        out = jax.tree.map(lambda x: np.asarray(x.addressable_data(0))[0], self.output)
        if int(out.unresolved_tokens):
            raise RuntimeError(f"{int(out.unresolved_tokens)} token(s) of the step were not on the device: the "
                               "persistent batch state is out of step with the scheduler")
        return out


class _FollowerStep:
    """A step on a process that does not receive its output: `result()` waits for this
    process's part (its stages and links), raising its errors, and returns None."""

    def __init__(self, waits: list):
        self.output = waits

    def result(self) -> None:
        jax.block_until_ready(self.output)


def _linked(step, receives: bool, sends: bool):
    """A stage's program when a neighbour is on another process: the activations come in as
    the link's block [1, T, D], and what goes out to a link (activations, or the SampleOutput)
    leaves as blocks [1, ...]."""
    def linked(params, kv_cache, state, inputs, hidden=None):
        if receives:
            hidden = hidden[0]
        kv_cache, state, out = step(params, kv_cache, state, inputs, hidden)
        if sends:
            out = jax.tree.map(lambda x: x[None], out)
        return kv_cache, state, out
    return linked


def _put_host_leaves(inputs: StepInputs, mesh: Mesh) -> StepInputs:
    """The step's numpy inputs, replicated on a stage's devices; arrays already there stay."""
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else parallel.put_replicated(x, mesh), inputs)


def _without_hidden(step):
    """The first stage's program: no activations come in."""
    def first_stage(params, kv_cache, state, inputs):
        return step(params, kv_cache, state, inputs)
    return first_stage
