"""Sequence: the host-side state of one generation stream.

A request with `n` samples owns `n` sequences; each is scheduled, paged and finished on its own.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from orca_jax.structured.guided_decoding import GuidedState
from orca_jax.structured.token_rules import TokenRules
from orca_jax.core.sampling_params import SamplingParams


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
    # Tokens whose K/V are in the cache, or are being computed by a dispatched step: the
    # scheduler counts them when it schedules them (and takes them back if dispatch fails).
    num_computed_tokens: int = 0
    # Sampled tokens of dispatched steps not yet appended to output_token_ids (at most one per
    # step in flight): the device already feeds them to the next step.
    num_pending: int = 0
    # Batches in flight (dispatched, not yet returned) that hold a row of this sequence. With
    # pipeline parallelism (Orca's rule) it is not scheduled again, and pages it gives up
    # (finished, aborted) wait in `pages_in_flight` until it is 0: a batch in flight may still
    # write them.
    num_in_flight: int = 0
    pages_in_flight: list[int] = field(default_factory=list)
    slot: int | None = None  # row of the persistent batch state while running (orca_jax.worker.batch_state)
    slot_joined: bool = False  # the slot is new to this sequence: its device rows must be reset
    step_mark: int = -1  # the last schedule() that gave this sequence a row
    page_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_preemptions: int = 0
    first_token_time: float | None = None
    # Prefix caching (orca_jax.core.prefix_cache): its request's salt (vLLM's cache_salt, which keys
    # its first page's hash and so every page: only sequences of one salt share pages), the
    # content hashes of the full pages of its known tokens so far (they stay valid across
    # preemption: the tokens do not change), how many of page_ids are published or were found
    # cached, and the prompt tokens found in the cache when it was first admitted (vLLM's
    # num_cached_tokens; None until then).
    cache_salt: str | None = None
    page_hashes: list[bytes] = field(default_factory=list)
    num_published_pages: int = 0
    num_cached_tokens: int | None = None
    # Constrained decoding (orca_jax.structured.guided_decoding): the grammar's state, for a sequence
    # whose params carry structured_outputs; not admitted until the grammar is compiled.
    guided: GuidedState | None = None
    # vLLM's allowed_token_ids / bad_words / min_tokens (orca_jax.structured.token_rules); None: none.
    token_rules: TokenRules | None = None
    # Speculative decoding (orca_jax.spec_decode): the draft tokens proposed for its next step
    # (the scheduler verifies those its budget and pages allow, and clears them); the pages it
    # kept when a rejected run gave pages back, so the device's page table is rewritten from
    # there on (None: nothing given back since its last step was built); and the proposer's
    # backoff (consecutive proposals rejected outright, steps to skip).
    draft_token_ids: list[int] = field(default_factory=list)
    pages_trimmed_to: int | None = None
    num_failed_proposals: int = 0
    skip_proposals: int = 0

    @property
    def awaiting_grammar(self) -> bool:
        return self.guided is not None and not self.guided.ready

    @property
    def needs_host_tokens(self) -> bool:
        """Its next step's mask reads its output tokens: they must be on the host first."""
        return self.guided is not None or (self.token_rules is not None and self.token_rules.reads_output)

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
        """Token ids at positions [start, stop), prompt then output, as list slices."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n_prompt]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to compute, counting the pending ones (already known to the device)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """All tokens but the last are cached: the next step computes one token."""
        return self.num_uncomputed_tokens == 1 and self.num_computed_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
