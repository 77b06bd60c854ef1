"""Request: one request in the engine (its n sequences and their detokenizers), and
`make_output`, which builds what the request reports after a step.

`make_output` honours `SamplingParams.output_kind` and costs time proportional to what is new
since the request's previous output: per sample, `reported_tokens` / `reported_logprobs` count
what was already handed out, and the detokenizer keeps its own count of the characters sent.
Only "cumulative" copies everything so far (its contract is a full snapshot every step);
"delta" slices off the new part, and "final_only" builds nothing until the request finishes.

A prompt comes in any of vLLM's forms (`split_prompt`): text, token ids, or a dict, vLLM's
TextPrompt `{"prompt": text}` or TokensPrompt `{"prompt_token_ids": ids}`, either of which may
carry a `cache_salt`. The salt keys the request's prefix-cache pages (orca_jax/core/prefix_cache.py):
requests share cached pages only when their salts are equal (none being one value), so a
tenant's prompts cannot be timed against another's cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from orca_jax.engine.detokenizer import IncrementalDetokenizer
from orca_jax.errors import RequestError, check_unicode
from orca_jax.engine.outputs import CompletionOutput, RequestOutput
from orca_jax.core.sampling_params import SamplingParams
from orca_jax.core.sequence import Sequence


# The keys of a prompt dict this engine serves (vLLM's TextPrompt and TokensPrompt, without the
# multi-modal ones).
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def split_prompt(prompt, cache_salt: str | None = None) -> tuple[object, str | None]:
    """A prompt in any of vLLM's forms -> (its text or token ids, its prefix-cache salt or None).
    `cache_salt` is a salt given beside the prompt (LLMEngine.add_request's argument); a dict's
    own salt and that one must agree. The text or ids are checked later, by the engine's
    tokenizer; raises RequestError naming what is wrong here (a dict key, the salt)."""
    if isinstance(prompt, dict):
        unknown = [key for key in prompt if key not in PROMPT_DICT_KEYS]
        if unknown:
            raise RequestError(f"unknown prompt key {unknown[0]!r}: a prompt dict holds 'prompt' (text) or "
                               "'prompt_token_ids', and optionally 'cache_salt'", "prompt")
        given = [key for key in ("prompt", "prompt_token_ids") if key in prompt]
        if len(given) != 1:
            raise RequestError("a prompt dict holds exactly one of 'prompt' (text) and 'prompt_token_ids'", "prompt")
        if given == ["prompt"] and not isinstance(prompt["prompt"], str):
            raise RequestError("a prompt dict's 'prompt' is text; token ids go in 'prompt_token_ids'", "prompt")
        if given == ["prompt_token_ids"] and isinstance(prompt["prompt_token_ids"], str):
            raise RequestError("a prompt dict's 'prompt_token_ids' is a list of token ids; text goes in 'prompt'",
                               "prompt")
        own_salt = prompt.get("cache_salt")
        if own_salt is not None and cache_salt is not None and own_salt != cache_salt:
            raise RequestError("cache_salt is given twice, differently: in the prompt dict and beside it",
                               "cache_salt")
        cache_salt = own_salt if own_salt is not None else cache_salt
        prompt = prompt[given[0]]
    check_cache_salt(cache_salt)
    return prompt, cache_salt


def check_cache_salt(cache_salt) -> None:
    """None (no salt) or a non-empty string, as vLLM requires; valid Unicode, since it is hashed
    as UTF-8."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise RequestError(f"cache_salt must be a non-empty string if given, got {cache_salt!r}", "cache_salt")
    check_unicode(cache_salt, "cache_salt")


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    arrival_time: float = field(default_factory=time.monotonic)
    error: str | None = None
    reported_tokens: list[int] = field(default_factory=list)  # per sample, tokens already handed out
    reported_logprobs: list[int] = field(default_factory=list)  # per sample, logprob dicts already handed out
    # prompt_logprobs: per prompt token, {token id: logprob} (the token's own and the top k;
    # None for the first token, which has no context), filled as the prefill steps complete.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    reported_prompt_logprobs: bool = False

    def __post_init__(self):
        # Counters not given start at zero, one per sample.
        if not self.reported_tokens:
            self.reported_tokens = [0] * len(self.seqs)
        if not self.reported_logprobs:
            self.reported_logprobs = [0] * len(self.seqs)

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # (a loop, not all(): this is read for every request every step)
            if not seq.is_finished:
                return False
        return True

    @property
    def first_token_time(self) -> float | None:
        """The earliest of the samples' first-token times (None before any token)."""
        times = [s.first_token_time for s in self.seqs if s.first_token_time is not None]
        return min(times) if times else None


def make_output(request: Request) -> RequestOutput | None:
    """The request's output now, as its params' output_kind asks; None for a "final_only"
    request that has not finished (nothing to report yet). Marks what it hands out as
    reported, so call it once per step for each request that changed."""
    finished = request.finished
    kind = request.params.output_kind
    if kind == "final_only" and not finished:
        return None
    cumulative = kind != "delta"
    completions = [_completion(request, i, cumulative) for i in range(len(request.seqs))]
    return RequestOutput(
        prompt_logprobs=_prompt_logprobs(request, cumulative),
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=completions,
        finished=finished,
        error=request.error,
        arrival_time=request.arrival_time,
        first_token_time=request.first_token_time,
        finish_time=time.monotonic() if finished else None,
        num_cached_tokens=request.seqs[0].num_cached_tokens,
    )


def _prompt_logprobs(request: Request, cumulative: bool) -> list | None:
    """The prompt's log-probabilities once all are known (its first token has sampled): in
    every output of a cumulative request, in the first one of a delta stream."""
    if request.prompt_logprobs is None or not request.seqs[0].output_token_ids:
        return None
    if not cumulative and request.reported_prompt_logprobs:
        return None
    request.reported_prompt_logprobs = True
    return list(request.prompt_logprobs)


def _completion(request: Request, i: int, cumulative: bool) -> CompletionOutput:
    """Sample i's output: what is new since its previous output, and, when cumulative,
    everything so far."""
    seq, detok = request.seqs[i], request.detokenizers[i]
    tokens = seq.output_token_ids
    new_tokens = tokens[request.reported_tokens[i]:]
    request.reported_tokens[i] = len(tokens)
    new_logprobs = None
    if seq.params.logprobs is not None:
        new_logprobs = seq.output_logprobs[request.reported_logprobs[i]:]
        request.reported_logprobs[i] = len(seq.output_logprobs)
    delta_text = detok.take_delta(seq.is_finished)
    if cumulative:
        text, token_ids = detok.text, list(tokens)
        logprobs = list(seq.output_logprobs) if new_logprobs is not None else None
    else:
        # token_ids and delta_token_ids are distinct lists: a consumer that merges outputs
        # (async_engine's collector) extends them in place.
        text, token_ids, logprobs = delta_text, list(new_tokens), new_logprobs
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=token_ids,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=logprobs,
        delta_text=delta_text,
        delta_token_ids=new_tokens,
    )
