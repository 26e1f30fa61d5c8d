"""Per-phase autoscaling: each pool scales on the load of its own phase.

- prefill: prompt tokens the router has sent to a worker and not yet got back
  (queued + being prefilled), averaged over the pool's workers;
- decode / colocated: how busy a worker is, the larger of its KV occupancy
  and its share of ``max_num_seqs`` in use, averaged over the pool.

The desired size is the usual proportional rule, ``ceil(replicas * load /
target)``, clamped to ``[min_replicas, max_replicas]``. A change must be
wanted for ``upscale_delay_s`` (growing) or ``downscale_delay_s``
(shrinking) in a row before it happens, so bursts do not flap the pool.
Scaling down drains: the worker leaves routing at once, is killed only when
its in-flight requests have finished (or ``drain_timeout_s`` passed), so no
request is dropped by a scale-down.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from splitserve.cluster.config import AutoscalingSpec
from splitserve.cluster.pools import WorkerPool
from splitserve.router.registry import WorkerRecord
from splitserve.router.roles import Role

log = logging.getLogger(__name__)


def pool_load(role: str, workers: list[WorkerRecord], max_num_seqs: int) -> float:
    """The pool's mean load in the unit its target uses (see the module docstring)."""
    live = [w for w in workers if w.routable]
    if not live:
        return 0.0
    if role == Role.PREFILL:
        return sum(w.queued_prompt_tokens for w in live) / len(live)
    busy = [
        max(1 - w.free_blocks / w.num_blocks if w.num_blocks else 0.0, w.active / max_num_seqs) for w in live
    ]
    return sum(busy) / len(busy)


def desired_replicas(current: int, load: float, spec: AutoscalingSpec) -> int:
    want = math.ceil(current * load / spec.target) if current else spec.min_replicas
    return max(spec.min_replicas, min(spec.max_replicas, want))


class ScaleDecision:
    """Hysteresis: a new size is returned once it has been wanted long enough."""

    def __init__(self, spec: AutoscalingSpec, clock: Callable[[], float] = time.monotonic):
        self.spec = spec
        self.clock = clock
        self._since: float | None = None
        self._direction = 0

    def update(self, current: int, load: float) -> int | None:
        want = desired_replicas(current, load, self.spec)
        direction = (want > current) - (want < current)
        now = self.clock()
        if direction == 0:
            self._since, self._direction = None, 0
            return None
        if direction != self._direction:
            self._since, self._direction = now, direction
        delay = self.spec.upscale_delay_s if direction > 0 else self.spec.downscale_delay_s
        if now - self._since >= delay:
            self._since, self._direction = None, 0
            return current + direction  # one step at a time
        return None


class Autoscaler:
    """Runs ``ScaleDecision`` for one pool and applies it through the pool, which
    records membership in the registry (the autoscaler only reads it)."""

    def __init__(self, pool: WorkerPool, spec: AutoscalingSpec):
        self.pool = pool
        self.spec = spec
        self.decision = ScaleDecision(spec)
        self.events: list[tuple[float, int]] = []  # (time, new size), for status and tests
        self.desired = pool.spec.replicas  # the policy's last wish (before hysteresis), for metrics

    def _routable(self) -> list[WorkerRecord]:
        return self.pool.registry.routable(self.pool.role)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.spec.interval_s)
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed scale step must not stop the loop or the router
                log.exception("autoscaling the %s pool failed", self.pool.role)

    async def step(self) -> None:
        routable = self._routable()
        current = len(routable)
        load = pool_load(self.pool.role, routable, self.pool.spec.engine.max_num_seqs)
        self.desired = desired_replicas(current, load, self.spec)
        new = self.decision.update(current, load)
        if new is None:
            return
        if new > current:
            log.info("scaling the %s pool up to %d (load %.2f)", self.pool.role, new, load)
            await self.add()
        else:
            victim = min(routable, key=lambda w: (w.active, w.running))
            log.info("scaling the %s pool down to %d (load %.2f)", self.pool.role, new, load)
            await self.remove(victim.worker_id)

    async def add(self) -> WorkerRecord:
        """Start one worker; the pool routes to it once it has loaded its model."""
        (record,) = await self.pool.add(1)
        self.events.append((time.time(), len(self._routable())))
        return record

    async def remove(self, worker_id: str) -> None:
        """Take ``worker_id`` out of routing now; kill it once its requests have finished."""
        log.info("draining %s", worker_id)
        await self.pool.remove(worker_id, self.spec.drain_timeout_s, self.spec.drain)
        self.events.append((time.time(), len(self._routable())))
