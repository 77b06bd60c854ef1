"""Orca's synthetic trace (OSDI 2022, section 6.1): Poisson arrivals at rate lambda, input
lengths uniform in [32, 512], output lengths uniform in [1, 128], EOS ignored so every request
runs to its drawn output length.

`scale` multiplies both length ranges so that a CPU can run the trace (0.25: input U[8, 128],
output U[1, 32]). The lengths and prompts come from one seeded generator and the arrival times
from another, so the *same requests* are replayed at every arrival rate and only their timing
changes: curves at different rates differ by load alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ORCA_INPUT_RANGE = (32, 512)
ORCA_OUTPUT_RANGE = (1, 128)
# Mixed into the seed of the arrival generator, so arrivals never reuse the length draws.
_ARRIVAL_STREAM = 0xA77

Range = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Trace:
    """Requests in arrival order. `arrival_times` are seconds from the start (all zero for an
    offline run); `prompts` are token ids, or None when only lengths matter (simulation)."""

    input_lens: list[int]
    output_lens: list[int]
    input_range: Range
    output_range: Range
    arrival_times: list[float]
    prompts: list[list[int]] | None = None
    rate: float | None = None  # requests/s; None: everything at t=0

    @property
    def num_requests(self) -> int:
        return len(self.input_lens)

    @property
    def useful_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def useful_processed_tokens(self) -> int:
        """Each request's prompt and output, once: the work no system can avoid."""
        return sum(self.input_lens) + self.useful_output_tokens

    def with_arrivals(self, rate: float | None, seed: int) -> Trace:
        """The same requests, arriving as a Poisson process at `rate` (None: all at t=0)."""
        times = poisson_arrival_times(self.num_requests, rate, seed)
        return dataclasses.replace(self, arrival_times=times, rate=rate)

    def describe(self) -> dict:
        return {
            "num_requests": self.num_requests, "input_range": list(self.input_range),
            "output_range": list(self.output_range), "rate": self.rate,
            "mean_input_len": float(np.mean(self.input_lens)), "mean_output_len": float(np.mean(self.output_lens)),
            "useful_output_tokens": self.useful_output_tokens,
            "useful_processed_tokens": self.useful_processed_tokens,
        }


def scaled_range(bounds: Range, scale: float) -> Range:
    """`bounds` times `scale`, rounded, never below 1 and never empty."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    lo, hi = (max(1, round(b * scale)) for b in bounds)
    return lo, max(lo, hi)


def poisson_arrival_times(num_requests: int, rate: float | None, seed: int) -> list[float]:
    """Arrival times of a Poisson process: exponential gaps of mean 1/rate, the first request at
    t=0 (so a run never starts with an idle wait). rate None or inf: all at t=0."""
    if rate is None or np.isinf(rate):
        return [0.0] * num_requests
    if rate <= 0:
        raise ValueError(f"arrival rate must be > 0, got {rate}")
    gaps = np.random.default_rng([seed, _ARRIVAL_STREAM]).exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def make_trace(num_requests: int, scale: float = 1.0, seed: int = 0, *, vocab_size: int | None = None,
               exclude_ids: tuple[int, ...] | list[int] = (), rate: float | None = None) -> Trace:
    """Draw `num_requests` requests from Orca's (scaled) length distributions.

    With `vocab_size`, prompts are random token ids uniform over the vocabulary minus
    `exclude_ids` (special tokens, which would make a tokenizer or a stop rule misbehave);
    without it the trace holds lengths only. Draw order (input lengths, output lengths, prompts)
    is fixed, so a seed names one workload."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    in_range, out_range = scaled_range(ORCA_INPUT_RANGE, scale), scaled_range(ORCA_OUTPUT_RANGE, scale)
    input_lens = rng.integers(in_range[0], in_range[1] + 1, size=num_requests).tolist()
    output_lens = rng.integers(out_range[0], out_range[1] + 1, size=num_requests).tolist()
    prompts = None
    if vocab_size is not None:
        allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(exclude_ids), dtype=np.int64))
        prompts = [rng.choice(allowed, size=n).tolist() for n in input_lens]
    trace = Trace(input_lens, output_lens, in_range, out_range, [0.0] * num_requests, prompts)
    return trace.with_arrivals(rate, seed) if rate is not None else trace
