"""A rolling upgrade: every worker replaced by one built from a new config (another
model revision, other engine or pool settings, new code on the nodes), a few at a
time, under load, dropping no request.

``rolling_upgrade`` works in batches of ``pace`` workers per pool, one of two ways
(``Way``; ``plan_upgrade`` picks it before anything starts)::

    pools build new workers from the new config (WorkerPool.reconfigure)
    SURGE (room for a batch of new workers beside the old ones; Kubernetes' maxSurge):
    per batch:  start `pace` new workers in each pool, one pool after the other,
                and wait until they serve
                drain `pace` old ones in each pool and remove them (a decode worker's
                requests move to another worker of their revision where one has
                room, by KV; the rest finish there; a prefill worker's exports are
                pulled first)
    IN_PLACE (no such room; Kubernetes' maxUnavailable):
    per batch, one pool after the other:
                drain `pace` old ones of the pool and remove them, then start as
                many new ones in the room they leave, and wait until they serve
                (while a pool's last prefill worker is replaced, the decode workers
                prefill; a decode worker's requests move to the others)
    until no old worker is left

``plan_upgrade`` refuses (``PreconditionFailed``, at once, nothing changed) an
upgrade that neither way can run: no room to surge, and replacing in place would
leave a pool that must serve with no worker (the only decode worker) or the room
one old worker leaves cannot hold its replacement. Its sentence says what the
upgrade needs, what the nodes have free, and what to change. Where Ray's
autoscaler may add nodes (``room_known`` false: a cluster attached by address), a
surge is tried, and a worker Ray cannot place within the pool's
``placement_timeout_s`` fails the upgrade, which rolls back.

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
revision (in place: the new ones go first, to leave the room).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.pools import WorkerPool
from splitserve.cluster.room import Resources, WorkerNeed, describe_free, fits, with_freed
from splitserve.wire.errors import PreconditionFailed

log = logging.getLogger(__name__)


class Way(enum.Enum):
    SURGE = "surge"  # new workers start beside the old ones, then the old ones go
    IN_PLACE = "in place"  # old workers go, then their replacements start in their room


@dataclass(frozen=True)
class PoolView:
    """What ``plan_upgrade`` needs of one pool."""

    role: str
    old: list[tuple[str, str]]  # its workers now: (worker id, node id; "" if unknown)
    old_need: WorkerNeed  # what each of them holds
    new_need: WorkerNeed  # what each replacement asks for
    may_be_empty: bool  # its role serves with no worker for a while (prefill: decode workers prefill)


def plan_upgrade(views: list[PoolView], pace: int, free: dict[str, Resources], room_known: bool) -> Way:
    """How the upgrade runs: SURGE where a batch of new workers (``pace`` per pool) fits
    beside the old ones on the ``free`` resources, or where room is not known (Ray's
    autoscaler may make it); else IN_PLACE where each pool can spare a batch and the
    room it leaves holds its replacements; else ``PreconditionFailed`` saying why."""
    batches = {v.role: min(pace, len(v.old)) for v in views}
    surge = [v.new_need for v in views for _ in range(batches[v.role])]
    if fits(surge, free) or not room_known:
        return Way.SURGE
    blocked = []
    for v in views:
        n = batches[v.role]
        if len(v.old) - n < 1 and not v.may_be_empty:
            blocked.append(
                f"replacing in place would leave the {v.role} pool with no worker (it has {len(v.old)}, "
                f"and requests need one)"
            )
        elif not fits([v.new_need] * n, with_freed(free, [(node, v.old_need) for _, node in v.old[:n]])):
            blocked.append(
                f"the room {n} old {v.role} worker(s) leave cannot hold {n} x ({v.new_need}) "
                f"(each old one holds {v.old_need})"
            )
    if not blocked:
        return Way.IN_PLACE
    keys = {k for need in surge for k, _ in need.bundle}
    asked = "; ".join(
        f"{batches[v.role]} {v.role} worker(s) of {v.new_need}" for v in views if batches[v.role]
    )
    raise PreconditionFailed(
        f"the upgrade cannot start: starting new workers beside the old ones needs {asked}, and Ray "
        f"has {describe_free(free, keys)} free; {'; '.join(blocked)}. Free or add resources (a node, "
        "or lower num_cpus / num_gpus in the pools), or add a worker to the pool first; nothing was changed"
    )


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
    way: Way = Way.SURGE,
) -> UpgradeReport:
    """Replace every worker of ``pools`` by one built from ``config``, ``pace`` per pool
    at a time, ``way`` (see the module docstring). Raises what failed, after rolling back."""
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
        progress(f"upgrade: {way.value}, {pace} worker(s) per pool at a time")

        async def start(role: str, n: int) -> None:
            for w in await pools[role].add(n):
                report.started.append(w.worker_id)  # at once: a later failure rolls it back
                report.revisions[w.worker_id] = w.revision
                progress(f"upgrade: {w.worker_id} serving ({w.revision or 'revision unknown'})")

        async def stop(batch: dict[str, list[str]]) -> None:
            progress(f"upgrade: draining {', '.join(wid for ids in batch.values() for wid in ids)}")
            await asyncio.gather(
                *(pools[r].remove(wid, drain_timeout_s, "migrate") for r, ids in batch.items() for wid in ids)
            )
            for role, ids in batch.items():
                report.removed += ids
                removed[role] += len(ids)
                old[role] = old[role][len(ids) :]
                progress(f"upgrade: {', '.join(ids)} stopped")

        while any(old.values()):
            batch = {role: ids[:pace] for role, ids in old.items() if ids}
            if way is Way.SURGE:
                for role, ids in batch.items():  # one pool after the other (the module docstring says why)
                    await start(role, len(ids))
                await stop(batch)
            else:
                for role, ids in batch.items():
                    await stop({role: ids})
                    await start(role, len(ids))
    except BaseException as e:
        progress(f"upgrade failed ({type(e).__name__}: {e}); rolling back")
        back = _roll_back(pools, old_configs, report.started, removed, drain_timeout_s, way)
        await asyncio.shield(back)
        raise
    progress(f"upgrade done: {len(report.started)} worker(s) replaced")
    return report


async def _roll_back(
    pools: dict[str, WorkerPool],
    old_configs: dict[str, ClusterConfig],
    started: list[str],
    removed: dict[str, int],
    drain_timeout_s: float,
    way: Way = Way.SURGE,
) -> None:
    """The pools back to their old config and sizes: the new workers go (their requests
    finish), old-config workers replace the old ones removed (after the new ones went,
    in place: in their room)."""
    for role, pool in pools.items():
        pool.reconfigure(old_configs[role])

    async def add_old() -> None:
        for role, n in removed.items():
            if n:
                await pools[role].add(n)

    async def remove_new() -> None:
        for pool in pools.values():
            new = [w.worker_id for w in pool.workers if w.worker_id in started]
            await asyncio.gather(*(pool.remove(wid, drain_timeout_s, "wait") for wid in new))

    if way is Way.SURGE:
        await add_old()
        await remove_new()
    else:
        await remove_new()
        await add_old()
