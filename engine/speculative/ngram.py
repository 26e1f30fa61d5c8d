"""N-gram prompt lookup: propose the tokens that followed the sequence's own last
n tokens where they occurred before (in the prompt or in what it generated). No
model: it wins where outputs copy their input (editing, summarising, code).

    tokens   ... a b c x y z ... a b c
                     ^^^^^ earlier occurrence of the suffix "a b c"
    proposal x y z (at most k tokens, the most recent earlier occurrence,
                    the longest suffix n from max_n down to min_n)
"""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the
    longest suffix of ``tokens`` of ``max_n`` down to ``min_n`` tokens; [] where no
    suffix occurred before (or ``k`` is 0). Raises ``ValueError`` for a bad range."""
    if k < 0 or min_n < 1 or max_n < min_n:
        raise ValueError(f"need k >= 0 and 1 <= min_n <= max_n, got k={k}, n={min_n}..{max_n}")
    seq = list(tokens)
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):  # most recent first, not the suffix itself
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k]
    return []
