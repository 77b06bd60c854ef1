"""The n-gram (prompt lookup) proposer (orca_jax/spec_decode/ngram.py): the longest n-gram wins,
the draft's caps, overlapping continuations, the suffix never matching itself, which of several
occurrences is copied, and a property test against a plain brute-force reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_jax.spec_decode.ngram import NgramProposer


def reference_propose(history: list[int], k: int, min_n: int, max_n: int,
                      max_tokens: int | None = None) -> list[int]:
    """The documented rules written plainly: for n from max_n down to min_n, the earlier
    occurrences of the last n tokens (ending before the last position); copy after the most
    recent one with a full draft after it, else after the earliest."""
    draft_len = k if max_tokens is None else min(k, max_tokens)
    if draft_len <= 0:
        return []
    length = len(history)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = history[length - n:]
        starts = [start for start in range(length - n) if history[start:start + n] == suffix]
        if not starts:
            continue
        full = [start for start in starts if length - (start + n) >= draft_len]
        start = max(full) if full else min(starts)
        return history[start + n:start + n + draft_len]
    return []


def test_the_longest_matching_ngram_wins_over_a_shorter_one():
    # The last 1-gram "3" occurs at positions 2 and 5 (followed by 9 9 9), the 2-gram "2 3" at 1.
    history = [1, 2, 3, 4, 5, 3, 9, 9, 9, 2, 3]
    assert NgramProposer(3, 1, 2).propose(history) == [4, 5, 3]
    assert NgramProposer(3, 1, 1).propose(history) == [9, 9, 9], "with max 1, the 1-gram's recent copy"


def test_no_earlier_occurrence_gives_no_draft():
    proposer = NgramProposer(4, 1, 3)
    assert proposer.propose([1, 2, 3, 4, 5]) == []
    # The last token occurs earlier, but only a 1-gram matches and the minimum is 2.
    assert NgramProposer(4, 2, 3).propose([7, 1, 8, 2, 1]) == []
    assert NgramProposer(4, 1, 3).propose([7, 1, 8, 2, 1]) == [8, 2, 1]


def test_the_draft_is_capped_by_k_and_by_max_tokens():
    history = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert NgramProposer(3, 1, 2).propose(history) == [3, 4, 5]
    assert NgramProposer(10, 1, 2).propose(history) == [3, 4, 5, 6, 7, 8, 1, 2], "to the end at most"
    assert NgramProposer(3, 1, 2).propose(history, max_tokens=2) == [3, 4]
    assert NgramProposer(3, 1, 2).propose(history, max_tokens=7) == [3, 4, 5], "k still caps"


def test_no_budget_left_gives_no_draft():
    history = [1, 2, 3, 1, 2]
    assert NgramProposer(3, 1, 2).propose(history, max_tokens=0) == []
    assert NgramProposer(3, 1, 2).propose(history, max_tokens=-1) == []


def test_a_repeated_pattern_continues_through_the_suffix():
    # "a b" last occurs at position 2, and what follows runs into the suffix itself.
    a, b = 10, 11
    history = [a, b, a, b, a, b]
    assert NgramProposer(2, 2, 2).propose(history) == [a, b]
    # A longer draft than the most recent copy leaves room for: the earliest, with the longest.
    assert NgramProposer(4, 2, 2).propose(history) == [a, b, a, b]
    assert NgramProposer(6, 2, 2).propose(history) == [a, b, a, b], "none full: still the longest"
    assert NgramProposer(3, 2, 4).propose([5, 5, 5, 5, 5]) == [5], "a run of one token: 4-gram at 0"


def test_the_suffix_never_matches_itself():
    # Each 2-gram occurs once: only the suffix itself ends at the last position.
    assert NgramProposer(3, 2, 2).propose([1, 2, 3, 4]) == []
    assert NgramProposer(3, 1, 4).propose([9]) == []
    # A history that is only its suffix twice over: the first copy ends one before the end.
    assert NgramProposer(3, 2, 2).propose([1, 2, 1, 2]) == [1, 2]


def test_a_history_shorter_than_the_minimum_gives_no_draft():
    proposer = NgramProposer(3, 3, 4)
    assert proposer.propose([]) == []
    assert proposer.propose([1, 1]) == []
    assert proposer.propose([1, 1, 1]) == [], "3 tokens: the 3-gram is only the suffix"
    assert proposer.propose([1, 1, 1, 1]) == [1]


def test_the_most_recent_occurrence_with_a_full_draft_is_copied():
    x, y = 100, 200
    # "x y" occurs at 0 (followed by 1 2 3) and at 5 (followed by 4 5 6): the recent one wins.
    history = [x, y, 1, 2, 3, x, y, 4, 5, 6, 7, x, y]
    assert NgramProposer(3, 2, 2).propose(history) == [4, 5, 6]
    # With k = 6 the recent copy has 6 tokens after it, still full length.
    assert NgramProposer(6, 2, 2).propose(history) == [4, 5, 6, 7, x, y]
    # With k = 7 the recent copy has only 6 after it, the one at 0 has 11: the full one wins.
    assert NgramProposer(7, 2, 2).propose(history) == [1, 2, 3, x, y, 4, 5]
    # A recent copy cut short by the end of the history loses to an older full one.
    history = [x, y, 1, 2, 3, 9, x, y, 4, x, y]
    assert NgramProposer(4, 2, 2).propose(history) == [1, 2, 3, 9]
    assert NgramProposer(4, 2, 2).propose(history, max_tokens=3) == [4, x, y], "3 fit: recent"


def test_lists_and_numpy_arrays_give_the_same_python_ints():
    history = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4]
    proposer = NgramProposer(4, 1, 3)
    expected = proposer.propose(history)
    assert expected == [1, 5, 9, 2]
    for array in (np.array(history, np.int32), np.array(history, np.int64)):
        draft = proposer.propose(array)
        assert draft == expected and all(type(token) is int for token in draft)
    assert proposer.propose(tuple(history)) == expected
    with pytest.raises(ValueError, match="1-D"):
        proposer.propose(np.array([history, history]))


# Random tokens, then a short pattern repeated: periodic tails put several occurrences close to
# the end, where the choice between a full and a cut-short continuation is made.
histories = st.builds(lambda head, pattern, repeats: head + pattern * repeats,
                      st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), max_size=3),
                      st.integers(0, 5))


@settings(max_examples=300, deadline=None)
@given(history=histories, k=st.integers(1, 6), min_n=st.integers(1, 4), extra_n=st.integers(0, 3),
       max_tokens=st.none() | st.integers(-1, 7))
def test_the_proposer_matches_a_brute_force_reference(history, k, min_n, extra_n, max_tokens):
    max_n = min_n + extra_n
    proposer = NgramProposer(k, min_n, max_n)
    expected = reference_propose(history, k, min_n, max_n, max_tokens)
    assert proposer.propose(history, max_tokens) == expected
    assert proposer.propose(np.array(history, np.int32), max_tokens) == expected


@pytest.mark.parametrize("args, field", [
    ((0, 1, 2), "num_speculative_tokens"),
    ((-3, 1, 2), "num_speculative_tokens"),
    ((2, 0, 2), "prompt_lookup_min"),
    ((2, 1, 0), "prompt_lookup_max"),
    ((2, 3, 2), "prompt_lookup_max"),
    ((2.5, 1, 2), "num_speculative_tokens"),
    ((2, True, 2), "prompt_lookup_min"),
])
def test_invalid_settings_are_refused_naming_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        NgramProposer(*args)
