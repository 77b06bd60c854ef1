"""LLMEngine: the one host loop. Each `step()` is

    dispatch step N+1 (orca_jax/engine/step.py: schedule -> runner.dispatch, which builds the step's
        small inputs and enqueues its program without waiting)
    complete step N   (wait for its tokens -> scheduler.postprocess, which appends them, applies
        the stop rules and retires) -> outputs (log-probs, text deltas)

With `async_scheduling` (the default) one step stays in flight: step N+1 is dispatched before
step N is completed, so the device runs N+1 while the host postprocesses N and then schedules
and builds N+2. The device feeds each sampled token to the next step itself (the persistent
batch state, orca_jax/worker/batch_state.py), so N+1 needs nothing from N's result. A sequence that
N ends (EOS, stop string, max tokens) has one more token computed in N+1; postprocess discards
it, and its pages were freed with the sequence. With async_scheduling=False each call
dispatches a step and completes it: the same tokens, one step at a time.

Requests enter with `add_request` (validated there, so a bad request fails alone, before it
touches the scheduler) and leave when every sample has finished or on `abort`.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import itertools
import logging
import time
from pathlib import Path
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

import jax
import numpy as np

from orca_jax.worker import multihost
from orca_jax.distributed import parallel
from orca_jax.worker.compilation_cache import active_cache_dir, configure_for_process
from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.kernels.gpu_info import compute_capability
from orca_jax.loading.dtype_policy import auto_dtype_reason, check_dtype_supported, resolve_model_dtype
from orca_jax.kernels.quantization import resolve_method
from orca_jax.engine.detokenizer import IncrementalDetokenizer, detokenize_step
from orca_jax.errors import CONSTRAINT_FAILED, RequestError, check_unicode
from orca_jax.structured.guided_decoding import GrammarCompiler, GuidedState
from orca_jax.structured.token_rules import TokenRules
from orca_jax.kernels import resolve_impl
from orca_jax.core.kv_cache import PageAllocator
from orca_jax.loading.generation_config import sampling_defaults
from orca_jax.loading.loader import load_model, load_tokenizer_from
from orca_jax.engine.outputs import RequestOutput
from orca_jax.engine.request import Request, make_output, split_prompt
from orca_jax.worker.pipeline import PipelineRunner
from orca_jax.worker.pipeline_layout import make_pipeline_mesh
from orca_jax.worker.runner import ModelRunner
from orca_jax.core.sampling_params import SamplingParams
from orca_jax.core.scheduler import Scheduler
from orca_jax.core.sequence import Sequence
from orca_jax.spec_decode.draft_model import DraftModelProposer
from orca_jax.spec_decode.proposing import NgramSequenceProposer, Speculation
from orca_jax.engine.step import (EngineRunner, InFlightStep, StepFailed, StepResult, complete_step, dispatch_step,
                           recompute_running)
from orca_jax.engine.step_timing import StepTimeline

logger = logging.getLogger(__name__)

# How long an engine with nothing to run but grammars compiling waits for one before its step
# returns (so a caller's loop neither spins nor misses new requests for long).
GRAMMAR_WAIT_S = 0.05

# Seed offset between the n samples of one seeded request: 2**32 / golden ratio, odd, so the
# n seeds are distinct mod 2**32 and spread over its range rather than adjacent.
SAMPLE_SEED_STRIDE = 0x9E3779B9


def release_free_host_memory() -> None:
    """Hand memory freed after loading (host copies of the weights) back to the OS; glibc keeps
    it otherwise, and resident memory would stay one weight copy too high."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _resolve_auto_dtype(config: EngineConfig) -> EngineConfig:
    """dtype="auto" made concrete for this backend, GPU and checkpoint, before the model loads
    in it; an explicit dtype the GPU cannot run (bfloat16 below sm_80) is refused here."""
    backend, capability = jax.default_backend(), compute_capability(jax.local_devices()[0])
    dtype = resolve_model_dtype(config.dtype, backend, config.model, config.revision, capability=capability)
    if config.dtype != "auto":
        return config
    logger.info("dtype auto: %s", auto_dtype_reason(dtype, backend, capability))
    return dataclasses.replace(config, dtype=dtype)


