"""Two runs of the same greedy requests compared token by token, with a tolerance.

A run is {request id: (token ids, [{token id: logprob}] per token, ...)}, as the engine's outputs
give them with `logprobs=k`. Two runs agree when, for every request, their tokens are identical,
or where they first differ the reference's own log-probabilities of the two tokens are within
twice the tolerance: if every log-probability of the other run is within `tol` of the
reference's, only such a near-tie can flip. After the first difference the two runs continue
different texts and are not compared. Log-probabilities are compared on the tokens both runs
list at each compared position.
"""

from __future__ import annotations

import math


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where the token lists differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def reference_margin(want_logprobs: dict[int, float], want_token: int, got_token: int) -> float:
    """How much more likely the reference found its own token than the other run's (inf where
    the other run's token is not among the reference's top tokens: no near-tie)."""
    if got_token not in want_logprobs:
        return math.inf
    return want_logprobs[want_token] - want_logprobs[got_token]


def compare_runs(got: dict, want: dict, tol: float) -> dict:
    """{"ok", "max_logprob_diff", "tokens_identical", "near_ties", "compared_tokens"} of run
    `got` against the reference `want` (same request ids)."""
    if set(got) != set(want):
        return {"ok": False, "error": f"requests {sorted(got)} vs {sorted(want)}"}
    max_diff, compared, near_ties, ok = 0.0, 0, [], True
    for rid in sorted(want):
        got_tokens, got_logprobs = got[rid][0], got[rid][1]
        want_tokens, want_logprobs = want[rid][0], want[rid][1]
        differ_at = first_difference(got_tokens, want_tokens)
        last = min(len(got_tokens), len(want_tokens)) if differ_at is None else differ_at + 1
        for i in range(min(last, len(got_tokens), len(want_tokens))):
            common = set(got_logprobs[i]) & set(want_logprobs[i])
            diffs = [abs(got_logprobs[i][t] - want_logprobs[i][t]) for t in common]
            max_diff = max([max_diff, *diffs])
            compared += 1
        if differ_at is not None:
            if differ_at >= min(len(got_tokens), len(want_tokens)):
                ok = False  # one run stopped early: not a rounding difference
                near_ties.append({"request": rid, "position": differ_at, "margin": None})
                continue
            margin = reference_margin(want_logprobs[differ_at], want_tokens[differ_at], got_tokens[differ_at])
            # None: the other run's token is not among the reference's top ones (JSON has no inf).
            near_ties.append({"request": rid, "position": differ_at, "margin": None if math.isinf(margin) else margin})
            ok = ok and margin <= 2 * tol
    return {"ok": ok and max_diff <= tol, "max_logprob_diff": max_diff, "tokens_identical": not near_ties,
            "near_ties": near_ties, "compared_tokens": compared}
