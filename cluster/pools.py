"""Pools of worker actors: one per role, each worker in its own placement group
(a TP group's bundles packed on one node), restarted by Ray when it dies.

The pool owns its actors and placement groups; what the router knows of
each worker lives in the ``WorkerRegistry``, where the pool writes only
membership: ``add`` registers a worker STARTING, activates it once its model
has loaded (the registry takes its info and first stats), and
``remove`` drains it (DRAINING: no new requests) and kills it once its
in-flight ones end (or a timeout passes), so scaling down drops nothing.

Each bundle holds a worker's (or TP rank's) CPUs, GPUs and the pool's custom
``resources``: a pool that asks for a phase resource (``splitserve_prefill``)
is placed only on nodes that advertise it.

A restarted worker keeps its actor handle, so its registry record stays
valid; its KV source comes back with a new incarnation, which a decode worker
notices in the next handoff from it and links to then (it asks the prefill
worker for its handshakes itself).

A worker Ray will not bring back (out of restarts, or a TP group, which Ray
never restarts) is **replaced**: ``keep`` (one task per pool, on the router's
loop) kills what is left of it and starts a new worker, so a pool keeps its
size through any number of crashes (``replaced`` counts them, for metrics).

In elastic mode (``mode: elastic``) both pools launch ``ElasticWorker`` actors (one
engine that serves either role): a worker switching role (``cluster.role_switch``,
``Cluster.switch_role``) is ``release``d by one pool and ``adopt``ed by the other,
its actor, placement group and registry record unchanged.

A worker with ``tp_size > 1`` is a group of actors in one placement group:
rank 0 (bundle 0; the router's handle: a ``PrefillWorker`` or ``DecodeWorker``)
and a ``PrefillRank`` or ``DecodeRank`` per other rank (a decode worker's rank
0 gets their handles, to have them pull their KV heads). They meet at a TCP
address picked on bundle 0's node. A group is not restarted (a lost rank
breaks its collectives): it fails its requests, which the router retries (or
resumes) elsewhere, and ``keep`` replaces it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from splitserve.cluster.config import ClusterConfig, PoolSpec
from splitserve.cluster.room import bundle
from splitserve.cluster.worker_client import RayDecodeRank, RayDecodeWorker, RayPrefillWorker, unwrap
from splitserve.decode_worker.tp import DecodeRank
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.elastic_worker.worker import ElasticWorker
from splitserve.prefill_worker.tp import PrefillRank
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.router.registry import Membership, NodePlacement, WorkerRecord, WorkerRegistry
from splitserve.router.roles import Role
from splitserve.wire.decode import DecodeWorkerSpec
from splitserve.wire.prefill import PrefillWorkerSpec
from splitserve.wire.tp import TPInit

log = logging.getLogger(__name__)

MAX_RESTARTS = 3  # Ray's restarts of one actor; past them the pool replaces the worker (``keep``)
KEEP_INTERVAL_S = 1.0  # how often ``keep`` looks for lost workers
KEEP_BACKOFF_MAX_S = 60.0  # the longest wait between failed replacements (doubling from 1 s)
START_TIMEOUT_S = 900.0  # a worker's start, loading included (a first start compiles the CPU kernels)
# a TP group's rendezvous task (in its placement group, once placed): a start whose node
# died under it waits here for Ray to place the group again, which may never come
RENDEZVOUS_TIMEOUT_S = 120.0


@dataclass
class _Member:
    """What the pool owns for one worker (the registry holds what the router knows)."""

    worker_id: str
    pg: PlacementGroup
    actor: object = None  # the Ray handle of rank 0 (the worker the router talks to)
    ranks: list = field(default_factory=list)  # actor handles of TP ranks 1..
    launched: float = field(default_factory=time.monotonic)  # when its placement group was asked for


def _startup_error(e: BaseException) -> str:
    """The sentence that says why an actor's constructor failed: Ray's ``ActorDiedError``
    carries the constructor's traceback, whose last line is the exception itself."""
    if isinstance(e, ray.exceptions.ActorDiedError):
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        if lines:
            return lines[-1]
    return str(unwrap(e))


@dataclass(frozen=True)
class ActorState:
    """An actor as Ray's GCS last recorded it."""

    state: str  # ALIVE, RESTARTING, DEAD, ...
    restarts: int  # how often Ray restarted it
    node_id: str  # the node it runs on (or last ran on); "" before Ray placed it


