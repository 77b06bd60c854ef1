"""Sequence: the host-side state of one generation stream.

A request with `n` samples owns `n` sequences; each is scheduled, paged and finished on its own.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from orca_jax.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples this is
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # per-sequence sampling seed: the same seed gives the same tokens in any batch
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    page_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_preemptions: int = 0
    first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, position: int) -> int:
        n_prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n_prompt else self.output_token_ids[position - n_prompt]

    def tokens(self, start: int, stop: int) -> list[int]:
        return [self.token_at(p) for p in range(start, stop)]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """All tokens but the last are cached: the next step computes one token."""
        return self.num_uncomputed_tokens == 1 and self.num_computed_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
