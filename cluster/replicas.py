"""Router replicas: more router processes on this node's gRPC and HTTP ports.

One Python router relays every token of the requests it serves, at a fixed cost
in CPU per token (``bench/front_door``), so one process caps the tokens a node's
front door can carry. With ``router.replicas`` = N, ``splitserve serve`` (the
primary: it owns the pools, the autoscalers and the planner) starts N - 1
``RouterReplica`` actors on its own node. Each binds the same gRPC and HTTP ports
(``SO_REUSEPORT``: gRPC sets it on every server; the HTTP servers ask for it), so
the kernel spreads new connections over the N processes. A replica is a whole
router of its own: its ``WorkerRegistry``, polled from the workers themselves
(stats, prefix logs: prefix-aware routing needs nothing from another router),
its ``Dispatcher``, its own token stream from each decode worker (one per
worker and router, never one per request), its metrics.

What the replicas share, and how:

- **Membership** comes from the primary, whose pools add, drain and remove
  workers: every ``SYNC_S`` it sends each replica the list of workers past
  STARTING (``Member``), and the replica adds, drains and removes to match
  (``sync``). A worker the primary drains stops getting new requests from every
  replica within ``SYNC_S``.
- **Admission limits** are split, not counted in one place: each of N routers
  admits ``ceil(limit / N)`` requests in flight and queues ``ceil(limit / N)``
  prompt tokens per prefill worker (``share``). No request waits on a shared
  counter, and a replica that dies takes its share with it. The price: the kernel
  spreads connections, not requests, so a client that sends everything over one
  long-lived connection meets one router's share.
- **Config, API keys, the served model and its validator** are the primary's:
  a replica gets the config and the validator the primary built at start, and
  reads the same API keys file.

The primary keeps the replicas (``Replicas.keep``): a replica whose sync fails
(its process died) is replaced by a new actor, synced first, then started, so it
never answers a request before it knows the workers. Streams that a dead replica
carried end with ``UNAVAILABLE`` at their clients (the SDK retries a call that
failed before its first token); the workers abort what it had started there when
its token streams close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from splitserve.cluster import router_parts as parts
from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.worker_client import RayDecodeWorker, RayPrefillWorker
from splitserve.router.auth import ApiKeys
from splitserve.router.metrics import PoolSize
from splitserve.router.metrics_server import MetricsServer
from splitserve.router.openai_http import OpenAIServer
from splitserve.router.policy import LimitsSpec
from splitserve.router.registry import Membership, NodePlacement, WorkerRegistry
from splitserve.router.roles import Role
from splitserve.router.server import RouterServer
from splitserve.wire.validation import RequestValidator

log = logging.getLogger(__name__)

SYNC_S = 1.0  # how often the primary sends each replica the membership


@dataclass(frozen=True)
class Member:
    """A worker as a replica needs it: enough to call it, and its membership state."""

    worker_id: str
    role: str
    actor: Any  # its Ray handle (rank 0's)
    block_size: int
    draining: bool
    node: NodePlacement | None


def members(registry: WorkerRegistry) -> list[Member]:
    """The primary's workers past STARTING (a starting one is not routed to anywhere)."""
    return [
        Member(
            w.worker_id, w.role.value, w.client.actor, w.block_size, w.state == Membership.DRAINING, w.node
        )
        for w in registry.workers()
        if w.state != Membership.STARTING
    ]


def share(limits: LimitsSpec, routers: int) -> LimitsSpec:
    """One router's part of the cluster's admission limits, of ``routers`` in all."""
    return limits.model_copy(
        update={
            "max_inflight_requests": math.ceil(limits.max_inflight_requests / routers),
            "max_queued_prompt_tokens": math.ceil(limits.max_queued_prompt_tokens / routers),
        }
    )


@dataclass(frozen=True)
class Ports:
    """Where the primary listens: a replica binds the same (the bound ports, also when
    the config asked for any free one)."""

    grpc: int
    http: int | None


