"""The one record of every worker in every pool: ``WorkerRegistry``.

Pools, the dispatcher, the autoscaler, the status service (and metrics) all
read it; nobody keeps a list of their own. Each field has one writer, always
through a registry method::

    field                               written by (method)
    ---------------------------------   -------------------------------------------
    state (membership)                  the pools: add, activate, drain, remove
    role, client (elastic workers)      the pools: switch_role
    node (where Ray placed it)          the pools: placed
    restarts (Ray's restarts of it)     the pools: restarted
    given_up (registry, not a record)   the pools: give_up
    alive, stopped, stats, error, prefix poll() (the router's poller, status calls);
                                        alive, error also unreachable() (the dispatcher)
    steps (a decode worker's step times) poll()
    info (validator, handshakes)        activate
    prefilling / decoding / unpolled    the dispatcher: prefilling(), prefill_done(), decoding()

A worker's lifecycle::

    add() --> STARTING --activate()--> ACTIVE --drain()--> DRAINING --remove()--> (gone)
                 |  (waiting for a node,  (routable         (finishes its
                 |   then loading; not     when alive)       requests, takes no new)
                 |   routed to or polled)        |
                 +--remove()--> (gone: it failed to start)
                 +--give_up()--> (gone, listed in given_up: Ray never placed it)
                                                 |
        an elastic worker, DRAINING and holding no work:
                 STARTING <--switch_role()-------+  (its new role; activate() again)

Router load is derived, never counted up and down: a worker's queued prompt
tokens and active requests are sums over the requests the dispatcher holds
open on it (``prefilling``/``decoding`` context managers, which always end),
and its decode reservations are the requests sent since the last poll began
(a poll that began later is taken to count their blocks in its free count).
Nothing can drift.

One asyncio loop owns the registry (the router's); it is not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.roles import Role
from splitserve.router.step_time import StepTimes
from splitserve.router.workers import WorkerClient, WorkerInfo, WorkerStats
from splitserve.wire.decode import DecodeStats
from splitserve.wire.errors import WorkerLost, WorkerStopped
from splitserve.wire.prefill import PrefillStats


class Membership(enum.Enum):
    STARTING = "starting"  # launched, loading its model; not routed to
    ACTIVE = "active"  # routed to while alive
    DRAINING = "draining"  # finishing its requests; takes no new ones


@dataclass(frozen=True)
class NodePlacement:
    """The Ray node a worker (its rank 0) runs on. ``node_type`` is the node's group
    as Ray labels it (``ray.io/node-group``, e.g. a KubeRay worker group) or else the
    splitserve phase resources it advertises (``splitserve_prefill``)."""

    node_id: str
    node_type: str


@dataclass(frozen=True)
class GivenUp:
    """A worker a pool launched and then gave up (it is no longer registered)."""

    worker_id: str
    role: Role
    reason: str
    at: float  # time.time()


@dataclass(eq=False)
class WorkerRecord:
    """One worker. Read by anyone; written only by ``WorkerRegistry`` (see its table)."""

    worker_id: str
    role: Role
    client: WorkerClient
    block_size: int
    state: Membership = Membership.STARTING
    alive: bool = True
    stopped: bool = False  # its engine stopped for good (it answered so): only a replacement helps
    stats: WorkerStats | None = None  # the last poll's answer
    error: str = ""  # why the last poll got none
    info: WorkerInfo | None = None  # what the worker said of itself when it joined (or restarted)
    prefilling: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens sent
    decoding: dict[str, int] = field(default_factory=dict)  # request id -> KV tokens reserved
    unpolled: set[str] = field(default_factory=set)  # decoding ids sent since the last poll began
    prefix: PrefixIndex = field(default_factory=PrefixIndex)  # its prefix cache, as last polled
    steps: StepTimes = field(default_factory=StepTimes)  # its decode step times, as polled
    node: NodePlacement | None = None  # None while STARTING: waiting for Ray to place it
    restarts: int = 0  # how often Ray restarted its process (it crashed), as the pools last read it

    @property
    def waiting_for_node(self) -> bool:
        return self.state == Membership.STARTING and self.node is None

    @property
    def routable(self) -> bool:
        return self.state == Membership.ACTIVE and self.alive

    @property
    def revision(self) -> str:
        """Which weights it serves ("" before it joined): KV moves only between workers
        of one revision (``wire.kv.CompatInfo``)."""
        return self.info.revision if self.info is not None else ""

    @property
    def queued_prompt_tokens(self) -> int:
        """Prompt tokens sent to this worker for prefill and not yet back."""
        return sum(self.prefilling.values())

    @property
    def active(self) -> int:
        """Requests this worker holds for the router (prefilling or streaming)."""
        return len(self.prefilling.keys() | self.decoding.keys())

    @property
    def holds_work(self) -> bool:
        """Requests open on it, or (as last polled) KV exports a decode worker may still pull."""
        return self.active > 0 or bool(isinstance(self.stats, PrefillStats) and self.stats.exports)

    @property
    def reserved_tokens(self) -> int:
        """KV tokens of requests sent since the last poll began (not in its free count)."""
        return sum(self.decoding[r] for r in self.unpolled)

    @property
    def free_blocks(self) -> int:
        return self.stats.engine.num_free_blocks if self.stats else 0

    @property
    def num_blocks(self) -> int:
        return self.stats.engine.num_blocks if self.stats else 0

    @property
    def running(self) -> int:
        return self.stats.engine.num_running if self.stats else 0

    @property
    def free_tokens(self) -> int:
        return self.free_blocks * self.block_size - self.reserved_tokens

    @property
    def prefill_tokens_per_s(self) -> float:
        """Its engine's measured prompt throughput (0.0 until measured)."""
        return self.stats.engine.prefill_tokens_per_s if self.stats else 0.0

    @property
    def decode_step_s(self) -> float:
        """Its engine's recent mean decode step time (0.0 until measured)."""
        return self.stats.engine.decode_step_s if self.stats else 0.0

    def cached_tokens(self, prompt_hashes: Sequence[int], prompt_len: int) -> int:
        """Prompt tokens this worker would take from its prefix cache (as last polled);
        the block holding the prompt's last token is always computed."""
        usable = (prompt_len - 1) // self.block_size if prompt_len else 0
        return self.prefix.cached_blocks(prompt_hashes[:usable]) * self.block_size


