"""N-gram prompt lookup against hand-worked sequences: the longest suffix wins, the
most recent earlier occurrence wins, at most k tokens, nothing without a match."""

from __future__ import annotations

import pytest

from splitserve.engine.speculative.ngram import propose


def test_it_proposes_what_followed_the_suffix_before():
    assert propose([1, 2, 3, 7, 8, 9, 4, 1, 2, 3], k=2) == [7, 8]
    assert propose([1, 2, 3, 7, 8, 9, 4, 1, 2, 3], k=10) == [7, 8, 9, 4, 1, 2, 3]


def test_the_longest_suffix_and_the_most_recent_occurrence_win():
    # "3" alone last followed by 5; "2 3" followed by 7
    assert propose([2, 3, 7, 9, 3, 5, 6, 2, 3], k=1) == [7]
    assert propose([2, 3, 7, 9, 3, 5, 6, 2, 3], k=1, max_n=1) == [5]
    assert propose([4, 1, 4, 2, 4], k=1, max_n=1) == [2]  # the later of two occurrences


def test_nothing_without_a_match_or_room():
    assert propose([1, 2, 3, 4], k=3) == []
    assert propose([5], k=3) == []
    assert propose([1, 2, 1, 2], k=0) == []
    with pytest.raises(ValueError, match="min_n <= max_n"):
        propose([1, 2], k=1, min_n=3, max_n=2)