class RouterReplica:
    """One router besides the primary (a Ray actor on the primary's node; see the module
    docstring). ``sync`` it first, then ``start`` it."""

    def __init__(self, config: ClusterConfig, index: int, validator: RequestValidator, ports: Ports):
        cfg, r = config, config.router
        self.config, self.index, self.ports = config, index, ports
        self.registry = WorkerRegistry()
        self.dispatcher = parts.dispatcher(cfg, self.registry, validator, share(cfg.limits, r.replicas))
        self.metrics = parts.metrics(cfg, self.registry, self.dispatcher, self._pool_sizes)
        self.api_keys = ApiKeys(r.api_keys_file) if r.api_keys_file is not None else None
        self.server: RouterServer | None = None
        self.http: OpenAIServer | None = None
        self.metrics_server: MetricsServer | None = None
        self._watching: asyncio.Future | None = None  # the API keys file, reread when it changes

    async def sync(self, workers: list[Member]) -> None:
        """Make this registry's membership the primary's: add (and activate) the new
        workers, drain the draining, remove the gone (closing their token streams)."""
        clients = {Role.PREFILL.value: RayPrefillWorker}
        known = {w.worker_id for w in self.registry.workers()}
        for m in workers:
            if m.worker_id not in known:
                client = clients.get(m.role, RayDecodeWorker)(m.actor)
                self.registry.add(m.worker_id, m.role, client, m.block_size)
                if m.node is not None:
                    self.registry.placed(m.worker_id, m.node)
                try:
                    await self.registry.activate(m.worker_id)
                except Exception as e:  # lost meanwhile: the next sync tries again
                    log.warning("replica %d could not add %s: %s", self.index, m.worker_id, e)
                    self.registry.remove(m.worker_id)
                    continue
            if m.draining and self.registry.get(m.worker_id).state != Membership.DRAINING:
                self.registry.drain(m.worker_id)
        current = {m.worker_id for m in workers}
        for w in self.registry.workers():
            if w.worker_id not in current:
                self.registry.remove(w.worker_id)
                await w.client.close()

    async def start(self) -> str:
        """Listen on the primary's ports; returns the gRPC address."""
        cfg, r = self.config, self.config.router
        credentials = parts.grpc_credentials(cfg)
        self.server = RouterServer(
            self.dispatcher,
            cfg.mode,
            r.host,
            self.ports.grpc,
            credentials=credentials,
            api_keys=self.api_keys,
        )
        await self.server.start()
        if self.ports.http is not None:
            self.http = parts.http_server(cfg, self.dispatcher, self.metrics, self.api_keys, self.ports.http)
            await self.http.start()
        if r.metrics_port is not None:  # a port of its own: a scrape of each sums correctly
            port = r.metrics_port + self.index if r.metrics_port else 0
            self.metrics_server = MetricsServer(self.metrics, r.host, port)
            await self.metrics_server.start()
        if self.api_keys is not None:
            self._watching = asyncio.ensure_future(self.api_keys.watch())
        return self.server.address

    async def admitted(self) -> int:
        """Requests this replica has admitted since it started."""
        return self.dispatcher.admitted

    async def cpu_seconds(self) -> float:
        """CPU time this replica's process has used (every thread): ``bench/front_door``."""
        return time.process_time()

    async def inflight(self) -> int:
        """Requests this replica holds now."""
        return self.dispatcher.num_inflight

    async def stop(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
        if self.http is not None:
            await self.http.stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self.server is not None:
            await self.server.stop(self.config.router.shutdown_grace_s)
        await asyncio.gather(*(w.client.close() for w in self.registry.workers()), return_exceptions=True)

    def _pool_sizes(self) -> list[PoolSize]:
        """The pools as this replica sees them (sizes are the primary's to state)."""
        roles = sorted({w.role for w in self.registry.workers()}, key=lambda r: r.value)
        return [PoolSize(role, len(self.registry.workers(role)), 0, 0) for role in roles]


class Replicas:
    """The primary's N - 1 replicas: started, synced every ``SYNC_S``, replaced when they die."""

    def __init__(self, config: ClusterConfig, registry: WorkerRegistry, validator, ports: Ports):
        self.config, self.registry, self.validator, self.ports = config, registry, validator, ports
        self.actors: list[Any] = [None] * (config.router.replicas - 1)
        self.replaced = 0  # replicas started in place of dead ones

    async def start(self) -> None:
        await asyncio.gather(*(self._launch(i) for i in range(len(self.actors))))

    async def keep(self) -> None:
        """Every ``SYNC_S``: send each replica the membership; replace one that does not answer."""
        while True:
            await asyncio.sleep(SYNC_S)
            await asyncio.gather(*(self._sync_or_replace(i) for i in range(len(self.actors))))

    async def admitted(self) -> list[int]:
        """Requests each replica admitted (0 for one that does not answer)."""
        counts = await asyncio.gather(*(a.admitted.remote() for a in self.actors), return_exceptions=True)
        return [c if isinstance(c, int) else 0 for c in counts]

    async def inflight(self) -> list[int]:
        """Requests each replica holds now."""
        return list(await asyncio.gather(*(a.inflight.remote() for a in self.actors)))

    async def cpu_seconds(self) -> list[float]:
        """Each replica's process CPU time so far."""
        return list(await asyncio.gather(*(a.cpu_seconds.remote() for a in self.actors)))

    async def stop(self) -> None:
        await asyncio.gather(*(a.stop.remote() for a in self.actors if a is not None), return_exceptions=True)
        for a in self.actors:
            if a is not None:
                ray.kill(a)

    async def _sync_or_replace(self, i: int) -> None:
        try:
            await self.actors[i].sync.remote(members(self.registry))
        except Exception as e:
            log.warning("router replica %d is lost (%s); starting another", i + 1, e)
            with contextlib.suppress(Exception):  # already gone
                ray.kill(self.actors[i])
            try:
                await self._launch(i)
            except Exception as e:  # the slot keeps the dead actor: the next round tries again
                log.warning("router replica %d could not be started again (%s); retrying", i + 1, e)
                return
            self.replaced += 1

    async def _launch(self, i: int) -> None:
        """A new replica in slot ``i``: on this node, synced, then listening."""
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = (
            ray.remote(RouterReplica)
            .options(num_cpus=0, scheduling_strategy=here, name=None, max_restarts=0)
            .remote(self.config, i + 1, self.validator, self.ports)
        )
        try:
            await actor.sync.remote(members(self.registry))
            await actor.start.remote()
        except BaseException:
            ray.kill(actor)  # a replica half started holds a port share it cannot serve
            raise
        self.actors[i] = actor
