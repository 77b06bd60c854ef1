"""What the engine returns: one RequestOutput per request, one CompletionOutput per sample.

Fields follow vLLM. `text` and `token_ids` are cumulative; `delta_text` and `delta_token_ids`
hold only what arrived since the request's previous output, for streaming.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
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


@dataclass
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
