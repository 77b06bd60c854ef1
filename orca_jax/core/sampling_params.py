"""SamplingParams: how one request is decoded. Field names and defaults follow vLLM.

This is the one place the ranges of the sampling fields are checked (the server's protocol
checks only wire types). Every accepted value has a meaning the compiled step can represent:
floats are bounded on both sides (so no inf or NaN reaches a float32 array) and integers that
go into int32 arrays are either bounded where they are used (logprobs by max_logprobs, token
ids by the vocabulary) or mean the same once clamped there (a top_k above the vocabulary keeps
the whole vocabulary, as in vLLM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orca_jax.errors import RequestError
from orca_jax.structured.structured_outputs import StructuredOutputsParams

# Below this, dividing logits by the temperature overflows float32; vLLM raises smaller
# temperatures to it too (sampling that cold is greedy in all but name).
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 2.0  # OpenAI's range
# A factor of 100 either way already drives a seen token's logit out of (or into) reach;
# beyond it float32 logits overflow or vanish.
REPETITION_PENALTY_RANGE = (1e-2, 100.0)
# logit_bias: OpenAI's range for a bias (vLLM clamps to it too), and the most entries one request
# may bias. The step carries a fixed [rows, MAX_LOGIT_BIAS] table for the rows that ask, so the
# count is a compiled shape; 300 is what OpenAI's API accepts.
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS = 300
# What each output of a request holds (vLLM's RequestOutputKind):
#   "cumulative"  everything so far (text, token_ids, logprobs), plus what is new in
#                 delta_text / delta_token_ids: one output per step that brings something new;
#   "delta"       only what is new since the request's previous output, in text, token_ids and
#                 logprobs (and delta_text / delta_token_ids): what a stream sends;
#   "final_only"  one output, when the request has finished, holding everything (as cumulative):
#                 what a caller that waits for the result needs (LLM.generate, a non-streamed
#                 server request), and nothing is built per step.
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float: out of every range
        return False


def _token_keyed(bias):
    """A logit_bias map with JSON's string keys ("50256") read as token ids; anything else is
    left for validation to refuse."""
    if not isinstance(bias, dict):
        return bias
    keyed = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        keyed[key] = value
    return keyed


def _in_range(value, low: float, high: float, *, open_low: bool = False) -> bool:
    return _is_number(value) and (low < value if open_low else low <= value) and value <= high


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 (or -1) keeps the whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # top log-probabilities to return per sampled token
    # Per prompt token (from the second): its log-probability and the top this many, computed in
    # the prefill steps (orca_jax.worker.prompt_logprobs); the prompt is then never read from the
    # prefix cache.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # vLLM's token rules (orca_jax.structured.token_rules), applied through the step's bitmask:
    min_tokens: int = 0  # EOS, stop token ids and stop strings do not end the output before this
    bad_words: list[str] | None = None  # words never produced (every token spelling of each)
    allowed_token_ids: list[int] | None = None  # only these tokens are sampled
    # OpenAI's logit_bias: token id -> a bias added to its logit before penalties and sampling
    # (clamped to LOGIT_BIAS_RANGE). String keys, as JSON sends them, are read as ids.
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # With transformers' fast tokenizers (the only kind loaded) special tokens are never
    # spaced apart; vLLM's default True is the one value this engine can honour.
    spaces_between_special_tokens: bool = True
    # Keep only the prompt's last this many tokens (vLLM's truncate_prompt_tokens; -1: the
    # model's context length).
    truncate_prompt_tokens: int | None = None
    output_kind: str = "cumulative"  # one of OUTPUT_KINDS
    # Constrained decoding (JSON schema, regex, choice, grammar): orca_jax.structured.structured_outputs.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _token_keyed(self.logit_bias)
        self._validate()
        if self.logit_bias:
            low, high = LOGIT_BIAS_RANGE
            self.logit_bias = {token: min(max(float(bias), low), high) for token, bias in self.logit_bias.items()}
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    def _validate(self):
        low_rep, high_rep = REPETITION_PENALTY_RANGE
        checks = [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            ("temperature", _in_range(self.temperature, 0.0, MAX_TEMPERATURE),
             f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0,
             f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}"),
            ("top_p", _in_range(self.top_p, 0.0, 1.0, open_low=True), f"top_p must be in (0, 1], got {self.top_p!r}"),
            ("min_p", _in_range(self.min_p, 0.0, 1.0), f"min_p must be in [0, 1], got {self.min_p!r}"),
            ("n", _is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
             f"logprobs must be None or an integer >= 0, got {self.logprobs!r}"),
            ("prompt_logprobs", self.prompt_logprobs is None
             or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
             f"prompt_logprobs must be None or an integer >= 0, got {self.prompt_logprobs!r}"),
            ("presence_penalty", _in_range(self.presence_penalty, -2.0, 2.0),
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            ("frequency_penalty", _in_range(self.frequency_penalty, -2.0, 2.0),
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            ("repetition_penalty", _in_range(self.repetition_penalty, low_rep, high_rep),
             f"repetition_penalty must be in [{low_rep:g}, {high_rep:g}], got {self.repetition_penalty!r}"),
            ("seed", self.seed is None or _is_int(self.seed), f"seed must be an integer or None, got {self.seed!r}"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
            ("min_tokens", _is_int(self.min_tokens) and 0 <= self.min_tokens,
             f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"),
            ("min_tokens", not _is_int(self.min_tokens) or not _is_int(self.max_tokens)
             or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens!r}) must be at most max_tokens ({self.max_tokens!r})"),
            ("bad_words", all(isinstance(w, str) and w.strip() for w in self.bad_words),
             "bad_words must be non-blank strings"),
            ("allowed_token_ids", self.allowed_token_ids is None
             or (self.allowed_token_ids and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
             "allowed_token_ids must be a non-empty list of non-negative integers"),
            ("logit_bias", self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                _is_int(t) and t >= 0 and _is_number(b) for t, b in self.logit_bias.items())),
             "logit_bias must map token ids (non-negative integers) to finite numbers"),
            ("logit_bias", not isinstance(self.logit_bias, dict) or len(self.logit_bias) <= MAX_LOGIT_BIAS,
             f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries"),
            ("skip_special_tokens", isinstance(self.skip_special_tokens, bool), "skip_special_tokens must be a bool"),
            ("spaces_between_special_tokens", self.spaces_between_special_tokens is True,
             "spaces_between_special_tokens=false is not supported: fast tokenizers never space special tokens"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens is None
             or (_is_int(self.truncate_prompt_tokens) and (self.truncate_prompt_tokens >= 1
                                                          or self.truncate_prompt_tokens == -1)),
             f"truncate_prompt_tokens must be -1 or an integer >= 1, got {self.truncate_prompt_tokens!r}"),
            ("structured_outputs",
             self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams or None"),
            ("output_kind", isinstance(self.output_kind, str) and self.output_kind in OUTPUT_KINDS,
             f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise RequestError(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_token_rules(self) -> bool:
        return bool(self.min_tokens or self.bad_words or self.allowed_token_ids is not None)

    @property
    def has_logit_bias(self) -> bool:
        return bool(self.logit_bias)

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
