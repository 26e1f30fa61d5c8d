"""``bench/speculative.py --agreement``: where two greedy outputs first part."""

from splitserve.bench.speculative import first_difference


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([7], [8]) == 0
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one ended earlier (EOS)
