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

import numpy as np


def propose(tokens: Sequence[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the
    longest suffix of ``tokens`` of ``max_n`` down to ``min_n`` tokens; [] where no
    suffix occurred before (or ``k`` is 0). Raises ``ValueError`` for a bad range.
    Vectorised: the candidates are the earlier positions holding the last token."""
    if k < 0 or min_n < 1 or max_n < min_n:
        raise ValueError(f"need k >= 0 and 1 <= min_n <= max_n, got k={k}, n={min_n}..{max_n}")
    arr = np.asarray(tokens, dtype=np.int64)
    last = len(arr) - 1
    if k == 0 or last < 1:
        return []
    ends = np.flatnonzero(arr[:last] == arr[last])  # where an earlier occurrence would end
    for n in range(min(max_n, last), min_n - 1, -1):
        cand = ends[ends >= n - 1]
        match = np.ones(len(cand), dtype=bool)
        for back in range(1, n):
            match &= arr[cand - back] == arr[last - back]
        hits = cand[match]
        if len(hits):
            end = int(hits[-1]) + 1
            return arr[end : end + k].tolist()
    return []


class NgramProposer:
    """``propose`` for a batch (``engine.speculative.Proposer``)."""

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 3):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests) -> list[list[int]]:
        return [propose(r.token_ids, r.k, self.min_n, self.max_n) for r in requests]

    def forget(self, live) -> None:
        """Nothing to drop: a lookup keeps no state between steps."""
