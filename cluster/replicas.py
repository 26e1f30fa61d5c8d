"""Router replicas and node routers: more router processes, on this node's ports and
on other nodes.

One Python router relays every token of the requests it serves, at a fixed cost
in CPU per token (``bench/front_door``), so one process caps the tokens a node's
front door can carry. ``splitserve serve`` (the primary: it owns the pools, the
autoscalers and the planner) keeps more routers, each a ``RouterReplica`` actor:

- **replicas**: with ``router.replicas`` = N, N - 1 on its own node. Each binds
  the primary's gRPC and HTTP ports (``SO_REUSEPORT``: gRPC sets it on every
  server; the HTTP servers ask for it), so the kernel spreads new connections
  over the N processes.
- **node routers**: on every other node of the Ray cluster, one per unit of
  ``router.node_resource`` it offers (``splitserve_router`` in the ``ray up``
  YAMLs' node types; 2 units: two routers sharing its ports, as replicas do), on
  ``router.host`` and the configured ports there (0: any free port each, then
  the same one again for its replacement), so a cloud load balancer or DNS can
  front every node. A node that joins gets one within
  ``NODES_S``; a node that leaves takes its router with it.

A router is a whole router of its own: its ``WorkerRegistry``, polled from the
workers themselves (stats, prefix logs: prefix-aware routing needs nothing from
another router), its ``Dispatcher``, its own token stream from each decode worker
(one per worker and router, never one per request), its metrics (its requests'
series, labelled ``replica``; the workers' and pools' series are the primary's
alone, so a scrape of every router sums correctly).

What the routers share, and how:

- **Membership** comes from the primary, whose pools add, drain and remove
  workers: every ``SYNC_S`` it sends each router the list of workers past
  STARTING (``Member``), and the router adds, drains and removes to match
  (``sync``). A worker the primary drains stops getting new requests from every
  router within ``SYNC_S``.
- **Admission limits** are split, not counted in one place: each of N routers
  admits ``ceil(limit / N)`` requests in flight and queues ``ceil(limit / N)``
  prompt tokens per prefill worker (``share``; N counts the node routers of the
  moment, and each sync carries the share). No request waits on a shared
  counter, and a router that dies takes its share with it. The price: the kernel
  (or the load balancer) spreads connections, not requests, so a client that
  sends everything over one long-lived connection meets one router's share.
- **LoRA adapters loaded or unloaded at run time** (``/v1/load_lora_adapter``) are
  the primary's to change: another router passes the change to it through the desk
  (``cluster.adapter_desk``), and every router serves the result before the change is
  answered (``spread_adapters``).
- **Config, API keys, the served model and its validator** are the primary's:
  a router gets the config and the validator the primary built at start, and
  reads the same API keys file (on its own node: the same path).

The primary keeps the routers (``Replicas.keep``): one whose sync fails (its
process died) is replaced by a new actor, synced first, then started, so it
never answers a request before it knows the workers. Streams that a dead router
carried end with ``UNAVAILABLE`` at their clients (the SDK retries a call that
failed before its first token on another router); the workers abort what it had
started there when its token streams close. ``ClusterStatus`` on the primary
lists every router (``RouterInfo``); on another router, that router.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from splitserve.cluster import router_parts as parts
from splitserve.cluster.adapter_desk import AdapterDesk, ForwardedAdapters, serve_desk
from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.lora_admin import LoRAAdmin
from splitserve.cluster.worker_client import RayDecodeWorker, RayPrefillWorker
from splitserve.router.auth import ApiKeys
from splitserve.router.dispatch import Dispatcher
from splitserve.router.metrics_server import MetricsServer
from splitserve.router.openai.server import OpenAIServer
from splitserve.router.policy import LimitsSpec
from splitserve.router.registry import Membership, NodePlacement, WorkerRegistry
from splitserve.router.roles import Role
from splitserve.router.server import RouterServer
from splitserve.wire.routers import RouterInfo
from splitserve.wire.validation import RequestValidator

log = logging.getLogger(__name__)

SYNC_S = 1.0  # how often the primary sends each router the membership
SPREAD_TIMEOUT_S = 10.0  # how long a LoRA change waits for each other router to serve it
NODES_S = 5.0  # how often it looks for nodes that want a router, and nodes gone


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
    """One router's part of the cluster's admission limits, of ``routers`` in all (a
    decode batch cap from ``decode_tpot_ms`` is each router's whole: a router counts
    only its own requests on a worker, so N routers may give a worker up to N times it)."""

    def part(n: int | None) -> int | None:
        return None if n is None else math.ceil(n / routers)

    return limits.model_copy(
        update={
            "max_inflight_requests": part(limits.max_inflight_requests),
            "max_queued_prompt_tokens": part(limits.max_queued_prompt_tokens),
            "max_decode_batch": part(limits.max_decode_batch),
        }
    )


def reachable(host: str, port: int) -> str:
    """``host:port`` as another machine dials it: a wildcard host (0.0.0.0, ::) becomes
    this node's address."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = ray.util.get_node_ip_address()
    return f"{host}:{port}"


