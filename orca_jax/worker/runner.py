"""The jitted model step and its ahead-of-time compiled programs, one per token bucket.

    step(params, kv_cache, state, inputs) -> (kv_cache, state, SampleOutput)

`state` is the persistent batch (`orca_jax.worker.batch_state.DeviceState`: page tables, last sampled
tokens, penalty counts per slot) and `inputs` the step's small `StepInputs`; the program first
expands them into the step's `Batch`, runs the model, samples, and keeps the sampled tokens in
the state. Everything the step reads is an argument; the KV cache and the state are donated
so XLA updates them in place.

`dispatch(scheduled)` builds the inputs, enqueues the program and returns at once with a
`PendingStep`, whose `result()` is the one device -> host copy: the engine can dispatch the
next step before it reads this one. Programs are built ahead of time, one per token bucket
(`jit(...).lower(...).compile()`, which JAX's persistent cache turns into a load on a second
start): all of them by `warmup()`, the compiles in a thread pool, or each on first use. A step
only ever calls those executables, so a shape outside the buckets is an error, never a silent
recompile.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from orca_jax.worker import step_export
from orca_jax.loading import checkpoint
from orca_jax.distributed import parallel
from orca_jax.worker.batch_state import (BatchState, StepInputs, create_device_state, create_token_counts,
                                  empty_step_inputs, expand, record_sampled)
from orca_jax.worker.compilation_cache import active_cache_dir
from orca_jax.worker.compile_guard import compile_counts
from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.core.kv_cache import choose_num_pages, create_kv_cache, fit_context_to_pool
from orca_jax.models import architecture
from orca_jax.worker.sampling import sample
from orca_jax.worker.rejection import verify_drafts
from orca_jax.worker.runner_base import PendingStep, RunnerBase, WarmupReport, compile_workers, with_placed_neutral_fields

logger = logging.getLogger(__name__)


def model_step(model: nn.Module, max_logprobs: int, keep_logits: bool, page_size: int,
               logits_rows: Callable[[int], int] | None, prompt_logprobs: bool, params, kv_cache, state,
               inputs: StepInputs):
    """The model on one step, then sampling: (updated kv_cache, updated state, SampleOutput).
    `logits_rows` (speculative decoding: EngineConfig.logits_rows) gives a bucket's output
    positions; the drafts in the step are then verified (orca_jax.worker.rejection).
    `prompt_logprobs`: the program can also return the log-probabilities of the prompt tokens
    the step prefills (SampleOutput.prompt; the work is skipped in a step that asks none)."""
    num_positions = None if logits_rows is None else logits_rows(inputs.num_tokens)
    state, batch, counts, unresolved = expand(state, inputs, page_size, num_positions)
    if prompt_logprobs:
        logits, kv_cache, prompt = model.apply(params, batch.input_ids, kv_cache, batch.metadata,
                                               batch.logits_indices, prompt_targets=inputs.prompt_targets,
                                               prompt_k=max(1, max_logprobs))
    else:
        (logits, kv_cache), prompt = model.apply(params, batch.input_ids, kv_cache, batch.metadata,
                                                 batch.logits_indices), None
    if batch.verify is None:
        out = sample(logits, batch.sampling, max_logprobs, counts)
    else:
        out = verify_drafts(logits, batch.sampling, batch.verify, inputs.row_slot.shape[0], max_logprobs, counts)
    state = record_sampled(state, inputs, out.tokens, batch.verify, out.num_accepted)
    # keep_logits: tests and debugging see the rows sampling saw, from the same program.
    out = dataclasses.replace(out, unresolved_tokens=unresolved, logits=logits if keep_logits else None,
                              prompt=prompt)
    return kv_cache, state, out


class ModelRunner(RunnerBase):
    """Owns the weights, the KV cache and the compiled step programs.

    `mesh` (tensor parallelism, see `orca_jax.distributed.parallel`): weights, cache and batch carry
    NamedShardings and every program is jitted with them explicitly; None keeps the
    single-device path exactly as it is. `params` is the converted weights as numpy
    ({"params": ...}) or a restorable checkpoint (`orca_jax.loading.checkpoint.Checkpoint`), which
    restores straight into the shardings. `channel` (multi-host leader): every batch is
    handed to the other processes before it runs, so they run the same program.
    `keep_logits`: each step also returns the logits it sampled from (`SampleOutput.logits`,
    f32[S, V]), for tests and debugging; serving leaves it off (the copy costs S x V floats).

    This is the engine's runner (`orca_jax.engine.step.EngineRunner`); anything with that interface
    can stand in for it (`LLMEngine(make_runner=...)`)."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, params, attention_impl: str,
                 mesh: Mesh | None = None, channel=None, *, keep_logits: bool = False):
        self.config = config
        self.mesh = mesh
        self.channel = channel
        self.dtype = jnp.dtype(config.dtype)
        tp = mesh.shape[parallel.MODEL_AXIS] if mesh is not None else 1
        # A mixture of experts' experts: split whole over the mesh, or each along its width.
        model_config = parallel.expert_layout(model_config, tp, config.enable_expert_parallel)
        # With tensor parallelism, KV heads may be stored replicated (see parallel.kv_head_repeats).
        self.model_config = parallel.sharded_model_config(model_config, tp) if mesh is not None else model_config
        self.model = architecture(model_config.model_type).model_class(
            self.model_config, attention_impl, self.dtype, mesh=mesh)
        start = time.perf_counter()
        # Blocking here (placement is asynchronous) charges each start-up phase its own time.
        self.params = jax.block_until_ready(self._place_params(params, model_config, tp))
        self.timings = {"weights_to_device_s": time.perf_counter() - start}
        self.kv_dtype = jnp.dtype(config.resolved_kv_cache_dtype(jax.default_backend()))
        self.state_sharding = parallel.replicated(mesh) if mesh is not None else None
        # The penalty counts scale with the vocabulary (63 MB at 257 slots, V = 49152): held
        # while the pool is sized from free memory, so the pool leaves room for them.
        reserved = create_token_counts(config, self.model_config.vocab_size, self.state_sharding)
        self.num_pages = choose_num_pages(config, self.model_config, self.kv_dtype,
                                          device=mesh.devices.flat[0] if mesh is not None else None, num_shards=tp)
        del reserved
        if not parallel.is_process_local(mesh):
            # Each process sized the pool from its own free memory; the leader's page tables
            # index every process's cache, so all take the leader's count.
            self.num_pages = int(multihost_utils.broadcast_one_to_all(np.int32(self.num_pages)))
        # The programs' shapes hold max_model_len, so it is final before anything compiles.
        self.config = fit_context_to_pool(config, self.num_pages)
        self.kv_sharding = parallel.kv_cache_sharding(mesh) if mesh is not None else None
        start = time.perf_counter()
        self.reset_kv_cache()
        self.timings["kv_cache_alloc_s"] = time.perf_counter() - start
        # Prompt log-probabilities on one device (a sharded model would gather [T, V] logits);
        # a data-parallel replica of one device has a mesh of one.
        self.prompt_logprobs = mesh is None or mesh.devices.size == 1
        step = self.step_function(self.model, keep_logits)
        donated = ("kv_cache", "state")
        self._exports = None  # the step's serialized exports (step_export.py): one device, one process
        if mesh is None:
            self._step = jax.jit(step, donate_argnames=donated)
            if channel is None and jax.process_count() == 1:
                self._exports = step_export.exports_for(
                    active_cache_dir(), self._program_key(attention_impl, keep_logits), donate_argnums=(1, 2))
        else:
            replicated = parallel.replicated(mesh)
            param_shardings = jax.tree.map(lambda a: a.sharding, self.params)
            # out sharding == in sharding for the cache and the state, so the donated buffers
            # are reused in place.
            self._step = jax.jit(step, in_shardings=(param_shardings, self.kv_sharding, replicated, replicated),
                                 out_shardings=(self.kv_sharding, replicated, replicated), donate_argnames=donated)
        self._init_step_numbers()
        self._programs: dict[int, jax.stages.Compiled] = {}
        self._neutral_fields: dict[tuple[int, str], jax.Array] = {}  # with_placed_neutral_fields

    def step_function(self, model: nn.Module, keep_logits: bool = False):
        """`model_step` with this runner's static parts: (params, kv_cache, state, inputs) ->
        (kv_cache, state, SampleOutput). Also what `cross_lowering` lowers for other platforms."""
        logits_rows = self.config.logits_rows if self.config.num_speculative_tokens else None
        return functools.partial(model_step, model, self.config.max_logprobs, keep_logits, self.config.page_size,
                                 logits_rows, self.prompt_logprobs)

    def _program_key(self, attention_impl: str, keep_logits: bool) -> dict:
        """What fixes the step besides its arguments' shapes (step_export.program_key adds those,
        the sources and the libraries): the partial's static parts, the model and engine config."""
        model = type(self.model)
        return {"model": f"{model.__module__}.{model.__qualname__}", "model_config": repr(self.model_config),
                "engine_config": repr(self.config), "attention_impl": attention_impl, "dtype": self.dtype.name,
                "keep_logits": keep_logits}

    def _place_params(self, params, model_config: ModelConfig, tp: int):
        repeats = parallel.kv_head_repeats(model_config, tp) if self.mesh is not None else 1
        if not isinstance(params, dict):  # a checkpoint: restored straight into the placement
            # ... of the model as laid out here (expert parallelism is not the saved config's).
            placed = dataclasses.replace(params, config=model_config)
            return placed.restore(self.dtype, self.mesh, kv_head_repeats=repeats)
        return checkpoint.place_host_params(params, self.dtype, self.mesh, repeats, config=model_config)

    def _put(self, tree):
        """Host arrays -> device arrays (replicated over the mesh, if any)."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, tree)
        return parallel.put_replicated(tree, self.mesh)

    @property
    def kv_cache_lost(self) -> bool:
        """True after a failed step consumed the donated cache or state (then `reset_kv_cache`)."""
        return self.kv_cache.is_deleted() or any(leaf.is_deleted() for leaf in jax.tree.leaves(self.state))

    def reset_kv_cache(self) -> None:
        """A fresh, zeroed cache and batch state (at start-up, and after a failed step consumed
        the donated ones): every sequence must rejoin its slot, so the scheduler recomputes them."""
        self.kv_cache = create_kv_cache(self.model_config, self.num_pages, self.config.page_size, self.kv_dtype,
                                        sharding=self.kv_sharding).block_until_ready()
        counts = create_token_counts(self.config, self.model_config.vocab_size, self.state_sharding)
        self.state = jax.block_until_ready(create_device_state(self.config, counts, self.state_sharding))
        self.batch_state = BatchState(self.config)

    def warmup(self, buckets: Sequence[int] | None = None) -> WarmupReport:
        """Build the step program of each token bucket (all of them by default) before serving.

        Each is lowered here, in turn (tracing is Python and holds the GIL), and handed to a
        thread pool to compile (XLA releases the GIL), so compiles overlap each other and the
        next lowering. The programs are not run (a first run costs no more than a later one,
        measured on CPU, so running them would only lengthen the start), except to make the
        followers of a multi-host leader build theirs."""
        start, counts_before = time.perf_counter(), compile_counts()
        wanted = self.config.token_buckets if buckets is None else buckets
        todo = [b for b in dict.fromkeys(wanted) if b not in self._programs]
        with ThreadPoolExecutor(max_workers=compile_workers(len(todo)), thread_name_prefix="compile") as pool:
            futures = {b: pool.submit(self._lower(b).compile) for b in todo}
            for bucket, future in futures.items():
                self._programs[bucket] = future.result()
        self._warm_followers(todo)
        report = WarmupReport(tuple(todo), time.perf_counter() - start, compile_counts() - counts_before)
        logger.info(
            "warm-up: %d step programs (token buckets %s) in %.1f s: %d compiled, %d from the compilation cache",
            len(todo), list(todo), report.seconds, report.counts.compiled, report.counts.cache_hits,
        )
        return report

    def _lower(self, bucket: int) -> jax.stages.Lowered:
        self._check_bucket(bucket)
        args = (self.params, self.kv_cache, self.state, empty_step_inputs(self.config, bucket))
        if self._exports is not None:  # read back (no trace) or exported now, then lowered the same way
            return self._exports.lower(self._step, args)
        return self._step.lower(*args)

    def _program(self, inputs: StepInputs) -> jax.stages.Compiled:
        bucket = inputs.num_tokens
        if bucket not in self._programs:  # not warmed up: built on first use
            start = time.perf_counter()
            self._programs[bucket] = self._lower(bucket).compile()
            self.first_use_build_s[bucket] = time.perf_counter() - start
        return self._programs[bucket]

    def run(self, inputs: StepInputs) -> PendingStep:
        """Enqueue one step of this process's part (followers call this directly)."""
        program = self._program(inputs)
        place = jax.device_put if self.mesh is None else functools.partial(parallel.put_replicated, mesh=self.mesh)
        inputs = with_placed_neutral_fields(self._neutral_fields, inputs, place)
        self._note_inputs(inputs)
        # One device: numpy goes straight in. Mesh: a replicated global array per field (built
        # from this process's copy; every process holds the same inputs).
        device_inputs = inputs if self.mesh is None else self._put(inputs)
        self.kv_cache, self.state, out = program(self.params, self.kv_cache, self.state, device_inputs)
        return PendingStep(out, wants_prompt=bool((inputs.prompt_targets >= 0).any()))
