"""The SLO planner at work on a live cluster: every ``planner.interval_s`` it
builds a ``PlannerInput`` from what the router saw (the requests that ended in
the interval, as traces; admissions) and what the workers last reported (the
registry's polled stats), asks ``Planner.decide``, logs the decision with its
reasons, exports it as metrics, and applies it through the pools: adds start in
the background (the new workers count as warming until they are routable), and
removals drain (the pool takes the worker out of routing and kills it once its
requests have finished), so no request is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.cluster.planner import (
    Planner,
    PlannerDecision,
    PlannerInput,
    PoolDecision,
    PoolView,
    percentile,
    role_switch,
)
from splitserve.cluster.pools import WorkerPool
from splitserve.router.registry import Membership
from splitserve.router.roles import Role
from splitserve.router.trace import RequestTrace

log = logging.getLogger(__name__)


class LoadWindow:
    """A ``TraceSink``: the admitted requests that ended since the last ``take``."""

    def __init__(self) -> None:
        self._traces: list[RequestTrace] = []

    def record(self, trace: RequestTrace) -> None:
        if trace.prompt_tokens:  # refused at the door: no load
            self._traces.append(trace)

    def take(self) -> list[RequestTrace]:
        traces, self._traces = self._traces, []
        return traces


class _PlannerMetrics:
    def __init__(self, prom: CollectorRegistry):
        self.rate = Gauge("splitserve:planner_predicted_arrival_rate", "Predicted requests/s.", registry=prom)
        self.prompt = Gauge(
            "splitserve:planner_predicted_prompt_tokens",
            "Predicted uncached prompt tokens per request.",
            registry=prom,
        )
        self.output = Gauge(
            "splitserve:planner_predicted_output_tokens",
            "Predicted output tokens per request.",
            registry=prom,
        )
        self.capacity = Gauge(
            "splitserve:planner_capacity_tokens_per_s",
            "Estimated tokens/s per worker within the SLO.",
            ["pool"],
            registry=prom,
        )
        self.target = Gauge(
            "splitserve:planner_target_replicas", "Workers the planner scales to.", ["pool"], registry=prom
        )
        self.scaled = Counter(
            "splitserve:planner_scale",
            "Workers added or drained by the planner.",
            ["pool", "direction"],
            registry=prom,
        )

    def show(self, d: PlannerDecision) -> None:
        self.rate.set(d.arrival_rate)
        self.prompt.set(d.prompt_tokens)
        self.output.set(d.output_tokens)
        self.capacity.labels(Role.PREFILL).set(d.prefill_capacity)
        self.capacity.labels(Role.DECODE).set(d.decode_capacity)
        for pd in (d.prefill, d.decode):
            self.target.labels(pd.pool).set(pd.target)
            if pd.target != pd.current:
                self.scaled.labels(pd.pool, "up" if pd.target > pd.current else "down").inc(
                    abs(pd.target - pd.current)
                )


class PlannerLoop:
    """Runs the planner over the prefill and decode pools (both with ``policy: slo``)."""

    def __init__(
        self,
        planner: Planner,
        pools: dict[str, WorkerPool],
        admitted: Callable[[], int],
        prom: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        switch: Callable[[str, Role], Awaitable[float]] | None = None,
        admitted_prompt_tokens: Callable[[], int] | None = None,
    ):
        """``admitted_prompt_tokens``: the router's count of their prompt tokens, ever
        (None: not known). ``switch``: elastic mode (a fixed set of workers, ``Cluster.switch_role``): a
        decision moves a worker from the role above its target to the one below, instead
        of adding and draining workers."""
        self.planner = planner
        self.switch = switch
        self._switching: asyncio.Task | None = None  # one role switch at a time
        self.pools = pools
        self.admitted = admitted  # the router's count of admitted requests, ever
        self.window = LoadWindow()  # the dispatcher's sinks include it
        self.clock = clock
        self.metrics = _PlannerMetrics(prom) if prom is not None else None
        self.decisions: list[
            PlannerDecision
        ] = []  # the latest last (kept: the last 100), for tests and status
        self._last_admitted = admitted()
        self.admitted_prompt_tokens = admitted_prompt_tokens
        self._last_prompt_tokens = admitted_prompt_tokens() if admitted_prompt_tokens else 0
        self._last_at = clock()
        self._tasks: set[asyncio.Task] = set()

    def desired(self, role: str) -> int | None:
        """What the last decision wanted for ``role`` (None before the first)."""
        if not self.decisions:
            return None
        return getattr(self.decisions[-1], role).desired

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.planner.spec.interval_s)
                try:
                    self.step()
                except Exception:  # a failed decision must not stop the loop or the router
                    log.exception("the SLO planner failed to decide")
        finally:
            for task in self._tasks:
                task.cancel()

    def step(self) -> PlannerDecision:
        decision = self.planner.decide(self._input())
        self.decisions.append(decision)
        del self.decisions[:-100]
        if self.metrics is not None:
            self.metrics.show(decision)
        for pd in (decision.prefill, decision.decode):
            if pd.target != pd.current:
                log.info("planner: %s %d -> %d (%s)", pd.pool, pd.current, pd.target, pd.reason)
                if self.switch is None:
                    self._apply(pd)
        if self.switch is not None:
            self._split(decision)
        return decision

    def _split(self, decision: PlannerDecision) -> None:
        """Elastic mode: when one role wants a worker the other can spare, switch the
        least busy worker of the other over (one switch at a time; the planner's damping
        and its hysteresis keep roles from flapping). A role keeps its ``min_replicas``;
        decode keeps one worker at least, prefill may go to none (every worker then
        prefills its own prompts)."""
        if self._switching is not None and not self._switching.done():
            return
        routable = {role: self.pools[role].registry.routable(role) for role in (Role.PREFILL, Role.DECODE)}
        floors = {role: self.pools[role].spec.autoscaling.min_replicas for role in routable}
        switch = role_switch(decision, {role: len(ws) for role, ws in routable.items()}, floors)
        if switch is None:
            return
        giver, taker = switch
        worker = min(routable[giver], key=lambda w: (w.active, w.running))
        log.info("planner: %s switches from %s to %s", worker.worker_id, giver, taker)
        self._switching = asyncio.ensure_future(self.switch(worker.worker_id, taker))
        self._tasks.add(self._switching)
        self._switching.add_done_callback(self._done)

    def _input(self) -> PlannerInput:
        now, admitted = self.clock(), self.admitted()
        interval, arrivals = max(now - self._last_at, 1e-6), admitted - self._last_admitted
        self._last_at, self._last_admitted = now, admitted
        prompt_tokens = self.admitted_prompt_tokens() if self.admitted_prompt_tokens else 0
        arrived_prompt_tokens = prompt_tokens - self._last_prompt_tokens
        self._last_prompt_tokens = prompt_tokens
        traces = self.window.take()
        # per-request means come from the requests served whole: one refused because every
        # decode worker had its batch (counted in arrivals) has no output yet, and counting
        # its zero would hide the demand that was refused
        served = [t for t in traces if t.ok]
        ok = [t for t in served if t.ttft_s is not None]
        registry = self.pools[Role.PREFILL].registry
        prefill = registry.routable(Role.PREFILL)
        rates = [w.prefill_tokens_per_s for w in prefill if w.prefill_tokens_per_s > 0] or [
            w.prefill_tokens_per_s  # none routable (elastic, pooled): the decode workers prefill
            for w in registry.routable(Role.DECODE)
            if w.prefill_tokens_per_s > 0
        ]
        points = tuple(
            (w.stats.engine.decode_batch, w.stats.engine.decode_step_s)
            for w in registry.routable(Role.DECODE)
            if w.stats is not None and w.stats.engine.decode_step_s > 0
        )
        return PlannerInput(
            now=now,
            interval_s=interval,
            arrivals=arrivals,
            finished=len(served),
            prompt_tokens=sum(t.prompt_tokens - t.cached_prompt_tokens for t in served if t.prefill_worker),
            local_prompt_tokens=sum(
                t.prompt_tokens - t.cached_prompt_tokens for t in served if not t.prefill_worker
            ),
            output_tokens=sum(t.output_tokens for t in served),
            context_tokens=sum(t.prompt_tokens for t in served),
            ttft_p90_s=percentile([t.ttft_s for t in ok], 90),
            tpot_p90_s=percentile(
                [(t.e2e_s - t.ttft_s) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1], 90
            ),
            prefill_tokens_per_s=sum(rates) / len(rates) if rates else 0.0,
            decode_points=points,
            prefill=self._view(Role.PREFILL),
            decode=self._view(Role.DECODE),
            queued_prompt_tokens=sum(w.queued_prompt_tokens for w in registry.workers(Role.PREFILL)),
            queued_requests=sum(len(w.prefilling) for w in registry.workers(Role.PREFILL)),
            elastic_workers=len(registry.workers(Role.PREFILL, Role.DECODE)) if self.switch else 0,
            arrived_prompt_tokens=arrived_prompt_tokens,
        )

    def _view(self, role: str) -> PoolView:
        pool = self.pools[role]
        workers = pool.registry.workers(role)
        spec = pool.spec.autoscaling
        return PoolView(
            current=sum(w.routable for w in workers),
            warming=sum(w.state == Membership.STARTING for w in workers),
            min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
            max_batch=pool.spec.engine.max_num_seqs,
            kv_tokens=min(
                (w.num_blocks * w.block_size for w in workers if w.routable and w.num_blocks), default=0
            ),
        )

    def _apply(self, pd: PoolDecision) -> None:
        pool = self.pools[pd.pool]
        if pd.target > pd.current:
            self._spawn(pool.add(pd.target - pd.current))
            return
        # pd.current counts warming workers too, which cannot be drained: the routable
        # workers never drop below the target for them (with one routable and one
        # warming, shrinking to one must not drain the routable one). The next decision
        # sees the warming ones routable and shrinks then.
        routable = pool.registry.routable(pd.pool)
        excess = max(len(routable) - pd.target, 0)
        for victim in sorted(routable, key=lambda w: (w.active, w.running))[:excess]:
            log.info("planner: draining %s", victim.worker_id)
            scaling = pool.spec.autoscaling
            self._spawn(pool.remove(victim.worker_id, scaling.drain_timeout_s, scaling.drain))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("the planner's scaling action failed", exc_info=task.exception())
