"""What the engine returns: one RequestOutput per request, one CompletionOutput per sample.

Fields follow vLLM. What `text`, `token_ids` and `logprobs` hold depends on the request's
`SamplingParams.output_kind` (orca_jax/engine/request.py builds the outputs):
  "cumulative"  everything so far (the default);
  "delta"       only what is new since the request's previous output;
  "final_only"  everything, in the one output made when the request has finished.
`delta_text` and `delta_token_ids` always hold only what arrived since the request's previous
output, for streaming. Delta text (`delta_text`, and a "delta" output's `text`) holds back,
while the sample runs, the last characters that could still begin a stop string; the
cumulative `text` does not. Slotted dataclasses: the engine makes one per request per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None  # set when the request failed inside a step
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Prompt tokens found in the prefix cache when the request's first sample was admitted
    # (vLLM's name); None before that.
    num_cached_tokens: int | None = None
    # vLLM's prompt_logprobs: per prompt token {token id: logprob} (None for the first); set
    # only for a request that asked, once its prompt has been computed.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    # Shortcuts to the first sample, for the common n=1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def merge_outputs(pending: RequestOutput, newer: RequestOutput, delta: bool) -> RequestOutput:
    """One output for two consecutive outputs of a request that nobody has read yet, as if the
    engine had made only the second (for a reader that lags: it gets one output, not one per
    step). `delta`: the outputs are of the "delta" kind, so the newer one's text, token ids
    and log-probs are appended to the pending one's; otherwise the newer one, which holds
    everything, replaces it. Either way the delta fields add up. Changes the outputs in
    place (their lists are the reader's own) and returns the merged one; costs time
    proportional to the newer output."""
    merged, extra = (pending, newer) if delta else (newer, pending)
    by_index = {c.index: c for c in merged.outputs}
    for c in extra.outputs:
        into = by_index.get(c.index)
        if into is None:
            merged.outputs.append(c)
        elif delta:
            _append_completion(into, c)
        else:  # `into` is newer: put the older deltas in front of its own
            into.delta_text = c.delta_text + into.delta_text
            into.delta_token_ids[:0] = c.delta_token_ids
    if delta:
        merged.finished, merged.error, merged.finish_time = newer.finished, newer.error, newer.finish_time
        if newer.num_cached_tokens is not None:
            merged.num_cached_tokens = newer.num_cached_tokens
        if newer.prompt_logprobs is not None:  # a delta stream carries them once
            merged.prompt_logprobs = newer.prompt_logprobs
        if newer.first_token_time is not None:
            merged.first_token_time = newer.first_token_time
    return merged


def _append_completion(into: CompletionOutput, newer: CompletionOutput) -> None:
    into.text += newer.text
    into.token_ids.extend(newer.token_ids)
    if newer.logprobs is not None:
        if into.logprobs is None:
            into.logprobs = []
        into.logprobs.extend(newer.logprobs)
    into.delta_text += newer.delta_text
    into.delta_token_ids.extend(newer.delta_token_ids)
    into.finish_reason, into.stop_reason = newer.finish_reason, newer.stop_reason