def actor_state(handle) -> ActorState:
    """The actor's record in Ray's GCS. Read from ``ray._private.state``, since Ray's
    public state API needs the dashboard, which a single-machine cluster does not run."""
    from ray._private import state

    info = state.actors(handle._actor_id.hex())
    node_id = (info.get("Address") or {}).get("NodeID", "")
    return ActorState(info.get("State", "UNKNOWN"), int(info.get("NumRestarts", 0)), node_id)


def _node_placement(node_id: str) -> NodePlacement:
    """The node's group as Ray labels it, or else the splitserve phase resources it offers."""
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), {})
    group = node.get("Labels", {}).get("ray.io/node-group", "")
    phases = sorted(r for r in node.get("Resources", {}) if r.startswith("splitserve_"))
    return NodePlacement(node_id, group or "+".join(phases))


RENDEZVOUS_PORTS = range(20000, 32768)  # above Ray's worker ports, below Linux's ephemeral range


def _rendezvous_address() -> str:
    """A TCP address on this node for a TP group's ranks to meet (run in bundle 0).

    The port is free when picked and is bound again only when rank 0 starts, so it is
    drawn at random outside the kernel's ephemeral range (and Ray's worker ports): a
    port the kernel hands out to an outgoing connection in between would make rank 0
    fail with EADDRINUSE (seen in the chaos run, with ports from ``bind(0)``)."""
    ip = ray.util.get_node_ip_address()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.choice(RENDEZVOUS_PORTS)
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError:
                continue
            return f"tcp://{ip}:{port}"
    raise RuntimeError(f"no free port for a tensor-parallel group on {ip} in {RENDEZVOUS_PORTS}")