class LLMEngine:
    """`make_runner` is the seam between the host loop and the device: called as
    `make_runner(model_config, config, params, attention_impl, mesh, channel)`, it returns the
    `EngineRunner` the engine steps (default: the compiled model, `ModelRunner`, or with
    pipeline_parallel_size > 1 its stages, `orca_jax.worker.pipeline.PipelineRunner`). Tests pass
    `functools.partial(ModelRunner, keep_logits=True)` to see each step's logits in
    `last_step.output`, or a wrapper to observe or fail batches.

    `devices`: the devices of this engine when it is one data-parallel replica of several
    (`orca_jax.engine.replicas`): its mesh is made of them alone, even of one device, and it
    talks to no other process. None: the first tensor x pipeline devices, as always."""

    def __init__(self, config: EngineConfig | None = None, *, warmup: bool = True,
                 make_runner: Callable[..., EngineRunner] | None = None, devices=None, **overrides):
        started = time.perf_counter()
        config = config or EngineConfig(**overrides)
        if config.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: one LLMEngine is one replica; "
                             "build the replicas with orca_jax.engine.replicas.build_replicas (LLM and serve do)")
        self.devices = list(devices) if devices is not None else None
        configure_for_process(config.compilation_cache_dir or None)
        config = _resolve_auto_dtype(config)
        loaded = load_model(config.model, dtype=config.dtype, cache_dir=config.model_cache_dir,
                            quantization=resolve_method(config.quantization, jax.local_devices()[0]),
                            revision=config.revision)
        loaded_at = time.perf_counter()
        self.model_config = loaded.config
        check_dtype_supported(config.dtype, jax.default_backend(), model_type=loaded.config.model_type)
        self.config = config.resolve(loaded.config)
        self.tokenizer = loaded.tokenizer if config.tokenizer is None else load_tokenizer_from(config.tokenizer)
        # What a request's missing sampling fields take (--generation-config).
        self.sampling_defaults = sampling_defaults(config.generation_config, Path(loaded.source))
        self._check_sampling_defaults()
        self.attention_impl = resolve_impl(self.config.attention_impl)
        # A mesh for tensor parallelism, and always with several processes (multi-host): then
        # process 0 (this engine's scheduler) hands every batch to the others.
        mesh = None
        pipelined = self.config.pipeline_parallel_size > 1
        # A replica's devices are all this process's, so no other process runs its steps.
        spans_processes = jax.process_count() > 1 and self.devices is None
        if pipelined:  # a stage x model mesh; each stage a row (orca_jax/worker/pipeline.py)
            parallel.kv_head_repeats(loaded.config, self.config.tensor_parallel_size)  # refuse early
            mesh = make_pipeline_mesh(self.config.pipeline_parallel_size, self.config.tensor_parallel_size,
                                      self.devices, replica=self.devices is not None)
        elif self.config.tensor_parallel_size > 1 or spans_processes or self.devices is not None:
            parallel.kv_head_repeats(loaded.config, self.config.tensor_parallel_size)  # refuse early
            mesh = parallel.make_mesh(self.config.tensor_parallel_size, self.devices, replica=self.devices is not None)
        make_runner = make_runner or (PipelineRunner if pipelined else ModelRunner)
        self.channel = multihost.StepChannel(self.config) if spans_processes and multihost.is_leader_of_many() else None
        if self.channel is not None:
            # However the leader's program ends, release the followers (they would otherwise
            # wait in their next collective until jax.distributed's heartbeat gives up).
            atexit.register(self.shutdown)
        params, loaded.params = loaded.params, None  # the runner takes the only reference
        self.runner = make_runner(loaded.config, self.config, params, self.attention_impl, mesh, self.channel)
        del params
        # The runner lowers max_model_len to what the KV pool holds when it came from the model.
        self.config = self.runner.config
        if self.channel is not None:
            self.channel.config = self.config
        release_free_host_memory()
        self.allocator = PageAllocator(self.runner.num_pages, self.config.page_size)
        self.scheduler = Scheduler(self.config, self.allocator)
        self.eos_token_ids = set(loaded.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.requests: dict[str, Request] = {}
        # Constrained decoding: grammars compile on the compiler's thread; requests wait for
        # theirs in _awaiting_grammar, and their sequences are not admitted until it is ready.
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self._awaiting_grammar: list[tuple[Request, Future]] = []
        self.speculation = self._make_speculation()
        self._seq_ids = itertools.count()
        self._seed_rng = np.random.default_rng(self.config.seed)
        self._finished_outside_step: list[Request] = []  # aborted between steps, reported next step
        self._in_flight: deque[InFlightStep] = deque()  # dispatched, not yet completed (oldest first)
        self.num_steps = 0  # steps completed (or failed)
        self.num_dispatched = 0
        self.last_step: StepResult | None = None  # the step this step() call completed, if any (tests, introspection)
        self.timeline = StepTimeline()  # per-step host parts and device timestamps, while enabled (bench host)
        self._completed_timing = None  # the timeline record of the step this step() call completed
        self._detokenize_s = 0.0  # seconds detokenizing in the step being completed
        # Seconds per start-up phase (and warm-up's program counts), for logs and `bench startup`.
        self.startup_timings: dict[str, float] = {
            "load_model_s": loaded_at - started,
            **{f"loader_{name}": seconds for name, seconds in loaded.timings.items()},
            **self.runner.timings,
            "engine_init_s": time.perf_counter() - loaded_at,
        }
        self._log_settings()
        self.replica_index = 0  # which data-parallel replica this engine is (orca_jax.engine.replicas)
        if warmup:
            self.warmup()
        self.startup_timings["startup_s"] = time.perf_counter() - started
        self.ready_at = time.monotonic()  # the clock of RequestOutput's arrival and first-token times
        logger.info("engine ready in %.1f s: %s", self.startup_timings["startup_s"], ", ".join(
            f"{name.removesuffix('_s')} {seconds:.2f} s" for name, seconds in self.startup_timings.items()
            if name.endswith("_s") and name != "startup_s"))

    def warmup(self):
        """Build every step program (the target's, and a draft model's) before serving; what the
        constructor does unless warmup=False. Returns the runner's WarmupReport."""
        report = self.runner.warmup()
        if self.speculation is not None:
            draft = self.speculation.warmup()
            if draft is not None:
                report = dataclasses.replace(report, seconds=report.seconds + draft.seconds,
                                             counts=report.counts + draft.counts)
        self.startup_timings.update(warmup_s=report.seconds, warmup_programs=report.counts.programs,
                                    warmup_cache_hits=report.counts.cache_hits)
        return report

    def _make_speculation(self) -> Speculation | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        # A proposal continues the tokens the last step accepted: the host must have them before
        # it schedules the next step, so proposing steps run one at a time; with async
        # scheduling the engine overlaps steps again while speculation does not pay.
        overlap = self.config.async_scheduling
        if spec.method == "ngram":
            return Speculation(spec, NgramSequenceProposer(spec), overlap)
        proposer = DraftModelProposer(self.config, spec.model, self.attention_impl, self.runner.num_pages,
                                      mesh=self.runner.mesh if self.devices is not None else None)
        logger.info("speculative decoding: draft model %s (%s, %d layers), %d draft tokens per step",
                    proposer.source, proposer.model_config.model_type, proposer.model_config.num_layers,
                    spec.num_speculative_tokens)
        return Speculation(spec, proposer, overlap)

    def _log_settings(self) -> None:
        c = self.config
        logger.info(
            "engine: model %s (%s, %d layers), dtype %s, weights %s, kv cache dtype %s, attention %s, max_model_len %d%s, "
            "max_num_seqs %d, max_num_batched_tokens %d, token buckets %s, page_size %d, KV pool %d pages "
            "(%d tokens), scheduling %s, async scheduling %s, tensor_parallel_size %d, pipeline_parallel_size %d, "
            "compilation cache %s",
            c.model or "default", self.model_config.model_type, self.model_config.num_layers, c.dtype,
            _weights_description(self.model_config), self.runner.kv_dtype.name, self.attention_impl, c.max_model_len,
            " (the model's)" if c.max_model_len == self.model_config.max_position_embeddings else "",
            c.max_num_seqs, c.max_num_batched_tokens, list(c.token_buckets), c.page_size, self.allocator.num_pages,
            self.allocator.num_usable * c.page_size, c.scheduling, "on" if c.async_scheduling else "off",
            c.tensor_parallel_size, c.pipeline_parallel_size,
            active_cache_dir() or "off",
        )

    # ---- requests in ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    *, cache_salt: str | None = None) -> None:
        """Validate and queue a request. `prompt`: text, token ids, or vLLM's prompt dicts
        ({"prompt": text} or {"prompt_token_ids": ids}, either with an optional "cache_salt").
        `cache_salt` (vLLM's field): the request shares prefix-cache pages only with requests
        of the same salt. Raises RequestError (a ValueError naming the bad argument) or
        TypeError, and changes nothing, if it is bad."""
        self.add_requests([(request_id, prompt, params)], cache_salt=cache_salt)

    def add_requests(self, requests: list[tuple[str, str | list[int] | dict, SamplingParams | None]], *,
                     cache_salt: str | None = None) -> None:
        """Validate and queue several requests (request id, prompt, params), all or none: the
        first bad one raises as add_request does, and then none is queued. `cache_salt` salts
        every one of them whose prompt dict does not carry its own."""
        prepared: dict[str, Request] = {}
        for request_id, prompt, params in requests:
            if request_id in prepared:
                raise RequestError(f"request id {request_id!r} is already in use", None, "duplicate_request_id")
            prepared[request_id] = self._prepare(request_id, prompt, params, cache_salt)
        for request in prepared.values():
            self._queue(request)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended values (generation_config.json) where it
        has them: what a request without params gets."""
        return SamplingParams(**self.sampling_defaults)

    def _check_sampling_defaults(self) -> None:
        try:
            self.default_sampling_params()
        except RequestError as exc:
            raise ValueError(f"--generation-config {self.config.generation_config}: the model's "
                             f"generation_config.json holds a value SamplingParams refuses: {exc}") from None

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab_size = self.model_config.vocab_size
        outside = sorted(t for t in (params.logit_bias or {}) if t >= vocab_size)
        if outside:
            raise RequestError(f"logit_bias token ids {outside[:5]} are outside the vocabulary (size {vocab_size})",
                               "logit_bias")

    def _prepare(self, request_id: str, prompt, params: SamplingParams | None, cache_salt: str | None) -> Request:
        """Everything add_request checks, without touching the engine's state."""
        prompt, cache_salt = split_prompt(prompt, cache_salt)
        params = params or self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", None, "duplicate_request_id")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise RequestError(f"logprobs={params.logprobs} exceeds max_logprobs={self.config.max_logprobs}",
                               "logprobs")
        if params.structured_outputs is not None:
            self.grammars.validate(params.structured_outputs)
        self._check_prompt_logprobs(params)
        self._check_logit_bias(params)
        text, token_ids = self._tokenize(prompt)
        token_ids = self._truncated(token_ids, params.truncate_prompt_tokens)
        rules = TokenRules.build(params, self._encode_plain, self.eos_token_ids, self.model_config.vocab_size)
        seqs = [Sequence(next(self._seq_ids), request_id, i, token_ids, params, seed=0, cache_salt=cache_salt,
                         token_rules=rules)
                for i in range(params.n)]
        if params.structured_outputs is not None:
            starts_after = params.structured_outputs.starts_after
            waits_for = tuple(self._encode_plain(starts_after)) if starts_after else None
            for seq in seqs:
                seq.guided = GuidedState(waits_for)
        self._validate_lengths(seqs[0])
        detoks = [
            IncrementalDetokenizer(self.tokenizer, token_ids, params.stop, params.include_stop_str_in_output,
                                   min_tokens=params.min_tokens, skip_special_tokens=params.skip_special_tokens)
            for _ in seqs
        ]
        request = Request(request_id, text, token_ids, params, seqs, detoks)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(token_ids)
        return request

    def _check_prompt_logprobs(self, params: SamplingParams) -> None:
        if params.prompt_logprobs is None:
            return
        if not getattr(self.runner, "prompt_logprobs", False):
            raise RequestError("prompt_logprobs are computed on one device only; this engine shards the model "
                               "(tensor or pipeline parallelism)", "prompt_logprobs")
        if params.prompt_logprobs > self.config.max_logprobs:
            raise RequestError(f"prompt_logprobs={params.prompt_logprobs} exceeds max_logprobs="
                               f"{self.config.max_logprobs}", "prompt_logprobs")

    def _queue(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for seq in request.seqs:
            # Seeds are drawn only for accepted requests, so a rejected one leaves the
            # engine's seed stream where it was.
            seq.seed = self._sample_seed(request.params, seq.index)
            seq.arrival_time = request.arrival_time
            self.scheduler.add(seq)
        if request.params.structured_outputs is not None:
            self._awaiting_grammar.append((request, self.grammars.compile(request.params.structured_outputs)))

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty", "prompt")
            check_unicode(prompt, "prompt")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple, np.ndarray)):
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
                raise RequestError("prompt token ids must be integers", "prompt")
            ids = [int(t) for t in prompt]
            if not ids:
                raise RequestError("prompt is empty", "prompt")
            vocab_size = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise RequestError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}", "prompt")
            return None, ids
        raise TypeError(f"prompt must be a string, a list of token ids or a prompt dict, got {type(prompt).__name__}")

    def _truncated(self, token_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len)."""
        if keep is None:
            return token_ids
        keep = self.config.max_model_len if keep == -1 else keep
        return token_ids[-keep:]

    def _encode_plain(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _validate_lengths(self, seq: Sequence) -> None:
        """The prompt leaves room for a generated token, and one sample at its longest fits
        in the KV pool (each of the n samples is its own sequence and can run alone: the
        scheduler preempts or waits). A max_tokens past max_model_len is not an error here:
        generation stops at max_model_len, as in vLLM's offline API."""
        max_len = self.config.max_model_len
        if seq.num_prompt_tokens >= max_len:
            raise RequestError(
                f"prompt is {seq.num_prompt_tokens} tokens, but max_model_len is {max_len}: "
                "it must leave room for at least one generated token", "prompt", "context_length_exceeded"
            )
        needed = self.allocator.pages_needed(self.scheduler.max_len(seq))
        if needed > self.allocator.num_usable:
            raise RequestError(
                f"request needs {needed} KV pages at full length, the cache has "
                f"{self.allocator.num_usable}; lower max_tokens or raise num_pages", "max_tokens"
            )

    def _sample_seed(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return int(self._seed_rng.integers(0, 2**32))
        # Distinct, reproducible streams for the n samples of one seeded request (any integer
        # seed, negative or past 64 bits, folds into the 32 bits the step keys on).
        return (params.seed + index * SAMPLE_SEED_STRIDE) % 2**32

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages. Returns False if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self._finished_outside_step.append(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._finished_outside_step) or bool(self._in_flight)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One model iteration: dispatch the next step, and complete the one before it (async
        scheduling) or this one (sync). Returns an output for every request that produced new
        text or tokens, or finished (an async call that only dispatched returns the aborts)."""
        touched = {r.request_id: r for r in self._finished_outside_step}
        self._finished_outside_step.clear()
        self.last_step = None  # set again only if a step completes
        self._start_compiled_grammars(touched)
        proposing = self.speculation is not None and self.speculation.proposes_for(len(self.scheduler.running))
        pipelined = self.config.pipeline_parallel_size > 1
        if (self.scheduler.num_needing_host_tokens and not pipelined) or proposing:
            # A grammar's mask (or a multi-token bad word's), and a proposal, need the tokens
            # before them on the host: steps
            # in flight complete first, so steps run one at a time. (Pipelined, Orca's rule
            # already schedules a sequence only once its last batch has returned.)
            while self._in_flight:
                self._complete(self._in_flight.popleft(), touched)
        if proposing:
            self.speculation.propose(self.scheduler.running, self.scheduler.max_len)
        dispatched = self._dispatch(touched)
        if pipelined:  # Orca: up to one batch in flight per stage, of disjoint sequences
            while dispatched and len(self._in_flight) < self.config.pipeline_parallel_size and self._dispatch(touched):
                pass
        if not dispatched and not self._in_flight and self._awaiting_grammar:
            wait([future for _, future in self._awaiting_grammar], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        if pipelined:
            self._complete_pipelined(dispatched, touched)
        else:
            in_flight_wanted = 1 if self.config.async_scheduling and not proposing else 0
            # With nothing new to dispatch, whatever is in flight completes now; and once no
            # request is left, so does the step that only computed discarded tokens, so that an
            # engine with no requests has no device work pending either.
            while self._in_flight and (len(self._in_flight) > in_flight_wanted or not dispatched
                                       or not self.scheduler.has_unfinished()):
                self._complete(self._in_flight.popleft(), touched)
        if self.speculation is not None:
            self.speculation.release_finished()
        started = time.perf_counter()
        outputs = [o for r in touched.values() if (o := make_output(r)) is not None]
        for r in touched.values():
            if r.finished:
                del self.requests[r.request_id]
        if self.last_step is not None and self._completed_timing is not None:
            self._completed_timing.outputs_s += time.perf_counter() - started
        return outputs

    def _complete_pipelined(self, dispatched: bool, touched: dict[str, Request]) -> None:
        """Orca's loop over a pipeline: the oldest batch completes once every stage has one (or
        when no further batch could be dispatched: its sequences are all in flight), so the
        stages stay busy while the host postprocesses it. With no request left, all complete."""
        if not self.scheduler.has_unfinished():
            while self._in_flight:
                self._complete(self._in_flight.popleft(), touched)
        elif self._in_flight and (len(self._in_flight) >= self.config.pipeline_parallel_size or not dispatched):
            self._complete(self._in_flight.popleft(), touched)

    def _start_compiled_grammars(self, touched: dict[str, Request]) -> None:
        """Give the sequences whose grammar has compiled their matchers (they can be admitted
        from now on); fail, alone, a request whose grammar did not compile."""
        still_waiting = []
        for request, future in self._awaiting_grammar:
            if request.finished:  # aborted while it waited
                continue
            if not future.done():
                still_waiting.append((request, future))
                continue
            error = future.exception()
            if error is not None:
                logger.error("request %s: grammar compile failed: %s", request.request_id, error)
                self._fail_request(request, f"structured output grammar: {error}")
                touched[request.request_id] = request
                continue
            for seq in request.seqs:
                self.grammars.start(seq.guided, future.result())
        self._awaiting_grammar = still_waiting

    def _fail_request(self, request: Request, error: str) -> None:
        """End a request that failed inside the engine: its error is reported, its unfinished
        sequences are aborted (pages and slots freed)."""
        request.error = error
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def _dispatch(self, touched: dict[str, Request]) -> bool:
        """Schedule and dispatch the next step. False when nothing could be dispatched."""
        mode = "async" if self.config.async_scheduling else "sync"
        gc_before = self.timeline.gc_seconds()
        try:
            step = dispatch_step(self.scheduler, self.runner, self.timeline, self.num_dispatched, mode)
        except StepFailed as failure:  # one bad step must not take the engine down
            # Steps already in flight ran on the state before this one: their tokens stand.
            while self._in_flight:
                self._complete(self._in_flight.popleft(), touched)
            self.num_steps += 1
            for request in self._fail_step(failure):
                touched[request.request_id] = request
            return False
        if step is None:
            return False
        if step.timing is not None:
            step.timing.gc_s = self.timeline.gc_seconds() - gc_before
        self.num_dispatched += 1
        self._in_flight.append(step)
        return True

    def _complete(self, step: InFlightStep, touched: dict[str, Request]) -> None:
        """Wait for a dispatched step, postprocess it, record its tokens."""
        gc_before = self.timeline.gc_seconds()
        self._detokenize_s = 0.0
        try:
            result = complete_step(self.scheduler, step, self._stop_rule)
        except StepFailed as failure:
            self.num_steps += 1
            for request in self._fail_step(failure):
                touched[request.request_id] = request
            return
        self.num_steps += 1
        self.last_step = result
        if self.speculation is not None:
            self.speculation.record(result.update.verified, len(result.scheduled))
        recording = time.perf_counter()
        if result.output.prompt is not None:
            self._record_prompt_logprobs(result)
        for request in self._record_new_tokens(result):
            touched[request.request_id] = request
        self._completed_timing = step.timing
        if step.timing is not None:
            step.timing.outputs_s = time.perf_counter() - recording  # step() adds building the outputs
            step.timing.detokenize_s = self._detokenize_s
            step.timing.postprocess_s -= self._detokenize_s
            step.timing.gc_s += self.timeline.gc_seconds() - gc_before

    def _stop_rule(self, seqs: list[Sequence], tokens: list[int]):
        """Per sequence that got a token: EOS, stop token ids, then stop strings (the length
        limit is the scheduler's). The tokens that neither ends are detokenized, which finds
        the stop strings."""
        stops: list = [None] * len(seqs)
        text_rows = []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            params = seq.params
            if not params.ignore_eos and token in self.eos_token_ids:
                stops[i] = ("stop", None)
            elif token in params.stop_token_ids:
                stops[i] = ("stop", token)
            else:
                text_rows.append(i)
        started = time.perf_counter()
        detoks = [self.requests[seqs[i].request_id].detokenizers[seqs[i].index] for i in text_rows]
        for i, stop_str in zip(text_rows, detokenize_step(detoks, [tokens[i] for i in text_rows])):
            if stop_str is not None:
                stops[i] = ("stop", stop_str)
        self._detokenize_s += time.perf_counter() - started
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.guided is not None and stops[i] is None:
                stops[i] = self._advance_grammar(seq, token)
            elif seq.guided is not None and seq.guided.dormant and stops[i][0] == "stop":
                stops[i] = self._fail_constraint(seq, "the output ended before its reasoning did, so its "
                                                      "constraint never began")
        return stops

    def _advance_grammar(self, seq: Sequence, token: int):
        """Feed a constrained sequence's new token to its matcher: it stops once the grammar
        is complete (nothing but the end can follow), without spending a step on EOS. If the
        matcher refuses the token or gives up, the output cannot satisfy its constraint: the
        request fails with CONSTRAINT_FAILED (never a normal stop)."""
        accepted = seq.guided.accept(token)
        if accepted and not seq.guided.failed:
            return ("stop", None) if seq.guided.finished else None
        return self._fail_constraint(seq, _first_line(seq.guided.error) or f"token {token} refused")

    def _fail_constraint(self, seq: Sequence, reason: str):
        logger.error("sequence %d: its output constraint failed (%s); failing its request", seq.seq_id, reason)
        request = self.requests.get(seq.request_id)
        if request is not None and request.error is None:
            request.error = f"{CONSTRAINT_FAILED}: {reason}"
        return ("abort", None)

    def _record_prompt_logprobs(self, result: StepResult) -> None:
        """Store the prompt log-probabilities the step computed, by prompt position (a
        recomputed prompt after preemption writes the same values again)."""
        computed = result.output.prompt
        owners = _step_prompt_positions(result.scheduled)
        if not owners:
            return
        rows = list(owners)
        chosen = computed.target_logprobs[rows].tolist()
        ids, lps = computed.top_ids[rows].tolist(), computed.top_logprobs[rows].tolist()
        for j, t in enumerate(rows):
            seq, position = owners[t]
            request = self.requests.get(seq.request_id)
            if request is None or request.prompt_logprobs is None:
                continue
            k = seq.params.prompt_logprobs
            top = dict(zip(ids[j][:k], lps[j][:k]))
            top[seq.prompt_token_ids[position]] = chosen[j]
            request.prompt_logprobs[position] = top

    def _record_new_tokens(self, result: StepResult) -> list[Request]:
        """First-token times and log-probabilities of the sequences that got a token; the
        held-back text of those that finished other than on a stop string is released."""
        now, out, touched = time.monotonic(), result.output, []
        wanting = [(row, seq) for row, seq in result.advanced if seq.params.logprobs is not None]
        if wanting:  # one host conversion per step, not one per element
            rows = [row for row, _ in wanting]
            ids, lps, chosen = out.top_ids[rows].tolist(), out.top_logprobs[rows].tolist(), out.logprobs[rows].tolist()
            tokens = out.tokens[rows].tolist()
            for j, (_, seq) in enumerate(wanting):
                k = seq.params.logprobs
                top = dict(zip(ids[j][:k], lps[j][:k]))
                top[tokens[j]] = chosen[j]
                seq.output_logprobs.append(top)
        for _, seq in result.advanced:
            if seq.first_token_time is None:
                seq.first_token_time = now
            touched.append(self.requests[seq.request_id])
        for seq in result.finished:
            if not isinstance(seq.stop_reason, str):
                self.requests[seq.request_id].detokenizers[seq.index].flush()
        return touched

    def _fail_step(self, failure: StepFailed) -> list[Request]:
        """A step raised: fail the requests in it, keep the others. If the failed call consumed
        the donated cache and state, or steps dispatched after it built on its state, those
        steps are dropped, the cache and state rebuilt, and every running sequence recomputes."""
        scheduled = failure.scheduled
        self.scheduler.batch_returned(scheduled)  # it holds its sequences no longer (pages they gave up return)
        logger.error("step failed; aborting %d request(s) in it", len({s.request_id for s in scheduled.seqs}),
                     exc_info=failure.cause)
        # The pages it was to fill hold no K/V: a later request must not find them.
        self.scheduler.forget_published(scheduled)
        failed = {seq.request_id: self.requests[seq.request_id] for seq in scheduled.seqs
                  if seq.request_id in self.requests}
        for request in failed.values():
            self._fail_request(request, str(failure))
        if self.runner.kv_cache_lost or (failure.dispatched and self._in_flight):
            for dropped in reversed(self._in_flight):
                self.scheduler.unschedule(dropped.scheduled)
            self._in_flight.clear()
            self.runner.reset_kv_cache()
            recompute_running(self.scheduler)
        return list(failed.values())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's: call it after changing the weights). Pages
        held by running sequences stay theirs; only later lookups miss. Always succeeds."""
        dropped = self.scheduler.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached pages forgotten", dropped)
        return True

    def shutdown(self) -> None:
        """Release the other processes of a multi-host run (they leave their step loop and
        exit), and stop the grammar compiler's thread. Idempotent."""
        self.grammars.shutdown()
        if self.channel is not None:
            self.channel.send_stop()

    # ---- introspection -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free


def _first_line(message: str) -> str:
    return message.split("\n")[0].strip()


def _step_prompt_positions(scheduled) -> dict[int, tuple[Sequence, int]]:
    """Flattened token index -> (sequence, prompt position of the token it predicts), for the
    tokens whose prompt log-probabilities the step computed (batch_state._prompt_targets)."""
    owners, offset = {}, 0
    for seq, start, num_new in zip(scheduled.seqs, scheduled.starts, scheduled.num_new):
        if seq.params.prompt_logprobs is not None and seq.index == 0:
            stop = min(start + num_new, seq.num_prompt_tokens - 1)
            for i, position in enumerate(range(start, stop)):
                owners[offset + i] = (seq, position + 1)
        offset += num_new
    return owners


def _weights_description(model: ModelConfig) -> str:
    """How the weights are stored, for the start-up log: the dense format, and the experts' own."""
    dense = model.quantization or "not quantized"
    return f"{dense}, experts {model.expert_format}" if model.expert_format else dense
