"""Switching an elastic worker's role (``elastic_worker``: one engine that serves as
prefill or decode worker) without reloading its weights: ``switch_role``.

    drain            the registry routes no new work of its old role to it
    move off         a decode worker's running requests move to other decode workers
                     with their KV (``Moves.move_off``); those that cannot, finish
    wait             until it holds no work (prompts prefilled, exports pulled,
                     streams ended), polling it
    switch, activate the registry's record takes the new role and its client
                     (``WorkerRegistry.switch_role``), then joins as any worker does

Seconds, not a model load: the engine, its weights and its prefix cache stay as they
are. A worker that does not empty within the time allowed goes back to its old role
(ACTIVE again) and ``TimeoutError`` says so: nothing is dropped either way.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from splitserve.router.registry import WorkerRegistry
from splitserve.router.roles import Role
from splitserve.router.workers import WorkerClient

MoveOff = Callable[..., Awaitable[int]]  # Moves.move_off(worker_id, timeout_s=...)
POLL_S = 0.05  # how often it looks whether the worker still holds work


async def switch_role(
    registry: WorkerRegistry,
    worker_id: str,
    role: Role,
    client: WorkerClient,
    move_off: MoveOff | None = None,
    timeout_s: float = 60.0,
) -> float:
    """Give elastic worker ``worker_id`` the role ``role`` (called through ``client``, the
    same worker's client for that role), as the module docstring says. Returns the
    seconds it took. Raises ``ValueError`` for a worker of that role already,
    ``TimeoutError`` (the worker back in its old role) if it still held work after
    ``timeout_s``."""
    record = registry.get(worker_id)
    if record is None:
        raise ValueError(f"no worker {worker_id}")
    if record.role == role:
        raise ValueError(f"worker {worker_id} is a {role} worker already")
    start = time.monotonic()
    deadline = start + timeout_s
    registry.drain(worker_id)
    if record.role == Role.DECODE and move_off is not None:
        await move_off(worker_id, timeout_s=timeout_s)
    while True:
        await registry.poll([record])  # a prefill worker's exports, as the worker says now
        if not record.holds_work:
            break
        if time.monotonic() >= deadline:
            await registry.activate(worker_id)  # back in its old role: it serves on
            raise TimeoutError(
                f"worker {worker_id} still held work after {timeout_s:g} s; it stays {record.role}"
            )
        await asyncio.sleep(POLL_S)
    registry.switch_role(worker_id, role, client)
    await registry.activate(worker_id)
    return time.monotonic() - start


class RoleLedger(Collector):
    """Role switches and the worker-seconds spent in each role, for ``/metrics``::

        splitserve:role_switches_total{role}   switches into role
        splitserve:role_seconds_total{role}    worker-seconds spent in role (elastic workers,
                                               as the registry had them at each look)

    ``observe`` credits each worker's time since the last look to the role it had;
    it runs at each scrape and before each switch, so no time goes to the wrong role."""

    def __init__(self, registry: WorkerRegistry, clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.clock = clock
        self.switches: collections.Counter[str] = collections.Counter()
        self.seconds: collections.Counter[str] = collections.Counter()
        self._seen: dict[str, float] = {}  # worker -> when its time was last credited

    def observe(self) -> None:
        now = self.clock()
        workers = self.registry.workers(Role.PREFILL, Role.DECODE)
        for w in workers:
            self.seconds[w.role.value] += now - self._seen.get(w.worker_id, now)
            self._seen[w.worker_id] = now
        alive = {w.worker_id for w in workers}
        self._seen = {k: t for k, t in self._seen.items() if k in alive}

    def switched(self, role: Role) -> None:
        self.switches[Role(role).value] += 1

    def collect(self) -> Iterator[CounterMetricFamily]:
        self.observe()
        switches = CounterMetricFamily(
            "splitserve:role_switches", "Elastic workers switched into a role.", labels=["role"]
        )
        seconds = CounterMetricFamily(
            "splitserve:role_seconds", "Worker-seconds elastic workers spent in a role.", labels=["role"]
        )
        for role in (Role.PREFILL, Role.DECODE):
            switches.add_metric([role.value], self.switches[role.value])
            seconds.add_metric([role.value], self.seconds[role.value])
        yield from (switches, seconds)