@dataclass(frozen=True)
class Ports:
    """What a router binds: the primary's bound ports for a replica on its node (also when
    the config asked for any free one), the configured ones for a node router (0: any
    free port, then the ones it bound, so that a replacement binds them again)."""

    grpc: int
    http: int | None


class RouterReplica:
    """One router besides the primary (a Ray actor; see the module docstring). ``sync``
    it first, then ``start`` it."""

    def __init__(
        self,
        config: ClusterConfig,
        index: int,
        validator: RequestValidator,
        ports: Ports,
        limits: LimitsSpec,
        desk: Any = None,
    ):
        """``desk``: the primary's ``AdapterDesk`` (None: this router refuses runtime LoRA
        changes, 501)."""
        cfg, r = config, config.router
        self.config, self.index, self.ports = config, index, ports
        self.desk = desk
        self.registry = WorkerRegistry()
        self.dispatcher = parts.dispatcher(cfg, self.registry, validator, limits)
        # the workers' figures are the primary's to export: a scrape of every router sums
        self.metrics = parts.metrics(cfg, self.registry, self.dispatcher, list, replica=index, workers=False)
        self.api_keys = ApiKeys(r.api_keys_file) if r.api_keys_file is not None else None
        self.server: RouterServer | None = None
        self.http: OpenAIServer | None = None
        self.metrics_server: MetricsServer | None = None
        self._watching: asyncio.Future | None = None  # the API keys file, reread when it changes

    async def sync(self, workers: list[Member], limits: LimitsSpec, adapters: tuple[str, ...]) -> None:
        """Make this registry's membership the primary's: add (and activate) the new
        workers, drain the draining, remove the gone (closing their token streams); admit
        within ``limits`` (this router's share), and serve the LoRA ``adapters`` the
        primary serves (loaded and unloaded at run time there), from now on."""
        self.dispatcher.limits = limits
        self.dispatcher.adapters = adapters
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
                    log.warning("router %d could not add %s: %s", self.index, m.worker_id, e)
                    self.registry.remove(m.worker_id)
                    continue
            if m.draining and self.registry.get(m.worker_id).state != Membership.DRAINING:
                self.registry.drain(m.worker_id)
        current = {m.worker_id for m in workers}
        for w in self.registry.workers():
            if w.worker_id not in current:
                self.registry.remove(w.worker_id)
                await w.client.close()

    async def start(self) -> Ports:
        """Listen on ``ports``; the ports it bound (a node router's replacement binds
        the same ones again)."""
        cfg, r = self.config, self.config.router
        credentials = parts.grpc_credentials(cfg)
        self.server = RouterServer(
            self.dispatcher,
            cfg.mode,
            r.host,
            self.ports.grpc,
            credentials=credentials,
            api_keys=self.api_keys,
            routers=self._me,
            relief=r.kv_relief.relief() if r.kv_relief is not None else None,
        )
        await self.server.start()
        if self.ports.http is not None:
            lora = ForwardedAdapters(self.desk) if self.desk is not None else None
            self.http = parts.http_server(
                cfg, self.dispatcher, self.metrics, self.api_keys, self.ports.http, reuse_port=True, lora=lora
            )
            await self.http.start()
        if r.metrics_port is not None:  # a port of its own: a scrape of each sums correctly
            port = r.metrics_port + self.index if r.metrics_port else 0
            self.metrics_server = MetricsServer(self.metrics, r.host, port)
            await self.metrics_server.start()
        if self.api_keys is not None:
            self._watching = asyncio.ensure_future(self.api_keys.watch())
        return Ports(self.server.port, self.http.port if self.http is not None else None)

    async def serve_adapters(self, adapters: tuple[str, ...]) -> None:
        """Route to the LoRA ``adapters`` from now on (the primary changed them)."""
        self.dispatcher.adapters = adapters

    async def info(self) -> RouterInfo:
        """This router as ``ClusterStatus`` reports it."""
        d = self.dispatcher
        return RouterInfo(
            index=self.index,
            node_id=ray.get_runtime_context().get_node_id(),
            address=reachable(self.server.host, self.server.port) if self.server is not None else "",
            http_address=reachable(self.http.host, self.http.port) if self.http is not None else "",
            inflight=d.num_inflight,
            admitted=d.admitted,
            max_inflight=d.limits.max_inflight_requests,
        )

    async def cpu_seconds(self) -> float:
        """CPU time this replica's process has used (every thread): ``bench/front_door``."""
        return time.process_time()

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

    async def _me(self) -> list[RouterInfo]:
        return [await self.info()]


