"""LLM: the offline API (vLLM's `LLM.generate` / `LLM.chat`) on top of LLMEngine.

`generate` returns each request's final output and nothing else, so it asks the engine for
"final_only" outputs (as vLLM's LLM does): the engine builds one output per request, at its
finish, instead of one per request per step.

With data_parallel_size > 1 it holds that many engines (`orca_jax.engine.replicas`), routes each
prompt as the server does (`orca_jax.engine.router`) and steps every replica on its own thread
until its prompts are done, so the replicas' device work overlaps.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence as SequenceABC
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from tqdm.auto import tqdm

from orca_jax.entrypoints.chat_template import apply_chat_template
from orca_jax.config import EngineConfig
from orca_jax.engine.engine import LLMEngine
from orca_jax.engine.outputs import RequestOutput
from orca_jax.engine.replicas import build_replicas
from orca_jax.engine.router import PrefixAffinityRouter, default_slack
from orca_jax.core.sampling_params import SamplingParams

# Text, token ids, or vLLM's prompt dicts: {"prompt": text} (TextPrompt) or {"prompt_token_ids":
# ids} (TokensPrompt), either with an optional "cache_salt" (orca_jax/engine/request.py: split_prompt).
Prompt = str | list[int] | dict
Conversation = list[dict]

__all__ = ["LLM", "apply_chat_template"]


class LLM:
    """Offline batched generation.

    >>> llm = LLM()                       # the embedded SmolLM2-135M-Instruct
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0].text
    """

    def __init__(self, model: str | None = None, **engine_args):
        config = EngineConfig(model=model, **engine_args)
        self.replicas = build_replicas(config) if config.data_parallel_size > 1 else [LLMEngine(config)]
        self.engine = self.replicas[0]  # what the replicas share: tokenizer, configs, defaults
        self._router = PrefixAffinityRouter(len(self.replicas), self.engine.config.page_size,
                                            slack=default_slack(self.engine.config.max_num_seqs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what a call without sampling_params uses (the model's generation_config.json
        sampling values, unless generation_config="vllm")."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings, token-id lists, or prompt dicts: a dict with a
        "cache_salt" shares cached prefix pages only with prompts of the same salt); outputs in
        prompt order."""
        prompts = _as_prompt_list(prompts)
        params = _final_only(_as_params_list(sampling_params, len(prompts), self.engine))
        owners: dict[str, LLMEngine] = {}  # request id -> the replica that runs it, in prompt order
        loads = [0] * len(self.replicas)
        try:
            for prompt, p in zip(prompts, params):
                request_id = f"llm-{next(self._ids)}"
                route = self._router.route(prompt, loads)
                self.replicas[route.replica].add_request(request_id, prompt, p)
                self._router.record(route)
                owners[request_id] = self.replicas[route.replica]
                loads[route.replica] += 1
            return self._run(owners, use_tqdm)
        except BaseException:
            for request_id, engine in owners.items():  # leave every engine clean for the next call
                engine.abort(request_id)
            for engine in self.replicas:
                while engine.has_unfinished_requests():
                    engine.step()
            raise

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (the model's, or `chat_template`) to each conversation,
        with the OpenAI-style `tools` it may call and `chat_template_kwargs` as template
        variables, then generate (vLLM's LLM.chat arguments)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt, tools, chat_template=chat_template,
                                            continue_final_message=continue_final_message,
                                            chat_template_kwargs=chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *, chat_template: str | None = None,
                            continue_final_message: bool = False,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        return apply_chat_template(self.get_tokenizer(), conversation, add_generation_prompt, tools,
                                   continue_final_message=continue_final_message, chat_template=chat_template,
                                   template_kwargs=chat_template_kwargs)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's name; after changing the weights)."""
        self._router.reset()
        return all([engine.reset_prefix_cache() for engine in self.replicas])

    def _run(self, owners: dict[str, LLMEngine], use_tqdm: bool) -> list[RequestOutput]:
        progress = _Progress(len(owners), use_tqdm)
        by_engine: dict[int, tuple[LLMEngine, set[str]]] = {}
        for request_id, engine in owners.items():
            by_engine.setdefault(id(engine), (engine, set()))[1].add(request_id)
        jobs = list(by_engine.values())
        stop = threading.Event()  # set when one replica fails or the caller is interrupted
        finished: dict[str, RequestOutput] = {}
        try:
            if len(jobs) == 1:
                finished = _drain(*jobs[0], progress, stop)
            else:  # one thread per replica: JAX releases the GIL while a step runs on the device
                with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="replica") as pool:
                    futures = [pool.submit(_drain, engine, ids, progress, stop) for engine, ids in jobs]
                    try:
                        wait(futures, return_when=FIRST_EXCEPTION)  # a failure stops the others at once
                        for future in futures:
                            finished.update(future.result())
                    except BaseException:
                        # The others stop at their next step, so that generate's cleanup (on
                        # this thread) is the only one touching the engines.
                        stop.set()
                        raise
        finally:
            progress.close()
        return [finished[r] for r in owners]


class _Progress:
    """The bar over every replica's finished requests (updated from their threads)."""

    def __init__(self, total: int, enabled: bool):
        self._bar = tqdm(total=total, desc="Processed prompts", disable=not enabled, dynamic_ncols=True)
        self._lock = threading.Lock()
        self._start, self._generated = time.perf_counter(), 0

    def finished(self, output: RequestOutput) -> None:
        with self._lock:
            # Tokens are counted as their requests finish (vLLM's bar does the same): the engine
            # reports nothing per step for final_only requests.
            self._generated += sum(len(c.token_ids) for c in output.outputs)
            self._bar.update(1)
            self._bar.set_postfix_str(f"{self._generated / max(time.perf_counter() - self._start, 1e-9):.1f} tok/s",
                                      refresh=False)

    def close(self) -> None:
        self._bar.close()


def _drain(engine: LLMEngine, request_ids: set[str], progress: _Progress,
           stop: threading.Event) -> dict[str, RequestOutput]:
    """Step `engine` until every one of `request_ids` finished (their final outputs), or until
    `stop` is set."""
    pending, finished = set(request_ids), {}
    while pending and not stop.is_set():
        for output in engine.step():
            if output.finished and output.request_id in pending:
                pending.discard(output.request_id)
                finished[output.request_id] = output
                progress.finished(output)
    return finished


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, SequenceABC) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def _as_params_list(params, count: int, engine) -> list[SamplingParams]:
    if params is None:  # vLLM's rule: the model's recommended values (--generation-config)
        return [engine.default_sampling_params() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """The params with output_kind "final_only": one copy per distinct SamplingParams object
    (the caller's own are not changed). Whatever kind the caller chose, generate returns the
    final output, which is the same in every kind but "delta" (there it would hold only the
    last step's part)."""
    copies: dict[int, SamplingParams] = {}
    result = []
    for p in params:
        if isinstance(p, SamplingParams) and p.output_kind != "final_only":
            if id(p) not in copies:
                copies[id(p)] = dataclasses.replace(p, output_kind="final_only")
            p = copies[id(p)]
        result.append(p)  # (anything else is the engine's to refuse)
    return result
