"""A rolling upgrade: every worker replaced by one built from a new config (another
model revision, other engine or pool settings, new code on the nodes), a few at a
time, under load, dropping no request.

``rolling_upgrade`` works in batches of ``pace`` workers per pool::

    pools build new workers from the new config (WorkerPool.reconfigure)
    per batch:  start `pace` new workers in each pool, one pool after the other,
                and wait until they serve
                drain `pace` old ones in each pool and remove them (a decode worker's
                requests move to another worker of their revision where one has
                room, by KV; the rest finish there; a prefill worker's exports are
                pulled first)
    until no old worker is left

Revisions never mix: the router pairs a prefill and a decode worker, and moves a
request, only within one revision (``router.moves``, ``wire.kv.CompatInfo``), so
while both revisions serve, each request is served whole by one of them; the
last old decode worker's requests finish there.

Starting a worker (loading the model, measuring its rates) takes CPU from the
workers serving beside it; the pools start theirs one after the other, so at
most ``pace`` workers start at once: with one prefill and one decode worker on 2
vCPUs, both starting together doubled the TTFT of the requests meanwhile.

A failure (a new worker that does not start, the call cancelled) rolls back: the
pools build from the old config again, the new workers started so far are
drained (their requests finish) and removed, and old-config workers are started
for the old ones already removed, so each pool is back to its old size and
revision.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.pools import WorkerPool

log = logging.getLogger(__name__)


@dataclass
class UpgradeReport:
    started: list[str] = field(default_factory=list)  # the new workers, in order
    removed: list[str] = field(default_factory=list)  # the old ones, in order
    revisions: dict[str, str] = field(default_factory=dict)  # worker id -> revision, new workers


async def rolling_upgrade(
    pools: dict[str, WorkerPool],
    config: ClusterConfig,
    pace: int = 1,
    drain_timeout_s: float = 120.0,
    progress: Callable[[str], None] = log.info,
) -> UpgradeReport:
    """Replace every worker of ``pools`` by one built from ``config``, ``pace`` per pool
    at a time (see the module docstring). Raises what failed, after rolling back."""
    if pace < 1:
        raise ValueError(f"pace must be at least 1 worker at a time, not {pace}")
    missing = set(pools) - set(config.pools())
    if missing:
        raise ValueError(
            f"the new config has no {', '.join(sorted(missing))} pool: a rolling upgrade keeps the pools"
        )
    old_configs = {role: pool.config for role, pool in pools.items()}
    old = {role: [w.worker_id for w in pool.workers] for role, pool in pools.items()}
    report = UpgradeReport()
    removed: dict[str, int] = dict.fromkeys(pools, 0)
    try:
        for pool in pools.values():
            pool.reconfigure(config)
        while any(old.values()):
            batch = {role: ids[:pace] for role, ids in old.items() if ids}
            added = []
            for role, ids in batch.items():  # one pool after the other (the module docstring says why)
                for w in await pools[role].add(len(ids)):
                    report.started.append(w.worker_id)  # at once: a later failure rolls it back
                    report.revisions[w.worker_id] = w.revision
                    added.append(w.worker_id)
            going = [wid for ids in batch.values() for wid in ids]
            progress(f"upgrade: {', '.join(added)} serving; draining {going}")
            await asyncio.gather(
                *(pools[r].remove(wid, drain_timeout_s, "migrate") for r, ids in batch.items() for wid in ids)
            )
            for role, ids in batch.items():
                report.removed += ids
                removed[role] += len(ids)
                old[role] = old[role][len(ids) :]
    except BaseException as e:
        progress(f"upgrade failed ({type(e).__name__}: {e}); rolling back")
        await asyncio.shield(_roll_back(pools, old_configs, report.started, removed, drain_timeout_s))
        raise
    progress(f"upgrade done: {len(report.started)} worker(s) replaced")
    return report


async def _roll_back(
    pools: dict[str, WorkerPool],
    old_configs: dict[str, ClusterConfig],
    started: list[str],
    removed: dict[str, int],
    drain_timeout_s: float,
) -> None:
    """The pools back to their old config and sizes: the new workers go (their requests
    finish), old-config workers replace the old ones removed."""
    for role, pool in pools.items():
        pool.reconfigure(old_configs[role])
    for role, n in removed.items():
        if n:
            await pools[role].add(n)
    for pool in pools.values():
        new = [w.worker_id for w in pool.workers if w.worker_id in started]
        await asyncio.gather(*(pool.remove(wid, drain_timeout_s, "wait") for wid in new))