class WorkerRegistry:
    GIVEN_UP_KEPT = 32

    def __init__(self, poll_timeout_s: float = 2.0):
        self.poll_timeout_s = poll_timeout_s
        self._workers: dict[str, WorkerRecord] = {}
        self.given_up: list[GivenUp] = []  # written by give_up only

    # ---- reads --------------------------------------------------------------------
    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def workers(self, *roles: Role) -> list[WorkerRecord]:
        """Every member of these roles (all roles if none given), in the order they were added."""
        return [w for w in self._workers.values() if not roles or w.role in roles]

    def routable(self, *roles: Role) -> list[WorkerRecord]:
        return [w for w in self.workers(*roles) if w.routable]

    # ---- membership (the pools) -------------------------------------------------------
    def add(self, worker_id: str, role: Role | str, client: WorkerClient, block_size: int) -> WorkerRecord:
        """A launched worker, STARTING (not routed to until ``activate``)."""
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id} is already registered")
        record = WorkerRecord(worker_id, Role(role), client, block_size)
        self._workers[worker_id] = record
        return record

    async def activate(self, worker_id: str) -> WorkerRecord:
        """A worker has loaded its model: take its info (validator, handshakes) and first
        stats, route to it."""
        record = self._workers[worker_id]
        record.info = await record.client.info()
        await self.poll([record])
        record.state = Membership.ACTIVE
        return record

    def placed(self, worker_id: str, node: NodePlacement) -> None:
        """Ray placed the worker on ``node`` (a worker without one is waiting for a node)."""
        self._workers[worker_id].node = node

    def restarted(self, worker_id: str, restarts: int) -> None:
        """Ray has restarted the worker's process ``restarts`` times since it joined."""
        self._workers[worker_id].restarts = restarts

    def give_up(self, worker_id: str, role: Role, reason: str) -> None:
        """A starting worker is abandoned (``reason`` says why): it leaves the registry
        and is remembered in ``given_up`` (the last ``GIVEN_UP_KEPT``) for status."""
        self._workers.pop(worker_id, None)
        self.given_up.append(GivenUp(worker_id, role, reason, time.time()))
        del self.given_up[: -self.GIVEN_UP_KEPT]

    def drain(self, worker_id: str) -> None:
        self._workers[worker_id].state = Membership.DRAINING

    def switch_role(self, worker_id: str, role: Role, client: WorkerClient) -> WorkerRecord:
        """An elastic worker (one engine that serves either role) drained of its old
        role's work takes ``role``, called through ``client`` (the role's client of the
        same worker): STARTING again until ``activate``. Its prefix cache is the same
        engine's, so what was polled of it stays; its stats and info are the new role's
        once activated. Raises ``ValueError`` unless it is DRAINING and holds no work."""
        record = self._workers[worker_id]
        if record.state != Membership.DRAINING or record.holds_work:
            raise ValueError(
                f"worker {worker_id} switches role only drained of its work ({record.state.value})"
            )
        record.role, record.client, record.state = Role(role), client, Membership.STARTING
        record.info = record.stats = None
        record.steps = StepTimes()
        return record

    def remove(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    # ---- polling -----------------------------------------------------------------------
    async def poll(self, records: list[WorkerRecord] | None = None) -> None:
        """Ask these workers (default: every one past STARTING, since a starting worker
        is loading its model or waiting for a node and cannot answer) for their stats
        at once."""
        if records is None:
            records = [w for w in self.workers() if w.state != Membership.STARTING]
        await asyncio.gather(*(self._poll_one(w) for w in records))

    async def _poll_one(self, w: WorkerRecord) -> None:
        seen = set(w.unpolled)  # requests the answer will include
        try:
            stats = await asyncio.wait_for(w.client.stats(w.prefix.cursor), self.poll_timeout_s)
        except TimeoutError:  # no answer says nothing of it: alive stays (a restarting worker, unroutable)
            w.error = f"no answer to a poll within {self.poll_timeout_s:g} s"
            return
        except Exception as e:
            w.alive = not isinstance(e, WorkerLost)
            w.stopped = isinstance(e, WorkerStopped)
            w.error = f"{e.__class__.__name__}: {e}"
            return
        w.alive, w.stopped, w.stats, w.error = True, False, stats, ""
        w.unpolled -= seen
        if stats.prefix is not None:
            w.prefix.apply(stats.prefix)
        if isinstance(stats, DecodeStats):
            w.steps.add(stats.engine.decode_batch, stats.engine.decode_step_s)

    def unreachable(self, w: WorkerRecord, reason: str) -> None:
        """A request's start on ``w`` failed (``WorkerUnreachable``; for a prefill worker
        ``PrefillUnreachable``): out of routing at once, until a poll hears from it again."""
        w.alive, w.error = False, reason

    # ---- router load (the dispatcher) ----------------------------------------------------
    @contextlib.contextmanager
    def prefilling(self, w: WorkerRecord, request_id: str, prompt_tokens: int) -> Iterator[None]:
        """``request_id``'s prompt is with ``w`` for prefill for the duration."""
        w.prefilling[request_id] = prompt_tokens
        try:
            yield
        finally:
            w.prefilling.pop(request_id, None)

    def prefill_done(self, w: WorkerRecord, request_id: str) -> None:
        """``request_id``'s prompt has produced its first token on ``w`` (before its
        ``prefilling`` ends, e.g. on a decode worker that goes on to decode it)."""
        w.prefilling.pop(request_id, None)

    @contextlib.contextmanager
    def decoding(self, w: WorkerRecord, request_id: str, kv_tokens: int) -> Iterator[None]:
        """``request_id`` streams from ``w`` for the duration, holding up to ``kv_tokens``."""
        w.decoding[request_id] = kv_tokens
        w.unpolled.add(request_id)
        try:
            yield
        finally:
            w.decoding.pop(request_id, None)
            w.unpolled.discard(request_id)


def of_revision(workers: list[WorkerRecord], revision: str) -> list[WorkerRecord]:
    """Those of ``workers`` that serve ``revision``."""
    return [w for w in workers if w.revision == revision]
