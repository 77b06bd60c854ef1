"""SpeculativeConfig: how the engine speculates, with vLLM's `speculative_config` names.

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    {"method": "draft_model", "num_speculative_tokens": 3, "model": "path/or/default"}

`EngineConfig(speculative_config=...)` takes a dict (as vLLM's `LLM(speculative_config=...)`
and the `--speculative-config JSON` flag) or this dataclass, and keeps the dataclass. A bad
value raises ValueError naming the key, before anything loads.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
# More drafts per sequence than this cost more in rejected work than they save on any
# workload we measured, and each one adds a logits row per sequence to every step.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    # ngram: the longest n-gram at the end of a sequence looked up in its own history first,
    # down to the shortest (vLLM's defaults: min 1 when only max is given; we take 2, below).
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    # draft_model: the proposer's checkpoint (HF directory, .gguf, orbax checkpoint or
    # "default"); None: the target's own model (an upper bound of acceptance, for tests).
    model: str | None = None
    # A sequence whose last `backoff_after` proposals were all rejected outright stops
    # proposing for `backoff_steps` steps (doubling while it keeps failing, up to 64), so
    # text that does not repeat costs no verification rows.
    backoff_after: int = 2
    backoff_steps: int = 4
    # vLLM's disable_by_batch_size: no proposals while more sequences than this run. Where a
    # step's cost grows with its tokens (a CPU at batch 16: docs/benchmarks.md), verifying
    # drafts for many sequences costs more than it saves. None: no limit.
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        errors = []
        if self.method not in METHODS:
            errors.append(f"method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            errors.append(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (_is_int(low) and _is_int(high) and 1 <= low <= high):
            errors.append(f"prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max, "
                          f"got min={low!r}, max={high!r}")
        for name in ("backoff_after", "backoff_steps"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                errors.append(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        limit = self.disable_by_batch_size
        if limit is not None and (not _is_int(limit) or limit < 1):
            errors.append(f"disable_by_batch_size must be an integer >= 1 or None, got {limit!r}")
        if self.model is not None and not isinstance(self.model, str):
            errors.append(f"model must be a string, got {type(self.model).__name__}")
        if errors:
            raise ValueError("invalid speculative_config: " + "; ".join(errors))

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict with vLLM's keys, or its JSON text."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        value = dict(value)
        if "prompt_lookup_max" in value and "prompt_lookup_min" not in value:
            value["prompt_lookup_min"] = min(cls.prompt_lookup_min, value["prompt_lookup_max"])
        if "prompt_lookup_min" in value and "prompt_lookup_max" not in value:
            value["prompt_lookup_max"] = max(cls.prompt_lookup_max, value["prompt_lookup_min"])
        return cls(**value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
