"""Chaos under load: workers killed at random while clients stream, every answer
checked against the monolithic engine.

A disaggregated cluster (``--prefill`` workers, each a TP group of ``--tp``
ranks, and ``--decode`` workers) serves ``--clients`` concurrent clients, each
sending one greedy request after another (prompts of mixed lengths drawn from a
fixed set, some ending at a stop token), each with a server-side deadline of
``--deadline`` s. Meanwhile a killer, at exponentially distributed gaps (mean
``--gap`` s), kills with ``ray.kill`` a prefill worker, a decode worker or one
TP rank other than rank 0, and with ``--nodes N`` (the cluster then runs on N
Ray worker nodes on this machine, ``ray.cluster_utils.Cluster``) a whole node:
its raylet and every process on it, as a machine failure would, after which a
fresh node joins as Ray's autoscaler would add one. The kinds come in turn, the
victim at random among those that leave every pool a routable worker (a pool
with none left cannot serve, whatever the router does). Ray restarts what it
restarts; the pools replace what it does not (``WorkerPool.keep``).

After ``--kills`` kills (or at a kill that could not be made: the report says why,
a problem) the load stops, the pools return to their size and the KV of every
worker drains. The report then states, against the goals:

- hung requests: calls still open ``--grace`` s past their deadline (goal 0);
- wrong outputs: completed requests whose tokens differ from the engine's
  greedy output for that prompt, computed in this process (goal 0);
- completed / sent (goal at least 99 %; a request the router ends because it was
  on two lost workers, ``MAX_WORKER_LOSSES``, is counted apart: its sentence
  names them, and it must have been on each when a kill of its own took it down,
  below), and every failure's code and sentence (goal: only UNAVAILABLE or
  DEADLINE_EXCEEDED, each with a sentence, or INTERNAL for such a request: the
  router ends those);
- KV blocks still held on any worker afterwards (goal 0).

Every call carries its own client-side deadline, ``--deadline`` + ``--grace`` +
``CLIENT_MARGIN_S``: the load's bound (``_Load._bounded``: deadline + grace) sees a
hang first and prints what the router holds of the request while it still holds
it (``_router_view``): its lifecycle, whether the dispatcher still counts it in
flight, its trace if it ended (a sink the harness adds to the dispatcher keeps
every trace by request id, ``TracesById``), and the full await chain of every
task on the router's loop that works on it (``await_chain``: ``task.get_stack()``
gives only a suspended task's outermost frame). The SDK's deadline closes the call
even if that bound were missed.

A request the router ends at two losses is excused only if its trace places it on
each worker named when a kill of this run took that worker down, a different kill
for each (``killed_while_on``). Its stays come from its marks (``stays``)::

    decode worker   from the mark that sent it there (placed, redirected, resumed,
                    moved: each names the worker), to the next such mark or its
                    end (a trace without a placed mark, from its admission, named by
                    a mark its batches made there: kv_exported, decode_admitted,
                    first_decode_token, kv_recompute); one it was redirected away
                    from never ran it: no stay
    prefill worker  each prefill_sent mark's worker (prefill_started's, in a trace
                    without them), from that mark (the decode stay's start) until
                    the KV landed (decode_admitted), the prompt went to another
                    prefill worker, or the decode stay ended

A kill's time is ``time.time()`` as the kill was issued (``Kill.at``); the router's
marks are on the same clock. A killed process dies a moment after the kill is
issued, and may take a request in that moment (the worker says so: a prefill
worker answers ``PrefillAccepted``), so a process kill spans until Ray saw the
actor die (``Kill.died_by``, polled every 0.2 s): a request that came to the worker
in that span was on it when it died. A node kill stays an instant: Ray sees a
node's death only once its heartbeats are missed, seconds later, and a worker
dead but still routable meanwhile never runs what it is sent. A worker the trace
does not name cannot be shown, and the request is not excused.

::

    python -m splitserve.bench.chaos --kills 100                  # SmolLM2, 2 x TP3 prefill + 2 decode
    python -m splitserve.bench.chaos --kills 100 --nodes 3        # the same on 3 nodes; nodes killed too
    python -m splitserve.bench.chaos --model DIR --kills 10 --gap 1

``run_chaos`` is the same harness for a test, on a cluster it is given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import inspect
import itertools
import random
import re
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType

import ray

from splitserve.bench.local_nodes import LocalNodes, actor_node, local_nodes
from splitserve.client import AsyncClient, Client, Completion, SplitserveClientError
from splitserve.cluster.app import BackgroundCluster, start_local_ray
from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.pools import actor_state
from splitserve.engine.engine import Engine
from splitserve.router.trace import Mark, RequestTrace
from splitserve.wire.sampling import SamplingParams

KINDS = ("prefill", "decode", "tp_rank", "node")  # "node" only with LocalNodes; "tp_rank" with TP > 1
FAILURES_ALLOWED = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
# a request present at two kills is ended, not tried again (router.dispatch.MAX_WORKER_LOSSES);
# its sentence names the workers lost
TWO_LOSSES = "workers that were lost while they ran it"
_LOST_WORKERS = re.compile(re.escape(TWO_LOSSES) + r" \(([^)]*)\)")
CLIENT_MARGIN_S = 5.0  # a call's own deadline is this long past the load's hang bound
# marks after which the request is on the decode worker they name (router.lifecycle)
SENT_TO = ("placed", "redirected", "resumed", "moved")
# marks made from a decode worker's batches, naming it (router.trace)
MADE_ON_DECODE = ("kv_exported", "decode_admitted", "first_decode_token", "kv_recompute")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ChaosSpec:
    kills: int = 100
    gap_s: float = 3.0  # mean time between kills (exponential)
    clients: int = 8  # concurrent clients, each one request after another
    deadline_s: float = 60.0  # each request's server-side deadline
    grace_s: float = 10.0  # a call still open this long past its deadline is hung
    kinds: tuple[str, ...] = KINDS
    seed: int = 0


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it."""

    prompt: int  # index into the prompt set
    code: str  # "OK", a gRPC code name, or "HUNG"
    message: str
    tokens: tuple[int, ...]
    elapsed_s: float
    request_id: str = ""


