"""``Role``: the phase a pool's workers run. Plain data, no imports: the router,
the pools, the planner and its simulator, and the CLI all name pools by it (a
``StrEnum``: equal to, and formatted as, the names configs and metrics use)."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    """A pool's phase: which part of a request its workers run."""

    PREFILL = "prefill"  # prompts only; the KV goes to a decode worker
    DECODE = "decode"  # takes the KV (or prefills in place) and generates
    COLOCATED = "colocated"  # both phases in one engine
