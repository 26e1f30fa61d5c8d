"""A discrete-event model of a disaggregated cluster, for sizing and for trying
autoscaling policies at scales this machine cannot run: requests arrive, queue
at prefill workers (FIFO, a token budget per step), hand their KV to a decode
worker (continuous batching, one token per running sequence per step), and
finish; workers start after a warm-up and leave by draining; workers that
share a machine's cores slow each other (``SimProfile``'s slowdowns). Traces
come from ``cluster.sim_trace``. The policies are the cluster's own code:
``slo`` runs ``Planner.decide`` on the same ``PlannerInput`` the live
``PlannerLoop`` builds, ``proportional`` runs
``ScaleDecision`` on the same load figures ``Autoscaler`` reads, ``fixed``
never moves. ``elastic`` is ``slo`` over a fixed set of workers whose roles it
splits (``mode: elastic``): a switch takes the least loaded worker of the role the
planner shrinks, drains it (a decode worker's sequences move to the other decode
workers, as live migration moves them; a prefill worker finishes its queue), and
gives it the other role ``SimProfile.switch_s`` later. While no prefill worker is
routable, each decode worker prefills the prompts routed to it in its own steps
(a step then takes the prompts' prefill time on top of its decode step).

Time is simulated (no sleeping, no threads): a 10-minute trace on 64 workers
runs in seconds. What it does not model: prefix-cache hits, chunked prompts
longer than a step's token budget (a prompt is prefilled in one step), KV
capacity limits other than ``max_batch``, network contention between
transfers, failures.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from splitserve.cluster.autoscale import ScaleDecision
from splitserve.cluster.config import AutoscalingSpec
from splitserve.cluster.planner import (
    Planner,
    PlannerDecision,
    PlannerInput,
    PlannerSpec,
    PoolView,
    percentile,
    role_switch,
)
from splitserve.cluster.sim_records import PoolLimits, SimOutcome, SimProfile, SimResult
from splitserve.cluster.sim_trace import SimRequest
from splitserve.router.roles import Role

__all__ = ["PoolLimits", "SimOutcome", "SimProfile", "SimResult", "Simulation"]


@dataclass
class _Worker:
    pool: str
    started_s: float
    ready_s: float
    draining: bool = False
    gone_s: float | None = None
    busy: bool = False
    queue: deque = field(default_factory=deque)  # prefill: waiting requests
    queued_tokens: int = 0  # prefill: their prompt tokens
    running: list = field(default_factory=list)  # decode: the batch
    pending: list = field(default_factory=list)  # decode: KV landed, joins the next step
    local: deque = field(default_factory=deque)  # decode: prompts it prefills itself
    switch_to: str | None = None  # elastic: the role it takes once drained
    role_since_s: float = -1.0  # elastic: when it took its present role (its start until a switch)

    def __post_init__(self) -> None:
        if self.role_since_s < 0:
            self.role_since_s = self.started_s

    def routable(self, now: float) -> bool:
        return self.gone_s is None and not self.draining and self.ready_s <= now

    def load(self) -> int:
        if self.pool == Role.PREFILL:
            return self.queued_tokens
        return len(self.running) + len(self.pending) + len(self.local)

    def idle(self) -> bool:
        return not (self.busy or self.queue or self.running or self.pending or self.local)


class Simulation:
    """One run: ``Simulation(profile, trace, ...).run()``. ``policy`` is ``fixed``,
    ``proportional`` (with ``proportional`` specs per pool) or ``slo`` (with ``planner``)."""

    def __init__(
        self,
        profile: SimProfile,
        trace: list[SimRequest],
        prefill: PoolLimits,
        decode: PoolLimits,
        policy: str = "fixed",
        planner: PlannerSpec | None = None,
        proportional: dict[str, AutoscalingSpec] | None = None,
    ):
        if policy not in ("fixed", "proportional", "slo", "elastic"):
            raise ValueError(f"policy must be fixed, proportional, slo or elastic, got {policy!r}")
        if policy in ("slo", "elastic") and planner is None:
            raise ValueError(f"policy {policy} needs a planner spec")
        if policy == "proportional" and not proportional:
            raise ValueError("policy proportional needs an AutoscalingSpec per pool")
        self.profile, self.policy = profile, policy
        self.limits = {Role.PREFILL: prefill, Role.DECODE: decode}
        self.reqs = [SimOutcome(r) for r in sorted(trace, key=lambda r: r.arrival_s)]
        self._unfinished = len(self.reqs)
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.workers: dict[str, list[_Worker]] = {Role.PREFILL: [], Role.DECODE: []}
        self._waiting: deque = deque()  # arrived while no prefill worker was routable
        self._busy = {Role.PREFILL: 0, Role.DECODE: 0}  # workers in a step, per pool
        self.moves: dict[str, list[tuple[float, int]]] = {Role.PREFILL: [], Role.DECODE: []}
        self.timeline: list[tuple[float, int, int]] = []
        self.planner = Planner(planner) if policy in ("slo", "elastic") else None
        self._role_seconds = {Role.PREFILL: 0.0, Role.DECODE: 0.0}  # elastic: credited at switches
        if planner is not None:
            self.interval_s = planner.interval_s
        else:
            self.interval_s = min((s.interval_s for s in (proportional or {}).values()), default=5.0)
        self._scalers = (
            {p: ScaleDecision(s, clock=lambda: self.now) for p, s in proportional.items()}
            if policy == "proportional"
            else {}
        )
        self._proportional = proportional or {}
        self._window: list[SimOutcome] = []  # finished in the current interval
        self._arrivals = 0
        self._points: list[tuple[float, float]] = []
        for pool, lim in self.limits.items():
            for _ in range(lim.start):
                self.workers[pool].append(_Worker(pool, 0.0, 0.0))

    # ---- the event loop ------------------------------------------------------------
    def _at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self) -> SimResult:
        for r in self.reqs:
            self._at(r.spec.arrival_s, self._arrive, r)
        if self.policy != "fixed":
            self._at(self.interval_s, self._tick)
        while self._events and self._unfinished:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        end = self.now
        seconds = {
            pool: sum((w.gone_s if w.gone_s is not None else end) - w.role_since_s for w in ws)
            + self._role_seconds[pool]
            for pool, ws in self.workers.items()
        }
        return SimResult(self.reqs, seconds, self.moves, self.timeline, end)

    # ---- prefill ---------------------------------------------------------------------
    def _arrive(self, r: SimOutcome) -> None:
        self._arrivals += 1
        self._route_prefill(r)

    def _route_prefill(self, r: SimOutcome) -> None:
        live = [w for w in self.workers[Role.PREFILL] if w.routable(self.now)]
        if not live:
            if self.policy == "elastic":
                self._prefill_locally(r)
            else:
                self._waiting.append(r)
            return
        w = min(live, key=_Worker.load)
        w.queue.append(r)
        w.queued_tokens += r.spec.prompt_tokens
        if not w.busy:
            self._prefill_step(w)

    def _prefill_step(self, w: _Worker) -> None:
        batch, tokens = [], 0
        while w.queue and (
            not batch or tokens + w.queue[0].spec.prompt_tokens <= self.profile.max_batched_tokens
        ):
            r = w.queue.popleft()
            batch.append(r)
            tokens += r.spec.prompt_tokens
        w.queued_tokens -= tokens
        if not self._set_busy(w, bool(batch)):
            self._maybe_gone(w)
            return
        p = self.profile
        step = (p.prefill_step_s + tokens / p.prefill_tokens_per_s) * self._slowdown(
            Role.DECODE, p.prefill_slowdown
        )
        self._at(self.now + step, self._prefill_done, w, batch)

    def _prefill_done(self, w: _Worker, batch: list[SimOutcome]) -> None:
        p = self.profile
        for r in batch:
            r.first_token_s = self.now
            r.generated = 1
            if r.spec.output_tokens <= 1:
                self._finish(r)
            else:
                self._at(
                    self.now + p.transfer_s + p.transfer_s_per_token * r.spec.prompt_tokens, self._handover, r
                )
        self._prefill_step(w)

    # ---- decode ----------------------------------------------------------------------
    def _handover(self, r: SimOutcome) -> None:
        live = [w for w in self.workers[Role.DECODE] if w.routable(self.now)]
        if not live:  # none routable (all warming or draining): try again shortly
            self._at(self.now + 0.05, self._handover, r)
            return
        w = min(live, key=_Worker.load)
        w.pending.append(r)
        if not w.busy:
            self._decode_step(w)

    def _prefill_locally(self, r: SimOutcome) -> None:
        live = [w for w in self.workers[Role.DECODE] if w.routable(self.now)]
        if not live:  # none routable (a switch under way): try again shortly
            self._at(self.now + 0.05, self._route_prefill, r)
            return
        w = min(live, key=_Worker.load)
        r.local = True
        w.local.append(r)
        if not w.busy:
            self._decode_step(w)

    def _decode_step(self, w: _Worker) -> None:
        p = self.profile
        room = p.max_batch - len(w.running)
        w.running.extend(w.pending[:room])
        del w.pending[:room]
        prompts, tokens = [], 0  # its own prompts, prefilled in this step
        while w.local and (not prompts or tokens + w.local[0].spec.prompt_tokens <= p.max_batched_tokens):
            prompts.append(w.local.popleft())
            tokens += prompts[-1].spec.prompt_tokens
        if not self._set_busy(w, bool(w.running or prompts)):
            self._maybe_gone(w)
            return
        a, b = p.decode_step_s
        step = a + b * len(w.running) if w.running else 0.0
        if prompts:
            step += p.prefill_step_s + tokens / p.prefill_tokens_per_s
        elif w.running:
            self._points.append((len(w.running), step))
        step *= self._slowdown(Role.PREFILL, p.decode_slowdown)
        self._at(self.now + step, self._decode_done, w, prompts)

    def _decode_done(self, w: _Worker, prompts: list[SimOutcome]) -> None:
        for r in prompts:
            r.first_token_s, r.generated = self.now, 1
            if r.spec.output_tokens <= 1:
                self._finish(r)
            else:
                w.pending.append(r)
        still = []
        for r in w.running:
            r.generated += 1
            if r.generated >= r.spec.output_tokens:
                self._finish(r)
            else:
                still.append(r)
        w.running = still
        self._decode_step(w)

    def _set_busy(self, w: _Worker, busy: bool) -> bool:
        self._busy[w.pool] += busy - w.busy
        w.busy = busy
        return busy

    def _slowdown(self, other: str, slowdown: float) -> float:
        """1 + ``slowdown`` x the busy share of pool ``other`` (workers sharing cores)."""
        if not slowdown:
            return 1.0
        alive = sum(1 for w in self.workers[other] if w.gone_s is None)
        return 1.0 + slowdown * self._busy[other] / max(alive, 1)

    def _finish(self, r: SimOutcome) -> None:
        r.finished_s = self.now
        self._unfinished -= 1
        self._window.append(r)

    # ---- scaling ---------------------------------------------------------------------
    def _maybe_gone(self, w: _Worker) -> None:
        if not (w.draining and w.idle() and w.gone_s is None):
            return
        if w.switch_to is None:
            w.gone_s = self.now
        elif not w.busy:
            w.busy = True  # held while it switches (no step starts on it)
            self._at(self.now + self.profile.switch_s, self._switched, w)

    def _view(self, pool: str) -> PoolView:
        ws = [w for w in self.workers[pool] if w.gone_s is None and not w.draining]
        lim = self.limits[pool]
        current = sum(1 for w in ws if w.ready_s <= self.now)
        return PoolView(
            current, len(ws) - current, lim.min_replicas, lim.max_replicas, self.profile.max_batch
        )

    def _tick(self) -> None:
        views = {pool: self._view(pool) for pool in self.workers}
        if self.policy == "elastic":
            self._split(self._decide(views))
        else:
            if self.policy == "slo":
                d = self._decide(views)
                targets = {Role.PREFILL: d.prefill.target, Role.DECODE: d.decode.target}
            else:
                targets = self._proportional_targets(views)
            for pool, target in targets.items():
                self._scale_to(pool, views[pool], target)
        self.timeline.append((self.now, self._view(Role.PREFILL).current, self._view(Role.DECODE).current))
        self._window, self._arrivals, self._points = [], 0, []
        self._at(self.now + self.interval_s, self._tick)

    def _decide(self, views: dict[str, PoolView]) -> PlannerDecision:
        done = self._window
        inp = PlannerInput(
            now=self.now,
            interval_s=self.interval_s,
            arrivals=self._arrivals,
            finished=len(done),
            prompt_tokens=sum(r.spec.prompt_tokens for r in done if not r.local),
            local_prompt_tokens=sum(r.spec.prompt_tokens for r in done if r.local),
            output_tokens=sum(r.spec.output_tokens for r in done),
            context_tokens=sum(r.spec.prompt_tokens for r in done),
            ttft_p90_s=percentile([r.ttft_s for r in done], 90),
            tpot_p90_s=percentile([r.tpot_s for r in done if r.tpot_s is not None], 90),
            prefill_tokens_per_s=self.profile.prefill_tokens_per_s,  # what a worker measures of itself
            decode_points=tuple(self._points[-64:]),
            prefill=views[Role.PREFILL],
            decode=views[Role.DECODE],
            queued_prompt_tokens=sum(w.queued_tokens for w in self.workers[Role.PREFILL])
            + sum(r.spec.prompt_tokens for r in self._waiting),
            queued_requests=sum(len(w.queue) for w in self.workers[Role.PREFILL]) + len(self._waiting),
            elastic_workers=sum(len(ws) for ws in self.workers.values()) if self.policy == "elastic" else 0,
        )
        return self.planner.decide(inp)

    def _split(self, decision: PlannerDecision) -> None:
        """Elastic: ``planner.role_switch``, as ``PlannerLoop._split`` runs it (one switch
        at a time)."""
        if any(w.switch_to for ws in self.workers.values() for w in ws):
            return
        live = {pool: [w for w in ws if w.routable(self.now)] for pool, ws in self.workers.items()}
        floors = {pool: lim.min_replicas for pool, lim in self.limits.items()}
        switch = role_switch(decision, {pool: len(ws) for pool, ws in live.items()}, floors)
        if switch is None:
            return
        giver, taker = switch
        w = min(live[giver], key=_Worker.load)
        self.moves[giver].append((self.now, -1))
        self.moves[taker].append((self.now, 1))
        w.draining, w.switch_to = True, taker
        if giver == Role.DECODE:  # its sequences move off; its own prompts go elsewhere
            moved, w.running, w.pending = w.running + w.pending, [], []
            waiting, w.local = list(w.local), deque()
            for r in moved:
                self._handover(r)
            for r in waiting:
                self._route_prefill(r)
        self._maybe_gone(w)

    def _switched(self, w: _Worker) -> None:
        self._role_seconds[w.pool] += self.now - w.role_since_s
        self.workers[w.pool].remove(w)
        w.pool, w.switch_to, w.draining, w.busy, w.role_since_s = w.switch_to, None, False, False, self.now
        self.workers[w.pool].append(w)

    def _proportional_targets(self, views: dict[str, PoolView]) -> dict[str, int]:
        targets = {}
        for pool, view in views.items():
            live = [w for w in self.workers[pool] if w.routable(self.now)]
            if pool == Role.PREFILL:
                load = sum(w.load() for w in live) / max(len(live), 1)
            else:
                load = sum(w.load() / self.profile.max_batch for w in live) / max(len(live), 1)
            want = self._scalers[pool].update(view.current + view.warming, load)
            targets[pool] = view.current + view.warming if want is None else want
        return targets

    def _scale_to(self, pool: str, view: PoolView, target: int) -> None:
        have = view.current + view.warming
        if target == have:
            return
        self.moves[pool].append((self.now, 1 if target > have else -1))
        if target > have:
            for _ in range(target - have):
                self.workers[pool].append(_Worker(pool, self.now, self.now + self.profile.start_s))
                self._at(self.now + self.profile.start_s, self._ready, pool)
            return
        # Shrink: warming workers first (nothing to drain), then the least loaded.
        active = [w for w in self.workers[pool] if w.gone_s is None and not w.draining]
        active.sort(key=lambda w: (w.ready_s <= self.now, w.load()))
        for w in active[: have - target]:
            w.draining = True
            self._maybe_gone(w)

    def _ready(self, pool: str) -> None:
        if pool == Role.PREFILL:
            while self._waiting and any(w.routable(self.now) for w in self.workers[Role.PREFILL]):
                self._route_prefill(self._waiting.popleft())