@dataclass(frozen=True)
class Kill:
    at_s: float  # since the load began, as it was issued
    at: float  # time.time() as it was issued (the router's marks' clock)
    kind: str
    workers: tuple[str, ...]  # the workers it took down
    node: str = ""  # the node, for a node kill
    died_by: float | None = None  # a process kill: time.time() once Ray saw it dead (None: ``at``)

    @property
    def span(self) -> tuple[float, float]:
        """When the workers died: from the kill's issue until Ray saw it done."""
        return self.at, self.at if self.died_by is None else self.died_by


@dataclass(frozen=True)
class Stay:
    """The request on ``worker`` from ``start`` to ``end`` (time.time())."""

    worker: str
    start: float
    end: float


def stays(trace: RequestTrace) -> list[Stay]:
    """Where ``trace``'s request was, as its marks say (see the module docstring)."""
    runs = _decode_runs(trace.marks)
    ends = [run[0].at for run in runs[1:]] + [trace.finished]
    out = []
    for i, (run, end) in enumerate(zip(runs, ends)):
        start, last = run[0].at, i == len(runs) - 1
        worker = _decode_worker(run) or (trace.decode_worker if last else "")
        if not last and runs[i + 1][0].name == "redirected":
            continue  # its start there failed: neither that worker nor its prefill worker ran it
        if worker:
            out.append(Stay(worker, start, end))
        sent = any(m.name == "prefill_sent" for m in run)  # else an older trace: prefill_started
        for j, m in enumerate(run):
            if m.worker and m.name == ("prefill_sent" if sent else "prefill_started"):
                after = run[j + 1 :]
                left = next((n.at for n in after if n.name in ("decode_admitted", "prefill_sent")), end)
                out.append(Stay(m.worker, m.at if sent else start, left))
    return out


def _decode_runs(marks: tuple[Mark, ...]) -> list[list[Mark]]:
    """``marks`` in the order the router made them, cut before each mark that sent the
    request to another decode worker: one run per decode worker it was sent to."""
    runs: list[list[Mark]] = [[]]
    for m in marks:
        if m.name in SENT_TO:
            runs.append([])
        runs[-1].append(m)
    return runs


def _decode_worker(run: list[Mark]) -> str:
    """The decode worker of ``run``: the one its first mark sent it to, or else one its
    batches there named ("": none did)."""
    if run[0].name in SENT_TO:
        return run[0].worker
    return next((m.worker for m in run if m.name in MADE_ON_DECODE and m.worker), "")


def killed_while_on(workers: list[str], where: list[Stay], kills: list[Kill]) -> bool:
    """Whether each of ``workers`` (two or more) was taken down by a kill of its own while
    the request was on it (``where``)."""
    hits = [{i for i, k in enumerate(kills) if _while_on(w, k, where)} for w in workers]
    return len(workers) >= 2 and any(len(set(pick)) == len(pick) for pick in itertools.product(*hits))