@dataclass
class _Slot:
    """One router the primary keeps: where it runs and what it binds."""

    index: int  # 1 and up (the primary is 0): its metrics port offset and its replica label
    node_id: str
    ports: Ports
    resource: str | None  # the node resource a node router holds (None: a replica on the primary's node)
    actor: Any = None  # None until launched (or while a relaunch fails)
    launched: int = 0  # routers started in this slot so far
    info: RouterInfo | None = None  # as it last answered ``infos``


class Replicas:
    """The routers besides the primary: its ``router.replicas`` - 1 replicas on its node,
    and a node router on every other node offering ``router.node_resource``. Every
    ``SYNC_S`` (``keep``) it starts node routers on new nodes and drops those of nodes
    gone, splits the admission limits between all routers (``share``: ``limits`` is the
    primary's part, which its dispatcher admits within), sends each the membership,
    and replaces one that does not answer."""

    def __init__(
        self,
        config: ClusterConfig,
        registry: WorkerRegistry,
        validator: RequestValidator,
        ports: Ports,
        dispatcher: Dispatcher,
        lora: LoRAAdmin | None = None,
    ):
        """``lora``: the primary's runtime LoRA loads (its HTTP door's), which the other
        routers' doors reach through a desk (``cluster.adapter_desk``); None: they
        refuse them."""
        self.config, self.registry, self.validator = config, registry, validator
        self.dispatcher = dispatcher  # the primary's: it admits within its share too
        self.lora = lora
        self.desk: Any = None  # the AdapterDesk actor, from ``start``
        self._serving_desk: asyncio.Task | None = None
        self.node_id = ray.get_runtime_context().get_node_id()  # the primary's
        self.slots = [_Slot(i, self.node_id, ports, None) for i in range(1, config.router.replicas)]
        self.limits = self.dispatcher.limits
        self.replaced = 0  # routers started in place of dead ones
        self._nodes_read = -math.inf  # time.monotonic() of the last look at Ray's nodes

    @property
    def actors(self) -> list[Any]:
        """Each router's actor, in slot order (None: not running now)."""
        return [s.actor for s in self.slots]

    async def start(self) -> None:
        if self.lora is not None:
            where = NodeAffinitySchedulingStrategy(self.node_id, soft=False)
            self.desk = (
                ray.remote(AdapterDesk)
                .options(num_cpus=0, scheduling_strategy=where, max_restarts=0)
                .remote()
            )
            self._serving_desk = asyncio.create_task(serve_desk(self.desk, self.lora))
            self.lora.spread = self.spread_adapters
        await self._place_node_routers()
        await asyncio.gather(*(self._launch(s) for s in self.slots))

    async def keep(self) -> None:
        """Every ``SYNC_S``: place node routers (every ``NODES_S``), sync or replace each."""
        while True:
            await asyncio.sleep(SYNC_S)
            if time.monotonic() - self._nodes_read >= NODES_S:
                await self._place_node_routers()
            await asyncio.gather(*(self._sync_or_replace(s) for s in list(self.slots)))

    async def infos(self) -> list[RouterInfo]:
        """Each router as it answers now (one that does not, as it last answered, not alive)."""

        async def ask(s: _Slot) -> RouterInfo:
            try:
                s.info = await s.actor.info.remote()
                return s.info
            except Exception:
                last = s.info or RouterInfo(s.index, s.node_id, "", "", 0, 0, 0)
                return dataclasses.replace(last, inflight=0, alive=False)

        return list(await asyncio.gather(*(ask(s) for s in self.slots)))

    async def spread_adapters(self, adapters: tuple[str, ...]) -> None:
        """Every router routes to the LoRA ``adapters`` from now on (``LoRAAdmin.spread``).
        Waits at most ``SPREAD_TIMEOUT_S`` for each: a router that does not answer (lost
        or stuck) gets them with its next sync, or its replacement at launch, and does
        not hold the change's answer."""

        async def tell(actor: Any) -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(actor.serve_adapters.remote(adapters), SPREAD_TIMEOUT_S)

        await asyncio.gather(*(tell(s.actor) for s in self.slots if s.actor is not None))

    async def cpu_seconds(self) -> list[float]:
        """Each router's process CPU time so far."""
        return list(await asyncio.gather(*(s.actor.cpu_seconds.remote() for s in self.slots)))

    async def stop(self) -> None:
        await asyncio.gather(
            *(s.actor.stop.remote() for s in self.slots if s.actor is not None), return_exceptions=True
        )
        for s in self.slots:
            if s.actor is not None:
                ray.kill(s.actor)
        if self._serving_desk is not None:
            self._serving_desk.cancel()
            ray.kill(self.desk)

    async def _place_node_routers(self) -> None:
        """A slot for every live node offering ``router.node_resource`` (but the
        primary's); the slots of nodes no longer alive dropped."""
        resource = self.config.router.node_resource
        if resource is not None:
            self._nodes_read = time.monotonic()
            self._place_on(await asyncio.to_thread(ray.nodes), resource)
        self.limits = share(self.config.limits, 1 + len(self.slots))
        self.dispatcher.limits = self.limits

    def _place_on(self, nodes: list[dict], resource: str) -> None:
        """As many node routers on each live node (but the primary's) as it offers whole
        units of ``resource``; the slots of nodes gone (or of units withdrawn) dropped."""
        wanted = {
            n["NodeID"]: int(n.get("Resources", {}).get(resource, 0))
            for n in nodes
            if n["Alive"] and n["NodeID"] != self.node_id
        }
        for s in [s for s in self.slots if s.resource is not None]:
            if wanted.get(s.node_id, 0) > 0:
                wanted[s.node_id] -= 1  # this slot is one of them
                continue
            log.warning("node %s is gone; so is its router %d", s.node_id[:12], s.index)
            if s.actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(s.actor)
            self.slots.remove(s)
        r = self.config.router
        for node, more in sorted(wanted.items()):
            for _ in range(more):
                index = min(set(range(1, len(self.slots) + 2)) - {s.index for s in self.slots})
                self.slots.append(_Slot(index, node, Ports(r.port, r.http_port), resource))
                log.info("node %s offers %s: router %d will serve there", node[:12], resource, index)

    async def _sync_or_replace(self, s: _Slot) -> None:
        """Send ``s``'s router the membership and its share; one that does not answer
        (its process died) is killed and a new one launched (retried next round if that
        fails). Its streams end at their clients; the workers abort what it started."""
        if s.actor is not None:
            try:
                await s.actor.sync.remote(members(self.registry), self.limits, self.dispatcher.adapters)
                return
            except Exception as e:
                log.warning("router %d is lost (%s); starting another", s.index, e)
                with contextlib.suppress(Exception):  # already gone
                    ray.kill(s.actor)
                s.actor = None
        again = s.launched > 0  # one had served here: this is a replacement
        try:
            await self._launch(s)
        except Exception as e:  # the next round tries again
            log.warning("router %d could not be started (%s); retrying", s.index, e)
            return
        self.replaced += again

    async def _launch(self, s: _Slot) -> None:
        """A new router in slot ``s``: on its node, synced, then listening."""
        where = NodeAffinitySchedulingStrategy(s.node_id, soft=False)
        resources = {s.resource: 1} if s.resource is not None else {}
        actor = (
            ray.remote(RouterReplica)
            .options(num_cpus=0, resources=resources, scheduling_strategy=where, max_restarts=0)
            .remote(self.config, s.index, self.validator, s.ports, self.limits, self.desk)
        )
        try:
            await actor.sync.remote(members(self.registry), self.limits, self.dispatcher.adapters)
            bound = await actor.start.remote()
        except BaseException:
            ray.kill(actor)  # a router half started holds a port share it cannot serve
            raise
        s.actor, s.launched = actor, s.launched + 1
        if s.resource is not None:  # a replacement binds what this one bound
            s.ports = bound
