"""A serving run over time, for ``bench serve`` and ``bench compare``: the cluster's
roles sampled while the load runs (``sample_roles``) and, afterwards, the run laid
out from its first send (``timeline``): the trace sent, the demand per bin and every
change of roles. ``compare.json`` keeps it as each run's ``over_time``."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

from splitserve.client import AsyncClient, SplitserveClientError
from splitserve.loadgen.metrics import RequestRecord

ROLE_SAMPLE_S = 0.5  # how often a run looks at the cluster's roles


async def sample_roles(address: str, every_s: float = ROLE_SAMPLE_S) -> list[tuple[float, int, int]]:
    """``(time.perf_counter(), prefill workers, decode workers)`` every ``every_s``, from
    the cluster's status, until cancelled (returns what it saw then). Colocated workers
    count as decode workers (each decodes and prefills its own prompts, as an elastic
    cluster's pooled workers do)."""
    seen: list[tuple[float, int, int]] = []
    async with AsyncClient(address, retries=0, timeout=10) as client:
        try:
            while True:
                with contextlib.suppress(SplitserveClientError):
                    st = await client.cluster_status()
                    n = collections.Counter({p.role: len(p.workers) for p in st.pools})
                    seen.append((time.perf_counter(), n["prefill"], n["decode"] + n["colocated"]))
                await asyncio.sleep(every_s)
        except asyncio.CancelledError:
            return seen


def timeline(records: list[RequestRecord], roles: list[tuple[float, int, int]], bin_s: float = 5.0) -> dict:
    """The run over time, from its first send: each request as ``[t sent, prompt tokens,
    output tokens]`` (the trace the cluster simulator replays), per ``bin_s`` bin the
    prompt and output tokens/s the requests sent in it asked for (the demand), and every
    change of roles as ``[t, prefill, decode]`` (the first sample included)."""
    t0 = min(r.send_time for r in records)
    bins = collections.defaultdict(lambda: [0, 0])
    for r in records:
        b = bins[int((r.send_time - t0) // bin_s)]
        b[0] += r.prompt_len
        b[1] += r.output_len
    demand = [[k * bin_s, bins[k][0] / bin_s, bins[k][1] / bin_s] for k in range(max(bins, default=-1) + 1)]
    changes = []
    for at, p, d in roles:
        if not changes or changes[-1][1:] != [p, d]:
            changes.append([round(at - t0, 2), p, d])
    sent = sorted([round(r.send_time - t0, 4), r.prompt_len, r.output_len] for r in records)
    return {
        "bin_s": bin_s,
        "sent": sent,
        "demand": demand,
        "roles": changes,
        "role_changes": max(len(changes) - 1, 0),
    }