def _while_on(worker: str, kill: Kill, where: list[Stay]) -> bool:
    """Whether ``kill`` took ``worker`` down while the request was on it."""
    issued, died_by = kill.span
    return worker in kill.workers and any(
        s.worker == worker and s.start <= died_by and issued < s.end for s in where
    )


@dataclass
class ChaosReport:
    outcomes: list[Outcome]
    kills: list[Kill]
    wrong: list[Outcome]  # completed, but not the reference's tokens
    replaced: dict[str, int]  # pool -> workers it replaced
    kv_held: dict[str, int]  # worker -> KV blocks still held after the drain
    duration_s: float
    recoveries: list[tuple[str, float]] = field(default_factory=list)  # (kind, s until its pool was whole)
    traces: dict[str, RequestTrace] = field(default_factory=dict)  # request id -> its router trace
    stopped: str = ""  # why the kills stopped before the number asked for ("": they did not)
    max_elapsed_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.max_elapsed_s = max((o.elapsed_s for o in self.outcomes), default=0.0)

    @property
    def codes(self) -> Counter:
        return Counter(o.code for o in self.outcomes)

    @property
    def ended_at_two_losses(self) -> int:
        """Requests the router ended on purpose: each was on two lost workers."""
        return sum(_ended_at_losses(o) for o in self.outcomes)

    def unexplained_two_losses(self) -> list[Outcome]:
        """Requests ended at two losses whose trace does not place them on each worker
        named when a kill of its own took it down (a loss counted where the request never
        ran, counted twice, or one no kill caused), or that have no trace."""
        return [o for o in self.outcomes if _ended_at_losses(o) and not self._excused(o)]

    def _excused(self, o: Outcome) -> bool:
        trace = self.traces.get(o.request_id)
        return trace is not None and killed_while_on(_lost_workers(o), stays(trace), self.kills)

    def _why_unexplained(self, o: Outcome) -> str:
        """What ``o``'s trace and the kills of its workers say (seconds since its admission)."""
        trace = self.traces.get(o.request_id)
        if trace is None:
            return f"request {o.request_id or '?'} has no trace"
        t0 = trace.admitted
        where = ", ".join(f"{s.worker} {s.start - t0:.2f}..{s.end - t0:.2f}" for s in stays(trace))
        killed = ", ".join(
            f"{w} at {k.at - t0:.2f}" for k in self.kills for w in _lost_workers(o) if w in k.workers
        )
        where, killed = where or "no worker it names", killed or "none of them"
        return f"request {o.request_id}, s since its admission: on {where}; killed: {killed}"

    def _marks_of(self, o: Outcome) -> str:
        """``o``'s trace as its marks (name, worker, seconds since its admission)."""
        trace = self.traces.get(o.request_id)
        if trace is None:
            return f"request {o.request_id or '?'} has no trace"
        marks = ", ".join(
            f"{m.name}{' ' + m.worker if m.worker else ''} {m.at - trace.admitted:.2f}" for m in trace.marks
        )
        return f"request {o.request_id}: {marks}"

    @property
    def completed(self) -> float:
        """Of the requests the router tried to complete (not those it ended at two losses)."""
        return self.codes["OK"] / max(1, len(self.outcomes) - self.ended_at_two_losses)

    def problems(self) -> list[str]:
        """Each goal this run missed, as a sentence (empty: every goal met)."""
        out = [f"the kills stopped after {len(self.kills)}: {self.stopped}"] if self.stopped else []
        if self.codes["HUNG"]:
            out.append(f"{self.codes['HUNG']} request(s) hung past their deadline")
        if self.wrong:
            out.append(f"{len(self.wrong)} completed request(s) differ from the reference")
        if self.completed < 0.99:
            out.append(f"only {self.completed:.1%} of requests completed (goal 99 %)")
        if unexplained := self.unexplained_two_losses():
            each = " | ".join(f"{e.message}; {self._why_unexplained(e)}" for e in unexplained)
            out.append(
                f"{len(unexplained)} request(s) ended at two losses, not on each worker named when a kill "
                f"took it down: {each}"
            )
        bad = [
            o
            for o in self.outcomes
            if o.code not in ("OK", "HUNG")
            and (o.code not in FAILURES_ALLOWED or not o.message)
            and not _ended_at_losses(o)
        ]
        if bad:
            each = " | ".join(f"{e.code}: {e.message}; {self._marks_of(e)}" for e in bad[:5])
            out.append(f"{len(bad)} failure(s) of another code or without a sentence: {each}")
        if any(self.kv_held.values()):
            out.append(f"KV still held afterwards: {self.kv_held}")
        return out

    def summary(self) -> str:
        kinds = Counter(k.kind for k in self.kills)
        failed = Counter((o.code, o.message) for o in self.outcomes if o.code != "OK")
        by_kind = ", ".join(f"{k} {n}" for k, n in kinds.items())
        unexcused = len(self.unexplained_two_losses())
        lines = [
            f"{len(self.kills)} kills in {self.duration_s:.0f} s ({by_kind}); "
            f"workers replaced by the pools: {self.replaced}",
            f"{len(self.outcomes)} requests: {self.codes['OK']} completed ({self.completed:.2%}), "
            f"{len(self.wrong)} wrong, {self.codes['HUNG']} hung, {self.ended_at_two_losses} ended at two "
            f"worker losses ({unexcused} not on each at its kill); longest call {self.max_elapsed_s:.1f} s",
            *(f"  {n} x {code}: {message}" for (code, message), n in failed.most_common()),
            f"KV held afterwards: {sum(self.kv_held.values())} blocks",
            *(
                f"  a pool whole again after a {kind} kill: median {statistics.median(ts):.1f} s, "
                f"max {max(ts):.1f} s ({len(ts)} kills)"
                for kind in KINDS
                if (ts := [t for k, t in self.recoveries if k == kind])
            ),
            "  calls by latency (s): "
            + ", ".join(f"p{q} {_pct([o.elapsed_s for o in self.outcomes], q):.2f}" for q in (50, 99)),
        ]
        return "\n".join(lines)