class WorkerPool:
    def __init__(self, role: Role, config: ClusterConfig, registry: WorkerRegistry):
        self.role = Role(role)
        self.config = config
        self.registry = registry
        self.spec: PoolSpec = config.pools()[role]
        self._members: dict[str, _Member] = {}
        self._next_index = 0
        # placement groups are named for ``ray list placement-groups``; Ray refuses a name
        # already taken in the namespace, so each pool's names carry a token of their own
        # (two clusters on one Ray both have a "decode-0")
        self._pg_token = secrets.token_hex(3)
        self.replaced = 0  # workers replaced by ``keep`` after Ray gave them up
        self.engine_failures = 0  # of those, workers whose engine loop stopped (the process lived)
        # moves a worker's running requests to the others (the router's router.moves.Moves.move_off),
        # set once the router is up; None: a removed worker's requests finish where they are
        self.move_off: Callable[..., Awaitable[int]] | None = None

    def reconfigure(self, config: ClusterConfig) -> None:
        """Build the workers added from now on from ``config`` (a rolling upgrade,
        ``cluster.upgrade``); those running keep theirs."""
        self.config = config
        self.spec = config.pools()[self.role]

    @property
    def workers(self) -> list[WorkerRecord]:
        """This pool's workers, from the registry."""
        return self.registry.workers(self.role)

    def _worker_spec(self, worker_id: str, role: Role | None = None) -> PrefillWorkerSpec | DecodeWorkerSpec:
        role = role or self.role
        eng = self.config.engine_config(role)
        threads = self.spec.torch_threads or max(1, int(self.spec.num_cpus))
        t = self.config.transfer
        ids = self.spec.cpu_ids
        cpus = (ids[int(worker_id.rsplit("-", 1)[1]) % len(ids)],) if ids else None
        if role == Role.PREFILL:
            return PrefillWorkerSpec(
                worker_id,
                eng,
                t.backend,
                t.lease_s,
                threads,
                cpus,
                stream_kv=t.stream_layers,
                transfer_timeout_s=t.timeout_s,
            )
        backend = t.backend if role == Role.DECODE else None
        queue = self.config.limits.max_admission_queue
        return DecodeWorkerSpec(
            worker_id,
            eng,
            backend,
            t.timeout_s,
            queue,
            threads,
            cpus,
            lease_s=t.lease_s,
            verify_meaning=t.verify_meaning,
            engine_process=self.spec.engine_process,
        )

    async def add(self, n: int, timeout_s: float = START_TIMEOUT_S) -> list[WorkerRecord]:
        """Start ``n`` workers (STARTING in the registry), wait until each has loaded its
        model, then activate them (routed to from then on). If any fails, all are removed."""
        deadline = time.monotonic() + timeout_s
        started: list[_Member] = []
        try:
            for _ in range(n):
                started.append(await self._launch(deadline))
            for m in started:
                await self._wait_ready(m, deadline)
            return [await self.registry.activate(m.worker_id) for m in started]
        except BaseException:
            for m in started:
                self._kill(m)
            raise

    async def remove(self, worker_id: str, drain_timeout_s: float, drain: str = "wait") -> None:
        """Drain ``worker_id`` (no new requests; with ``drain`` "migrate" and a ``move_off``
        set, its running requests move to other workers; the rest finish, and a prefill
        worker's exports are pulled, for ``drain_timeout_s`` at most: the autoscaling
        config's), then kill it."""
        record = self.registry.get(worker_id)
        self.registry.drain(worker_id)
        deadline = time.monotonic() + drain_timeout_s
        if drain == "migrate" and self.move_off is not None and self.role != Role.PREFILL:
            moved = await self.move_off(worker_id, timeout_s=drain_timeout_s)
            log.info("%s: %d request(s) moved off before it goes", worker_id, moved)
        while record.holds_work and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await record.client.close()
        self._kill(self._members[worker_id])

    def actors(self, worker_id: str) -> list:
        """The Ray handles of ``worker_id``: rank 0 (the one the router calls), then its
        other TP ranks (for fault injection and tests)."""
        m = self._members[worker_id]
        return [m.actor, *m.ranks]

    async def lost(self) -> list[str]:
        """The ACTIVE workers that will not come back by themselves: one of whose actors
        Ray has given up (a worker out of restarts, any rank of a TP group), one whose
        engine has stopped while its process lives on (``stopped``: e.g. a TP group that
        broke), or a TP group whose rank 0 is not alive (it cannot rejoin its ranks).

        On the way, a worker that Ray restarted on another node (its node died, and its
        placement group was rescheduled) is recorded there (``registry.placed``)."""
        broken, handles = [], {}
        for w in self.registry.workers(self.role):
            m = self._members.get(w.worker_id)
            if m is None or w.state != Membership.ACTIVE:
                continue
            if w.stopped or (m.ranks and not w.alive):
                broken.append(w.worker_id)
            else:
                handles[w.worker_id] = [m.actor, *m.ranks]

        def read() -> dict[str, list[ActorState]]:  # GCS reads, off the router's loop
            return {wid: [actor_state(h) for h in hs] for wid, hs in handles.items()}

        states = await asyncio.to_thread(read)
        for wid, (first, *_) in states.items():
            record = self.registry.get(wid)
            if record is not None and record.restarts != first.restarts:
                self.registry.restarted(wid, first.restarts)
            moved = record is not None and record.node is not None and record.node.node_id != first.node_id
            if first.state == "ALIVE" and first.node_id and moved:
                log.info("%s was restarted on node %s", wid, first.node_id)
                node = await asyncio.to_thread(_node_placement, first.node_id)
                if self.registry.get(wid) is not None:  # not removed meanwhile
                    self.registry.placed(wid, node)
        # RESTARTING is not DEAD: Ray is bringing it back
        return broken + [wid for wid, ss in states.items() if any(s.state == "DEAD" for s in ss)]

    async def keep(self, interval_s: float = KEEP_INTERVAL_S) -> None:
        """Forever, every ``interval_s``: retire each lost worker (``lost``: out of routing
        at once) and start one in its place. Starts run beside the checks, so a worker lost
        while another loads is retired within a tick, not after that load. A start that
        fails stays owed and is tried again after a wait that doubles up to
        ``KEEP_BACKOFF_MAX_S``, so a worker that cannot start does not spin."""
        owed, backoff, next_try = 0, interval_s, 0.0
        starting: set[asyncio.Task] = set()
        try:
            while True:
                await asyncio.sleep(interval_s)
                for task in [t for t in starting if t.done()]:
                    starting.discard(task)
                    if task.exception() is None:
                        owed, backoff = owed - 1, interval_s
                    else:
                        log.error(
                            "starting a %s worker in place of a lost one failed (%s); next try in %.0f s",
                            self.role,
                            task.exception(),
                            backoff,
                        )
                        next_try, backoff = time.monotonic() + backoff, min(2 * backoff, KEEP_BACKOFF_MAX_S)
                try:
                    lost = await self.lost()
                except Exception:  # e.g. the GCS did not answer: try again next tick
                    log.exception("looking for lost %s workers failed", self.role)
                    lost = []
                for worker_id in lost:
                    record = self.registry.get(worker_id)
                    if record is not None and record.state == Membership.ACTIVE:  # not removed meanwhile
                        log.warning("%s is lost for good; starting a worker in its place", worker_id)
                        self._kill(self._members[worker_id])
                        self.replaced += 1
                        self.engine_failures += record.stopped
                        owed += 1
                if time.monotonic() >= next_try:
                    for _ in range(owed - len(starting)):
                        starting.add(asyncio.ensure_future(self.add(1)))
        finally:
            for task in starting:
                task.cancel()

    def shutdown(self) -> None:
        for m in list(self._members.values()):
            self._kill(m)

    # ---- internals ------------------------------------------------------------
    async def _launch(self, deadline: float) -> _Member:
        s = self.spec
        elastic = self.config.mode == "elastic"
        worker_id = f"{'elastic-' if elastic else ''}{self.role}-{self._next_index}"
        self._next_index += 1
        name = f"splitserve-{worker_id}-{self._pg_token}"
        pg = placement_group([bundle(s)] * s.ranks, strategy="STRICT_PACK", name=name)
        spec = self._worker_spec(worker_id)
        member = self._members[worker_id] = _Member(worker_id, pg)
        cls = PrefillWorker if self.role == Role.PREFILL else DecodeWorker
        args: tuple = ()
        if elastic:  # one engine for either role: both halves' specs
            cls = ElasticWorker
            spec, args = (
                self._worker_spec(worker_id, Role.PREFILL),
                (self._worker_spec(worker_id, Role.DECODE),),
            )
        if s.ranks > 1:
            try:
                spec = await self._start_ranks(member, spec, deadline)
            except BaseException:
                self._kill(member)  # the placement group and any rank already started
                raise
            if self.role != Role.PREFILL and spec.backend is not None:
                args = (tuple(RayDecodeRank(handle) for handle in member.ranks),)
        member.actor = (
            ray.remote(cls)
            .options(
                num_cpus=s.num_cpus,
                num_gpus=s.num_gpus,
                resources=s.resources,
                max_restarts=MAX_RESTARTS if s.ranks == 1 else 0,
                max_concurrency=4096,
                scheduling_strategy=self._bundle(pg, 0),
                **self._runtime_env(),
            )
            .remote(spec, *args)
        )
        self.registry.add(worker_id, self.role, self.client(member.actor), s.engine.block_size)
        return member

    def client(self, actor) -> RayPrefillWorker | RayDecodeWorker:
        """How the router calls ``actor`` in this pool's role (an elastic worker's prefill
        half answers as ``prefill_*``)."""
        if self.role != Role.PREFILL:  # decode, colocated
            return RayDecodeWorker(actor)
        return RayPrefillWorker(actor, "prefill_" if self.config.mode == "elastic" else "")

    def has(self, worker_id: str) -> bool:
        return worker_id in self._members

    def release(self, worker_id: str) -> _Member:
        """Let go of an elastic worker switching to the other role (its pool ``adopt``s
        it); the registry keeps its record."""
        return self._members.pop(worker_id)

    def adopt(self, member: _Member) -> None:
        """Take over an elastic worker that switched to this pool's role."""
        self._members[member.worker_id] = member

    async def _start_ranks(
        self, m: _Member, spec: PrefillWorkerSpec | DecodeWorkerSpec, deadline: float
    ) -> PrefillWorkerSpec | DecodeWorkerSpec:
        """Start TP ranks 1.. of a group; returns rank 0's spec (with its ``TPInit``).
        Raises ``RuntimeError`` when the ranks' rendezvous task has not run within
        ``RENDEZVOUS_TIMEOUT_S`` (or the start's ``deadline``); the caller then frees
        the group's placement group and any rank already started (``_launch``)."""
        s = self.spec
        await self._placed(m, deadline)
        meet = ray.remote(num_cpus=0)(_rendezvous_address)
        ref = meet.options(scheduling_strategy=self._bundle(m.pg, 0)).remote()
        limit = max(0.1, min(RENDEZVOUS_TIMEOUT_S, deadline - time.monotonic()))
        try:
            address = await asyncio.wait_for(ref, limit)
        except TimeoutError:
            ray.cancel(ref, force=True)
            raise RuntimeError(
                f"{m.worker_id}'s ranks could not meet: its placement group ran no task within "
                f"{limit:.0f} s (its node lost, and no room to place it again?)"
            ) from None
        ranks = [
            dataclasses.replace(spec, tp=TPInit(r, s.ranks, address), cpu_ids=self._rank_cpus(m.worker_id, r))
            for r in range(s.ranks)
        ]
        rank_cls = PrefillRank if self.role == Role.PREFILL else DecodeRank
        for r in range(1, s.ranks):
            handle = ray.remote(rank_cls).options(
                num_cpus=s.num_cpus,
                num_gpus=s.num_gpus,
                resources=s.resources,
                scheduling_strategy=self._bundle(m.pg, r),
                **self._runtime_env(),
            )
            m.ranks.append(handle.remote(ranks[r]))
        return ranks[0]

    def _runtime_env(self) -> dict:
        """The actor options that give a worker process the pool's ``env`` (none without
        one: a runtime env keeps Ray from reusing the processes it started ahead)."""
        return {"runtime_env": {"env_vars": dict(self.spec.env)}} if self.spec.env else {}

    def _rank_cpus(self, worker_id: str, rank: int) -> tuple[int, ...] | None:
        """Cores of one TP rank: the pool's ``cpu_ids`` dealt out rank by rank."""
        ids = self.spec.cpu_ids
        if not ids:
            return None
        index = int(worker_id.rsplit("-", 1)[1]) * self.spec.ranks + rank
        return (ids[index % len(ids)],)

    @staticmethod
    def _bundle(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)

    async def _placed(self, m: _Member, deadline: float) -> None:
        """Until Ray has placed ``m``'s placement group (perhaps after its autoscaler
        added a node); past ``placement_timeout_s`` the worker is given up."""
        s = self.spec
        limit = min(deadline, m.launched + s.placement_timeout_s)
        try:
            await asyncio.wait_for(m.pg.ready(), max(0.1, limit - time.monotonic()))
            record = self.registry.get(m.worker_id)  # None before rank 0 is registered (TP ranks first)
            if record is not None and record.node is None:
                self.registry.placed(m.worker_id, _node_placement(self.node_of(m.worker_id)))
        except TimeoutError:
            extra = "".join(f", {k}: {v:g}" for k, v in s.resources.items())
            reason = (
                f"Ray cannot place {m.worker_id}: it needs {s.ranks} x "
                f"{{CPU: {s.num_cpus}, GPU: {s.num_gpus}{extra}}} on one node, and no node "
                f"offered that within {s.placement_timeout_s:g} s (placement_timeout_s)"
            )
            log.warning("giving up: %s", reason)
            self.registry.give_up(m.worker_id, self.role, reason)
            raise RuntimeError(reason) from None

    def node_of(self, worker_id: str) -> str:
        """The id of the Ray node that ``worker_id`` (its rank 0) was placed on."""
        return placement_group_table(self._members[worker_id].pg)["bundles_to_node_id"][0]

    async def _wait_ready(self, m: _Member, deadline: float) -> None:
        """Until the worker (and every TP rank of it) has loaded its model; the first
        failure of any of them fails the start at once."""
        await self._placed(m, deadline)
        calls = [asyncio.ensure_future(h.info.remote()) for h in [m.actor, *m.ranks]]
        try:
            done, pending = await asyncio.wait(
                calls, timeout=max(0.1, deadline - time.monotonic()), return_when=asyncio.FIRST_EXCEPTION
            )
            for call in pending:
                call.cancel()
            if pending and not any(c.exception() for c in done):
                raise TimeoutError
            for call in done:
                call.result()
        except TimeoutError:
            raise RuntimeError(f"{m.worker_id} did not load its model in time") from None
        except ray.exceptions.RayError as e:
            raise RuntimeError(f"{m.worker_id} failed to start: {_startup_error(e)}") from None
        log.info("%s is ready", m.worker_id)

    def _kill(self, m: _Member) -> None:
        self.registry.remove(m.worker_id)
        self._members.pop(m.worker_id, None)
        for handle in [m.actor, *m.ranks]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already gone, or never started
                pass
        try:
            remove_placement_group(m.pg)
        except Exception:
            pass
