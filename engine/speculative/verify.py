"""Which of a verified step's tokens a sequence keeps.

A sequence with draft d1..dk runs [t, d1..dk] through the target model, giving k+1
rows of logits: row j is the target's distribution for the token after d1..dj. Each
row is sampled exactly as a non-speculative step would sample that token (the same
processing, grammar state and, for a seeded request, the same noise: the seed and
the token's index), giving s0..sk. The sequence keeps s0..sa, where a is the
number of leading drafts equal to their row's sample (sa is the target's own
token after the last accepted draft: a correction, or a bonus when all k match).

Why this is exact. Every proposer here proposes a point (its most likely token,
never a draw), q = 1 at d. Leviathan et al.'s rule then accepts d with probability
min(1, p(d) / q(d)) = p(d), and on a rejection draws from max(0, p - q)
normalised, which is p without d. Sampling s ~ p and keeping d when s = d does the
same: it keeps d with probability p(d), and a rejected s is distributed as p
given s != d. So every kept token is distributed as the target's, and with greedy
rows (argmax) or a seed the tokens are exactly a non-speculative run's; a request
resumed or migrated elsewhere continues identically, speculating or not.
"""

from __future__ import annotations


def kept(samples: list[int | None], draft: list[int]) -> int:
    """How many of a verified chunk's row samples the sequence keeps: up to and
    including the first that differs from its draft token (all of them when every
    draft token matched). ``samples`` has ``len(draft) + 1`` rows; a row that could
    not be sampled (None) ends what is kept before it (0 when it is the first)."""
    if len(samples) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} samples, got {len(samples)}")
    for j, s in enumerate(samples):
        if s is None:
            return j
        if j == len(draft) or s != draft[j]:
            return j + 1
    raise AssertionError("unreachable")