def _ended_at_losses(o: Outcome) -> bool:
    return o.code == "INTERNAL" and TWO_LOSSES in o.message


def _lost_workers(o: Outcome) -> list[str]:
    """The workers the router names in ``o``'s sentence as lost while they ran it."""
    m = _LOST_WORKERS.search(o.message)
    return [w.strip() for w in m.group(1).split(",")] if m else []


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else float("nan")


class _Load:
    """``clients`` coroutines on a loop of their own (a thread), each sending one request
    after another until stopped; every call is timed and bounded by its deadline + grace
    here, and by its own client-side deadline ``CLIENT_MARGIN_S`` later."""

    def __init__(self, address: str, prompts, params, spec: ChaosSpec, on_hang=None):
        """``on_hang(request_id)``: called (from the load's thread) when a call is found
        hung, before it is cancelled: what it returns is logged (the router's view of it)."""
        self.outcomes: list[Outcome] = []
        self._on_hang = on_hang
        self._args = (address, prompts, params, spec)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="chaos-load")
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("the load did not stop: a client is stuck")

    async def _run(self) -> None:
        address, prompts, params, spec = self._args
        async with AsyncClient(address) as client:
            await client.list_models()
            await asyncio.gather(*(self._client(client, i) for i in range(spec.clients)))

    async def _client(self, client: AsyncClient, index: int) -> None:
        address, prompts, params, spec = self._args
        rng = random.Random(spec.seed * 1000 + index)
        while not self._stop.is_set():
            i = rng.randrange(len(prompts))
            p: SamplingParams = params[i]
            start = time.monotonic()
            out = Completion()
            request_id = uuid.uuid4().hex
            try:
                call = client.generate(
                    prompts[i],
                    request_id=request_id,
                    temperature=p.temperature,
                    max_tokens=p.max_tokens,
                    stop_token_ids=list(p.stop_token_ids),
                    timeout_ms=int(spec.deadline_s * 1000),
                    timeout=spec.deadline_s + spec.grace_s + CLIENT_MARGIN_S,  # after _bounded's
                )
                out = await self._bounded(asyncio.ensure_future(call), request_id)
                code, message = "OK", ""
            except TimeoutError:
                code, message = "HUNG", f"request {request_id}: no end {spec.grace_s:g} s past the deadline"
            except SplitserveClientError as e:
                code, message = e.code.name, e.details
            elapsed = time.monotonic() - start
            self.outcomes.append(Outcome(i, code, message, tuple(out.token_ids), elapsed, request_id))

    async def _bounded(self, call: asyncio.Future, request_id: str):
        """``call``'s result, or TimeoutError past the deadline + grace (what the router
        holds of it is logged first, while it still does)."""
        spec = self._args[3]
        await asyncio.wait([call], timeout=spec.deadline_s + spec.grace_s)
        if call.done():
            return call.result()
        if self._on_hang is not None:
            try:
                log(f"request {request_id} hung; the router holds:\n{self._on_hang(request_id)}")
            except Exception as e:
                log(f"request {request_id} hung; reading the router failed: {e!r}")
        call.cancel()
        await asyncio.wait([call])
        raise TimeoutError


def _roles(kind: str) -> tuple[str, ...]:
    """The pools a kind of kill hits."""
    return {"decode": ("decode",), "node": ("prefill", "decode")}.get(kind, ("prefill",))


@dataclass(frozen=True)
class Victim:
    """What one kill takes down: workers, the actors of theirs it kills (ranks included),
    and for a node kill, the node."""

    kind: str
    worker_ids: tuple[str, ...]
    actors: tuple
    node_id: str = ""

    @property
    def name(self) -> str:
        workers = ", ".join(self.worker_ids)
        return f"node {self.node_id[:8]} ({workers})" if self.node_id else workers


def _victim(cluster: BackgroundCluster, kind: str, rng: random.Random, nodes: LocalNodes | None):
    """A victim of ``kind`` that leaves every pool at least one routable worker; None if
    there is none now."""

    async def members():  # routable workers of each pool, with their actors
        return {
            role: {w.worker_id: pool.actors(w.worker_id) for w in cluster.registry.routable(role)}
            for role, pool in cluster.cluster.pools.items()
        }

    routable = cluster.run(members(), timeout=60)
    if kind == "node":
        on: dict[str, dict[str, set[str]]] = {}  # node -> role -> its workers there
        for role, workers in routable.items():
            for worker_id, actors in workers.items():
                for node_id in {actor_node(a) for a in actors}:
                    on.setdefault(node_id, {}).setdefault(role, set()).add(worker_id)
        candidates = [
            n
            for n in nodes.ids()
            if n in on and all(len(ws) - len(on[n].get(r, ())) >= 1 for r, ws in routable.items())
        ]
        if not candidates:
            return None
        node_id = rng.choice(candidates)
        ids = sorted(w for ws in on[node_id].values() for w in ws)
        actors = tuple(a for ws in routable.values() for w, acts in ws.items() if w in ids for a in acts)
        return Victim(kind, tuple(ids), actors, node_id)
    (role,) = _roles(kind)
    workers = routable[role]
    if len(workers) < 2:
        return None
    worker_id = rng.choice(sorted(workers))
    actors = workers[worker_id]
    if kind == "tp_rank":
        return Victim(kind, (worker_id,), (rng.choice(actors[1:]),)) if len(actors) > 1 else None
    return Victim(kind, (worker_id,), (actors[0],))


def _pick(cluster: BackgroundCluster, kind: str, rng: random.Random, timeout: float, nodes=None) -> Victim:
    """A victim of ``kind`` (``_victim``); while there is none (a pool has no second
    routable worker to serve on), waits for one, up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while (victim := _victim(cluster, kind, rng, nodes)) is None:
        if time.monotonic() > deadline:
            pools = cluster.run(_pools_view(cluster), timeout=60)
            raise TimeoutError(f"no {kind} to kill: the pools did not recover within {timeout:g} s ({pools})")
        time.sleep(0.2)
    return victim


async def _pools_view(cluster: BackgroundCluster) -> str:
    """Each pool's workers as the registry has them: state, alive, and the last poll's error."""

    def worker(w) -> str:
        return f"{w.worker_id} {w.state.value}{'' if w.alive else ' dead'} {w.error}".strip()

    pools = cluster.cluster.pools
    return "; ".join(f"{r}: {', '.join(map(worker, cluster.registry.workers(r)))}" for r in pools)


def _settled(cluster: BackgroundCluster, roles: tuple[str, ...] = ("prefill", "decode")) -> bool:
    """These pools are back to their size with every worker routable and every actor of
    theirs ALIVE in Ray (none restarting, none dead and not yet replaced)."""

    async def members():
        pools = [(r, cluster.cluster.pools[r]) for r in roles]
        workers = [w for r, _ in pools for w in cluster.registry.workers(r)]
        full = all(len(cluster.registry.routable(r)) >= p.spec.replicas for r, p in pools)
        return full and all(w.routable for w in workers), [
            h for r, p in pools for w in cluster.registry.workers(r) for h in p.actors(w.worker_id)
        ]

    full, handles = cluster.run(members(), timeout=60)
    return full and all(actor_state(h).state == "ALIVE" for h in handles)


def _time_recovery(cluster: BackgroundCluster, kind: str, since: float, out: list, timeout: float) -> None:
    """Append (kind, seconds from ``since`` until the victim's pool was whole again);
    nothing if it was not within ``timeout``."""
    try:
        _wait(lambda: _settled(cluster, _roles(kind)), "", timeout)
    except TimeoutError:
        return
    out.append((kind, time.monotonic() - since))


def _kill(cluster: BackgroundCluster, victim: Victim, nodes: LocalNodes | None) -> tuple[float, float]:
    """Kill ``victim`` as a crash would (Ray restarts what it may). Returns the
    ``time.time()`` the kill was issued and the one Ray had seen its actors die by,
    once Ray has seen that and the router no
    longer counts its workers as routable, or they have come back (restarted): so the
    next pick, which spares a pool's last routable worker, sees the pools as they are.
    (The 100-kill run before this wait killed a TP group whose rank had just died,
    still routable for a moment, and its sibling: both down.)"""
    before = {a: actor_state(a) for a in victim.actors}
    at = time.time()
    if victim.node_id:
        nodes.replace(victim.node_id)
    else:
        ray.kill(victim.actors[0], no_restart=False)

    def died() -> bool:
        return all(actor_state(a) != before[a] for a in victim.actors)

    _wait(died, f"Ray did not see {victim.name} die", 180)  # a node's death: missed heartbeats
    died_by = time.time()

    async def routable() -> set[str]:
        return {w.worker_id for w in cluster.registry.routable()}

    def back(a) -> bool:
        now = actor_state(a)
        return now.state == "ALIVE" and now.restarts > before[a].restarts

    def noticed() -> bool:
        gone = not set(victim.worker_ids) & cluster.run(routable(), timeout=60)
        return gone or all(map(back, victim.actors))

    _wait(noticed, f"the router did not notice {victim.name}'s death", 180)
    return at, died_by


def _wait(cond, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:g} s")
        time.sleep(0.2)


def kv_held(address: str) -> dict[str, int]:
    """KV blocks each worker holds (used blocks + exports awaiting a pull), from the status service."""
    with Client(address, timeout=60) as c:
        st = c.cluster_status()
    return {w.worker_id: w.kv_blocks_used + w.kv_exports_held for p in st.pools for w in p.workers}


def run_chaos(
    cluster: BackgroundCluster,
    prompts: list[list[int]],
    params: list[SamplingParams],
    reference: list[list[int]],
    spec: ChaosSpec,
    recover_timeout_s: float = 600.0,
    nodes: LocalNodes | None = None,
) -> ChaosReport:
    """Load ``cluster`` and kill its workers (and with ``nodes``, the nodes it runs on) as
    ``spec`` says; ``reference[i]`` is the expected greedy output of ``prompts[i]``.
    Returns when the load has stopped, the pools are back to their size and the KV has
    drained (or the wait for that timed out: then ``kv_held`` says what stayed)."""
    rng = random.Random(spec.seed)
    tp = cluster.cluster.config.prefill.tp_size
    kinds = [k for k in spec.kinds if (k != "tp_rank" or tp > 1) and (k != "node" or nodes is not None)]
    start = time.monotonic()
    with _keeping_traces(cluster) as traces:
        load = _Load(cluster.address, prompts, params, spec, functools.partial(_router_view, cluster, traces))
        kills: list[Kill] = []
        recoveries: list[tuple[str, float]] = []  # (kind, s until its pool was whole again)
        timers: list[threading.Thread] = []
        stopped = ""  # why the kills stopped before spec.kills
        try:
            for kind in itertools.islice(itertools.cycle(kinds), spec.kills):
                time.sleep(rng.expovariate(1 / spec.gap_s))
                try:
                    victim = _pick(cluster, kind, rng, recover_timeout_s, nodes)
                    killed_at = time.monotonic()
                    at, died_by = _kill(cluster, victim, nodes)
                except Exception as e:  # the kills stop; the report says why, and what the load saw
                    stopped = f"kill {len(kills) + 1} ({kind}) failed: {e!r}"
                    log(f"[{time.monotonic() - start:6.1f} s] {stopped}")
                    break
                args = (cluster, kind, killed_at, recoveries, recover_timeout_s)
                timers.append(threading.Thread(target=_time_recovery, args=args, daemon=True))
                timers[-1].start()
                died = None if victim.node_id else died_by  # see the module docstring
                kills.append(Kill(killed_at - start, at, kind, victim.worker_ids, victim.node_id, died))
                log(f"[{kills[-1].at_s:6.1f} s] killed {kind}: {victim.name} ({len(kills)}/{spec.kills})")
        finally:
            load.stop(timeout=spec.deadline_s + 2 * spec.grace_s)
        duration = time.monotonic() - start
        try:
            _wait(lambda: _settled(cluster), "the pools did not return to their size", recover_timeout_s)
            _wait(lambda: not any(kv_held(cluster.address).values()), "the KV did not drain", 120)
        except TimeoutError as e:
            log(str(e))
        for t in timers:
            t.join(recover_timeout_s)
    outcomes = load.outcomes
    wrong = [o for o in outcomes if o.code == "OK" and list(o.tokens) != reference[o.prompt]]
    replaced = {role: pool.replaced for role, pool in cluster.cluster.pools.items()}
    held = kv_held(cluster.address)
    return ChaosReport(outcomes, kills, wrong, replaced, held, duration, recoveries, traces.by_id, stopped)


@contextlib.contextmanager
def _keeping_traces(cluster: BackgroundCluster) -> Iterator[TracesById]:
    """A ``TracesById`` among the dispatcher's sinks for the duration."""
    traces = TracesById()

    async def add() -> None:
        cluster.dispatcher.sinks.append(traces)

    async def remove() -> None:
        cluster.dispatcher.sinks.remove(traces)

    cluster.run(add(), timeout=60)
    try:
        yield traces
    finally:
        cluster.run(remove(), timeout=60)


class TracesById:
    """A ``TraceSink`` that keeps every request's trace by its id, the last one for an id
    sent again (the router's ``TraceLog`` keeps only the latest 100)."""

    def __init__(self):
        self.by_id: dict[str, RequestTrace] = {}

    def record(self, trace: RequestTrace) -> None:
        self.by_id[trace.request_id] = trace


def _router_view(cluster: BackgroundCluster, traces: TracesById, request_id: str) -> str:
    """What the router holds of ``request_id``: its lifecycle, whether the dispatcher counts
    it in flight, its trace if it ended there, and the await chain of every task on the
    router's loop that works on it (where a hung request waits)."""

    async def read() -> str:
        life = cluster.dispatcher.moves.lives.get(request_id)
        trace = traces.by_id.get(request_id)
        ended = f"{_marks(trace)}; ended {trace.outcome}" if trace else "none (not ended on the router)"
        lines = [
            f"lifecycle: {life.phase.value if life else None}, on "
            f"{life.decode_worker.worker_id if life and life.decode_worker else None}",
            f"in flight (the dispatcher's _inflight): {request_id in cluster.dispatcher._inflight}",
            f"trace: {ended}",
        ]
        if life is not None:
            lines.append(f"marks so far: {_marks(life.trace('-', False))}")
        for task in asyncio.all_tasks():
            chain = await_chain(task)
            if task is not asyncio.current_task() and any(_mentions(f, request_id) for f in chain):
                lines.append(f"task {task.get_name()}, outermost first:")
                lines.extend(f"  {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_qualname}" for f in chain)
        return "\n".join(lines)

    return cluster.run(read(), timeout=30)


def _marks(trace: RequestTrace) -> str:
    t0 = trace.admitted
    return ", ".join(f"{m.name}{'@' + m.worker if m.worker else ''} {m.at - t0:+.2f}" for m in trace.marks)


def await_chain(task: asyncio.Task) -> list[FrameType]:
    """The frames ``task`` is suspended in, outermost first: its coroutine's, then those of
    what each awaits, down to the innermost (``task.get_stack()`` gives only the first)."""
    frames = (_frame(link) for link in _awaits(task.get_coro()))
    return [f for f in frames if f is not None]


def _awaits(obj) -> Iterator[object]:
    """``obj``, what it awaits, what that awaits, and so on, until a future or something
    awaiting nothing."""
    seen: set[int] = set()
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        yield obj
        obj = _awaited(obj)


def _awaited(obj) -> object | None:
    """What ``obj`` awaits: a coroutine's, async generator's or generator's own field (an
    awaited task: its coroutine). A wrapper (``async_generator_asend``, ``anext``'s
    awaitable, a future's iterator) is opaque, but what it drives is among its referents."""
    if isinstance(obj, asyncio.Task):
        return obj.get_coro()
    if isinstance(obj, asyncio.Future):
        return None
    for name in ("cr_await", "ag_await", "gi_yieldfrom"):
        if hasattr(obj, name):
            return getattr(obj, name)
    return next((r for r in gc.get_referents(obj) if _awaitable(r)), None)


def _awaitable(obj) -> bool:
    return inspect.isawaitable(obj) or inspect.isasyncgen(obj) or inspect.isgenerator(obj)


def _frame(link) -> FrameType | None:
    """The frame of a coroutine, async generator or generator (None: another link, or ended)."""
    for name in ("cr_frame", "ag_frame", "gi_frame"):
        if (frame := getattr(link, name, None)) is not None:
            return frame
    return None


def _mentions(frame, request_id: str) -> bool:
    """Whether ``frame`` works on ``request_id`` (a local names it, or its lifecycle)."""
    for value in frame.f_locals.values():
        named = value if isinstance(value, str) else getattr(value, "request_id", None)
        if named == request_id:
            return True
    return False


def mixed_prompts(
    n: int, vocab: int, seed: int, max_len: int
) -> tuple[list[list[int]], list[SamplingParams]]:
    """``n`` prompts of 3..``max_len`` tokens with 1..48 output tokens; every fourth may end
    at a stop token. Token ids avoid the lowest 100 (special tokens of real vocabularies)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(3, max_len))] for _ in range(n)]
    params = []
    for i in range(n):
        stop = tuple(rng.sample(range(100, vocab), 2)) if i % 4 == 0 else ()
        params.append(SamplingParams(max_tokens=rng.randint(1, 48), stop_token_ids=stop))
    return prompts, params


def chaos_config(model: str, prefill: int, decode: int, tp: int, dtype: str = "float32") -> ClusterConfig:
    """A disaggregated cluster that sends every prompt to a prefill worker (each request
    crosses the KV handover), with small pools that share the machine's cores."""
    engine = {"kv_cache_memory_mib": 64, "max_num_batched_tokens": 512}
    pool = {"num_cpus": 0.25, "torch_threads": 1, "engine": engine}
    return ClusterConfig.model_validate(
        {
            "mode": "disaggregated",
            "model": {"name": model, "dtype": dtype},
            "policy": {"conditional_disaggregation": False},
            "transfer": {"verify_meaning": 1.0},  # every handoff checked by meaning too
            "prefill": {"replicas": prefill, "tp_size": tp, **pool},
            "decode": {"replicas": decode, **pool},
            "router": {"port": 0, "http_port": None, "shutdown_grace_s": 1},
            "limits": {"max_inflight_requests": 256},
        }
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--gap", type=float, default=3.0, help="mean seconds between kills")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=48, help="distinct prompts, each with its reference")
    ap.add_argument("--max-prompt-len", type=int, default=300)
    ap.add_argument("--deadline", type=float, default=60.0, help="each request's deadline, s")
    ap.add_argument("--grace", type=float, default=10.0)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--tp", type=int, default=3, help="ranks per prefill worker (SmolLM2: 3)")
    ap.add_argument("--dtype", default="float32", help="float32 keeps greedy ties out of the comparison")
    ap.add_argument("--nodes", type=int, default=0, help="run on this many Ray nodes, and kill nodes too")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    config = chaos_config(args.model, args.prefill, args.decode, args.tp, args.dtype)
    nodes = None
    if args.nodes:
        nodes, config = local_nodes(args.nodes, config)
        ray.init(address=nodes.cluster.address, log_to_driver=False)
    else:
        start_local_ray(log_to_driver=False)  # its own, whatever runs
    try:
        with BackgroundCluster(config) as cluster:
            with Client(cluster.address, timeout=60) as c:
                vocab = c.list_models()[0].vocab_size
            prompts, params = mixed_prompts(args.prompts, vocab, args.seed, args.max_prompt_len)
            log(f"reference: {len(prompts)} prompts through the monolithic engine ...")
            engine = Engine(config.engine_config("decode"))
            reference = [c.token_ids for c in engine.generate(prompts, params)]
            del engine
            spec = ChaosSpec(args.kills, args.gap, args.clients, args.deadline, args.grace, seed=args.seed)
            report = run_chaos(cluster, prompts, params, reference, spec, nodes=nodes)
    finally:
        ray.shutdown()
        if nodes is not None:
            nodes.cluster.shutdown()
    print(report.summary())
    problems = report.problems()
    print("every goal met" if not problems else "NOT MET: " + "; ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
