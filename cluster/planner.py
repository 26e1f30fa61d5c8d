"""The SLO planner (``autoscaling.policy: slo``): how many prefill and how many
decode workers the next interval needs to meet a TTFT and a TPOT target, decided
together, from figures measured online. Plain code: no Ray, no asyncio, no
clock of its own, so the cluster's loop and the simulator run exactly this.

Each interval the caller hands it one ``PlannerInput``: what the last interval
saw (arrivals, prompt and output lengths, observed TTFT/TPOT) and what the
workers measured of themselves (prefill tokens/s, decode step time at a batch
size). The planner then::

    predict   arrival rate, uncached prompt tokens and output tokens per request
              (an EWMA, but never below the last interval's rate: it follows a
              step up at once and a step down slowly)
    capacity  prefill: measured tokens/s per worker (as arrivals: up at once,
                down slowly), loaded to at most the
                utilisation at which an M/D/1 queue still meets the TTFT target
              decode:  the largest batch whose step time, on a line fitted to
                (batch, step time) points the workers reported, meets
                decode_headroom of the TPOT target, and whose sequences fit a
                worker's KV cache at the observed context (prompt + half the
                output); its tokens/s = batch / step
    size      prefill = ceil(predicted prompt tokens/s / prefill capacity)
              decode  = ceil(predicted output tokens/s / decode capacity)
              (arrivals scaled by 1 + headroom, a backlog by its drain time)
              a pool that missed its SLO last interval with nothing warming
              grows by at least one (prefill only if it was busy: a TTFT
              missed on an idle prefill pool was lost elsewhere); decode to at least its routable workers
              times observed TPOT / target (at most 2x; TTFT lags behind a
              queue, TPOT does not); so it needs no profile: before any
              measurement it acts on the SLO alone. Then both fit [min, max]
              and a shared budget together (split by need: neither starves
              the other)
    damp      counts warming replicas as capacity already coming; moves each
              pool at most max(max_step, max_step_fraction of it) per
              interval; shrinks only after
              downscale_delay_s of wanting to; never reverses a pool's
              direction within min_reversal_s

In elastic mode (``PlannerInput.elastic_workers``) the same estimates split a fixed
set of workers between the roles instead (``Planner._elastic``): pooled (no prefill
worker: each prefills its own prompts) unless a split takes the load and pooled
decoding misses the TPOT target.

Scale-down drains (the pool takes the worker out of routing and kills it when
its requests are done), so no decision here drops a request.

An optional profile (``PlannerProfile``) seeds the capacities before the
workers have measured anything.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from splitserve.router.roles import Role
from splitserve.router.step_time import fit_line


class PlannerSpec(BaseModel):
    """The SLO planner's targets and damping (``autoscaling`` at the top of the config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float = Field(..., gt=0, description="TTFT target (p90 of the requests in an interval)")
    tpot_ms: float = Field(..., gt=0, description="TPOT target (p90 of the requests in an interval)")
    interval_s: float = Field(5.0, gt=0, description="how often the planner decides")
    max_step: int = Field(1, ge=1, description="most workers a pool gains or loses per interval")
    max_step_fraction: float = Field(
        1.0, ge=0, description="...or this fraction of the pool, if larger (a pool may double per interval)"
    )
    downscale_delay_s: float = Field(30.0, ge=0, description="how long shrinking must be wanted first")
    min_reversal_s: float = Field(60.0, ge=0, description="a pool never changes direction sooner than this")
    max_total_replicas: int | None = Field(
        None,
        ge=2,
        description="prefill + decode workers at most (shared hardware); null: each pool's own max",
    )
    smoothing: float = Field(0.3, gt=0, le=1, description="EWMA weight of the latest interval's load")
    backlog_drain_s: float = Field(
        30.0,
        gt=0,
        description="plan to clear the prompts waiting for prefill within this, on top of the arrivals "
        "(a backlog left by a load step or a burst otherwise drains only at the spare capacity's pace)",
    )
    headroom: float = Field(
        0.0,
        ge=0,
        description="plan for this fraction more arrivals than predicted, in both pools (0.25: capacity for "
        "a quarter more), so that a burst shorter than a worker's start-up meets running workers; "
        "paid for in replica-seconds at every load",
    )
    max_prefill_utilisation: float = Field(0.9, gt=0, lt=1, description="never plan a prefill worker busier")
    prefill_miss_utilisation: float = Field(
        0.1,
        ge=0,
        le=1,
        description="a missed TTFT grows prefill only when its workers were at least this busy (prompt "
        "tokens/s against what they prefill per second) or the prompts waiting take longer than the "
        "target to prefill; otherwise the time went elsewhere (a starved host, a queue for decode room) "
        "and another prefill worker would not shorten it",
    )
    elastic_return: float = Field(
        0.7,
        gt=0,
        lt=1,
        description="elastic mode: once the split could not take the prompts and every worker was pooled, "
        "split again only when the prompt demand is below this fraction of what it was then (hysteresis)",
    )
    decode_headroom: float = Field(
        0.8,
        gt=0,
        le=1,
        description="plan decode batches whose step takes at most this fraction of the TPOT target "
        "(a worker's batch varies around its mean; the p90 must still meet the target)",
    )


@dataclass(frozen=True)
class PlannerProfile:
    """Capacities measured offline (``splitserve plan profile``), used until the workers
    report their own."""

    prefill_tokens_per_s: float
    decode_step_s: tuple[tuple[float, float], ...]  # (batch size, step seconds) points


@dataclass(frozen=True)
class PoolView:
    """A pool as the planner needs it."""

    current: int  # routable workers
    warming: int  # started, not yet routable (counted as capacity on the way)
    min_replicas: int
    max_replicas: int
    max_batch: int  # a decode worker's max_num_seqs (its batch never grows past it)
    kv_tokens: int = 0  # KV tokens one decode worker holds (0: not known, no bound from it)


@dataclass(frozen=True)
class PlannerInput:
    """One interval, as the router saw it."""

    now: float  # seconds, any monotonic clock
    interval_s: float
    arrivals: int  # requests admitted in the interval
    finished: int  # requests served whole (finished with a finish reason) in it; of those:
    prompt_tokens: int  # uncached prompt tokens prefilled on prefill workers
    local_prompt_tokens: int  # uncached prompt tokens prefilled on decode workers
    output_tokens: int  # output tokens
    ttft_p90_s: float | None  # observed (None: no request finished)
    tpot_p90_s: float | None
    prefill_tokens_per_s: float  # mean over the prefill workers that measured one (0: none)
    decode_points: tuple[tuple[float, float], ...]  # (batch, step s) the decode workers reported
    prefill: PoolView
    decode: PoolView
    context_tokens: int = 0  # prompt tokens, cached ones included, of the requests served whole
    queued_prompt_tokens: int = 0  # now: uncached prompt tokens waiting for or in prefill
    queued_requests: int = 0  # now: the requests they belong to
    elastic_workers: int = 0  # elastic mode: the workers the two roles share (0: pools of their own)
    # prompt tokens (cached ones included) of the requests admitted in the interval (0: unknown)
    arrived_prompt_tokens: int = 0


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    current: int
    desired: int  # what the load needs (before damping)
    target: int  # what to scale to now (after damping): add or drain the difference
    reason: str


@dataclass(frozen=True)
class PlannerDecision:
    prefill: PoolDecision
    decode: PoolDecision
    arrival_rate: float  # predicted requests/s
    prompt_tokens: float  # predicted uncached prompt tokens per request (prefill workers)
    output_tokens: float  # predicted output tokens per request
    prefill_capacity: float  # tokens/s one prefill worker can take within the TTFT target (0: unknown)
    decode_capacity: float  # output tokens/s one decode worker can give within the TPOT target (0: unknown)


def role_switch(
    decision: PlannerDecision, routable: dict[str, int], floors: dict[str, int]
) -> tuple[Role, Role] | None:
    """Elastic mode's one switch, as (giver, taker): when one role's target is above its
    workers and the other's below, a worker of the latter goes over, unless that leaves
    the giver with fewer than its ``floors`` (``min_replicas``) of ``routable`` workers,
    or decode with none (prefill may go to none: every worker then prefills its own
    prompts). None: no switch. What the live ``PlannerLoop`` and the simulator both run."""
    p, d = decision.prefill, decision.decode
    if p.target > p.current and d.target < d.current:
        giver, taker = Role.DECODE, Role.PREFILL
    elif d.target > d.current and p.target < p.current:
        giver, taker = Role.PREFILL, Role.DECODE
    else:
        return None
    if routable[giver] <= max(floors[giver], 1 if giver == Role.DECODE else 0):
        return None
    return giver, taker


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (0 < q <= 100); None for no values. What the
    planner's inputs are computed with, live (``PlannerLoop``) and simulated."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _ewma(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


@dataclass
class _PoolDamper:
    """One pool's memory: when it last moved, which way, since when it wants to shrink."""

    last_direction: int = 0
    last_change: float = -math.inf
    shrink_wanted_since: float | None = None


@dataclass
class Planner:
    spec: PlannerSpec
    profile: PlannerProfile | None = None
    _rate: float | None = None
    _prompt: float | None = None
    _output: float | None = None
    _context: float | None = None  # mean KV tokens a decoding sequence holds over its life
    _local: float | None = None
    _prefill_rate: float | None = None
    _pooled_at: float | None = None  # elastic: the least prompt demand seen since the split fell short
    _points: deque = field(default_factory=lambda: deque(maxlen=64))
    _dampers: dict[str, _PoolDamper] = field(
        default_factory=lambda: {Role.PREFILL: _PoolDamper(), Role.DECODE: _PoolDamper()}
    )

    def __post_init__(self) -> None:
        if self.profile is not None:
            self._prefill_rate = self.profile.prefill_tokens_per_s
            self._points.extend(self.profile.decode_step_s)

    # ---- estimates ------------------------------------------------------------------
    def _observe(self, inp: PlannerInput) -> None:
        w = self.spec.smoothing
        rate = inp.arrivals / inp.interval_s
        self._rate = max(rate, _ewma(self._rate, rate, w))  # up at once, down slowly
        if inp.finished:
            self._prompt = _ewma(self._prompt, inp.prompt_tokens / inp.finished, w)
            self._local = _ewma(self._local, inp.local_prompt_tokens / inp.finished, w)
            self._output = _ewma(self._output, inp.output_tokens / inp.finished, w)
            held = (inp.context_tokens + inp.output_tokens / 2) / inp.finished  # it grows by the outputs
            self._context = _ewma(self._context, held, w)
        if inp.arrivals and inp.arrived_prompt_tokens and self._prompt is not None:
            # no more than the requests arriving now bring: after a shift to shorter prompts
            # the mean of those served still remembers the long ones (requests finish late,
            # the rate rises at once), and arrivals x that mean would grow prefill for nothing
            self._prompt = min(self._prompt, inp.arrived_prompt_tokens / inp.arrivals)
        if inp.prefill_tokens_per_s > 0:  # up at once, down slowly: a capacity is what a busy
            # worker does, and one given a few short prompts reports far less (a step's fixed
            # cost over few tokens) while the prompt mean still remembers the long ones
            measured = inp.prefill_tokens_per_s
            self._prefill_rate = max(measured, _ewma(self._prefill_rate, measured, w))
        self._points.extend(p for p in inp.decode_points if p[0] > 0 and p[1] > 0)

    def prefill_capacity(self, prompt: float | None = None) -> float:
        """Prompt tokens/s one prefill worker takes while a mean prompt (``prompt`` tokens;
        default: the mean prefill workers saw) still meets the TTFT target, queueing
        included (M/D/1: wait = rho * S / (2 (1 - rho))); 0 unknown."""
        if not self._prefill_rate:
            return 0.0
        service = ((self._prompt or 0.0) if prompt is None else prompt) / self._prefill_rate
        target = self.spec.ttft_ms / 1000
        if service <= 0:
            rho = self.spec.max_prefill_utilisation
        elif service >= target:
            rho = 0.5  # a lone prompt misses the target already: keep the queue short
        else:
            x = (target - service) / service
            rho = min(self.spec.max_prefill_utilisation, 2 * x / (1 + 2 * x))
        return self._prefill_rate * rho

    def decode_capacity(self, max_batch: int, kv_tokens: int = 0) -> float:
        """Output tokens/s one decode worker gives at the largest batch whose step meets
        ``decode_headroom`` of the TPOT target (on the fitted step-time line), and whose
        sequences fit its ``kv_tokens`` at the mean context a sequence holds (prompt and
        half its output); 0 unknown."""
        if not self._points:
            return 0.0
        if kv_tokens and self._context:
            max_batch = min(max_batch, max(1, math.floor(kv_tokens / self._context)))
        a, b = fit_line(list(self._points))
        target = self.spec.decode_headroom * self.spec.tpot_ms / 1000
        if a >= target:
            return 1.0 / max(a + b, 1e-9)  # not even one sequence meets it: one at a time
        batch = max_batch if b <= 0 else min(max_batch, (target - a) / b)
        batch = max(batch, 1.0)
        return batch / (a + b * batch)

    # ---- the decision ---------------------------------------------------------------------
    def decide(self, inp: PlannerInput) -> PlannerDecision:
        self._observe(inp)
        rate, prompt, output = self._rate or 0.0, self._prompt or 0.0, self._output or 0.0
        planned = rate * (1 + self.spec.headroom)  # arrivals the pools are sized for
        p_cap, d_cap = (
            self.prefill_capacity(),
            self.decode_capacity(inp.decode.max_batch, inp.decode.kv_tokens),
        )
        # A backlog (prompts waiting now) is demand on top of the arrivals, to be
        # cleared within backlog_drain_s; it reaches decode as it is prefilled.
        drain = self.spec.backlog_drain_s
        # TTFT lags behind a queue (it stays high while a backlog drains, however
        # many workers there are now): a miss adds one prefill worker, if prefill was
        # busy enough to have caused it. TPOT is the batch's present step time: a
        # miss scales decode by how far it was missed.
        p_demand = planned * prompt + inp.queued_prompt_tokens / drain
        p_need, p_why = self._need(
            p_demand,
            p_cap,
            inp.prefill,
            inp.ttft_p90_s if self._prefill_busy(p_demand, inp) else None,
            self.spec.ttft_ms,
            by_ratio=False,
        )
        local_s = planned * (self._local or 0.0) / (self._prefill_rate or math.inf)  # decode workers' prefill
        d_need, d_why = self._need(
            (planned + inp.queued_requests / drain) * output,
            d_cap,
            inp.decode,
            inp.tpot_p90_s,
            self.spec.tpot_ms,
            local_s,
        )
        if inp.elastic_workers:
            (p_need, p_why), (d_need, d_why) = self._elastic(inp, planned, d_cap)
        else:
            p_need, d_need = self._fit_budget(p_need, d_need, inp)
        return PlannerDecision(
            self._damp(Role.PREFILL, inp.prefill, p_need, p_why, inp.now),
            self._damp(Role.DECODE, inp.decode, d_need, d_why, inp.now),
            rate,
            prompt,
            output,
            p_cap,
            d_cap,
        )

    def _elastic(self, inp: PlannerInput, planned: float, d_cap: float) -> tuple[tuple[int, str], ...]:
        """Elastic mode: how ``inp.elastic_workers`` workers split between the roles.

        POOLED, the prefill role at its minimum (0: every worker decodes and prefills its
        own prompts, as colocated workers do, so every core prefills), unless
        SPLIT takes the whole prompt demand (every uncached prompt token, wherever it was
        prefilled) and the decode demand within the targets on at most all the workers,
        and, from an empty prefill role, the pooled workers missed the TPOT target (their
        prompts stall their decoding; a split's prefill workers take the prompts, so
        decoding never waits for one). The workers are shared in proportion to need.
        The split also falls short when its TTFT was missed while two or more prompts
        wait at its prefill workers and take longer than the target to prefill (a queue
        the prediction did not see: a burst of cold prefixes; one long prompt over the
        target is no queue, and more prefill cores would not shorten it).
        Back from pooled only once the arriving prompt demand (the backlog of the moment
        left out) is below ``elastic_return`` of the least it was while the split fell
        short, so a steady load, however noisy, never flaps. With no load, or no
        capacity measured yet, the roles stay as they are."""
        n, s, drain = inp.elastic_workers, self.spec, self.spec.backlog_drain_s
        prompt = (self._prompt or 0.0) + (self._local or 0.0)
        idle = planned <= 0 and not inp.queued_prompt_tokens
        p_cap = self.prefill_capacity(prompt)
        if idle or not (d_cap and p_cap):  # nothing says which is better
            have = inp.prefill.current + inp.prefill.warming
            why = "no load" if idle else "no capacity measured yet"
            return (have, f"{why}: the roles stay"), (n - have, f"{why}: the roles stay")
        arriving = planned * prompt  # what the hysteresis compares: not the backlog of the moment
        p_demand = arriving + inp.queued_prompt_tokens / drain
        waiting_s = inp.queued_prompt_tokens / max(self._prefill_rate or 0.0, 1e-9)
        queued = inp.prefill.current > 0 and inp.queued_requests > 1 and waiting_s * 1000 > s.ttft_ms
        p, p_why = self._need(
            p_demand,
            p_cap,
            inp.prefill,
            inp.ttft_p90_s if queued else None,
            s.ttft_ms,
            by_ratio=False,
        )
        # a pooled worker's TPOT includes the prompts it prefilled: no evidence against a split
        d, d_why = self._need(
            (planned + inp.queued_requests / drain) * (self._output or 0.0),
            d_cap,
            inp.decode,
            inp.tpot_p90_s if inp.prefill.current > 0 else None,
            s.tpot_ms,
        )
        p_lo, d_lo = max(inp.prefill.min_replicas, 1), max(inp.decode.min_replicas, 1)
        p, d = max(p, p_lo), max(d, d_lo)
        fits = p + d <= n and p <= inp.prefill.max_replicas
        why = f"pooled: the split needs {p} prefill + {d} decode of {n} workers"
        if not fits:  # the least demand seen while the split fell short (a noisy load stays above)
            self._pooled_at = arriving if self._pooled_at is None else min(self._pooled_at, arriving)
        elif self._pooled_at is not None and arriving > s.elastic_return * self._pooled_at:
            fits, why = False, f"{why}; pooled until under {s.elastic_return * self._pooled_at:.0f} tok/s"
        elif inp.prefill.current + inp.prefill.warming == 0 and not (
            inp.tpot_p90_s is not None and inp.tpot_p90_s * 1000 > s.tpot_ms
        ):
            fits, why = False, "pooled: pooled decoding meets the TPOT target"  # its prompts stall nothing
        if not fits:
            pooled = max(inp.prefill.min_replicas, n - inp.decode.max_replicas)
            return (pooled, f"{why}; {p_why}"), (n - pooled, f"{why}; {d_why}")
        self._pooled_at = None
        p = min(
            max(round(n * p / (p + d)), p_lo, n - inp.decode.max_replicas), n - d_lo, inp.prefill.max_replicas
        )
        return (p, f"split: {p_why}"), (n - p, f"split: {d_why}")

    def _prefill_busy(self, demand: float, inp: PlannerInput) -> bool:
        """Whether a missed TTFT is prefill's to fix: no rate measured yet (act on the SLO
        alone), the routable workers at least ``prefill_miss_utilisation`` busy with the
        demand, or the prompts waiting now longer than the TTFT target to prefill."""
        if not self._prefill_rate:
            return True
        rate = self._prefill_rate * max(inp.prefill.current, 1)
        waiting_s = inp.queued_prompt_tokens / rate
        return demand / rate >= self.spec.prefill_miss_utilisation or waiting_s * 1000 > self.spec.ttft_ms

    @staticmethod
    def _need(
        demand: float,
        capacity: float,
        view: PoolView,
        observed_s: float | None,
        target_ms: float,
        busy_extra: float = 0.0,
        by_ratio: bool = True,
    ) -> tuple[int, str]:
        """Workers the demand needs at this capacity, plus ``busy_extra`` workers' worth of
        other work. When the SLO was missed with no replica warming (the estimate was too
        low, not the capacity late), at least one more than the routable workers, and
        ``by_ratio`` at least them times observed / target (at most twice them)."""
        have = view.current + view.warming
        if capacity > 0:
            need = math.ceil(demand / capacity + busy_extra - 1e-9)
            why = f"{demand:.0f} tok/s at {capacity:.0f} tok/s per worker"
        else:
            need, why = have, "no capacity measured yet"
        missed = observed_s is not None and observed_s * 1000 > target_ms
        if missed and view.warming == 0:
            floor = view.current + 1
            if by_ratio:
                floor = max(floor, math.ceil(view.current * min(observed_s * 1000 / target_ms, 2.0)))
            if need < floor:
                need = floor
                why += f"; p90 {observed_s * 1000:.0f} ms > {target_ms:.0f} ms target"
        return max(need, 0), why

    def _fit_budget(self, p: int, d: int, inp: PlannerInput) -> tuple[int, int]:
        """Both within [min, max]; with a shared budget, shares proportional to need."""
        p = min(max(p, inp.prefill.min_replicas), inp.prefill.max_replicas)
        d = min(max(d, inp.decode.min_replicas), inp.decode.max_replicas)
        budget = self.spec.max_total_replicas
        if budget is not None and p + d > budget:
            share = p / (p + d)
            p = min(max(round(budget * share), inp.prefill.min_replicas), budget - inp.decode.min_replicas)
            d = budget - p
        return p, d

    def _damp(self, pool: str, view: PoolView, need: int, why: str, now: float) -> PoolDecision:
        s, damper = self.spec, self._dampers[pool]
        have = view.current + view.warming
        step = max(s.max_step, math.floor(s.max_step_fraction * max(have, 1)))
        direction = (need > have) - (need < have)
        target, reason = have, why
        if direction < 0:
            if damper.shrink_wanted_since is None:
                damper.shrink_wanted_since = now
            wanted_s = now - damper.shrink_wanted_since
            if wanted_s < s.downscale_delay_s:
                reason += f"; shrink wanted for {wanted_s:.0f} s of {s.downscale_delay_s:.0f}"
                direction = 0
        else:
            damper.shrink_wanted_since = None
        if direction and damper.last_direction == -direction and now - damper.last_change < s.min_reversal_s:
            reason += f"; held: reversed {now - damper.last_change:.0f} s ago"
            direction = 0
        if direction:
            target = have + direction * min(step, abs(need - have))
            damper.last_direction, damper.last_change = direction, now
            if direction < 0:
                damper.shrink_wanted_since = None
        return PoolDecision(pool, have, need, target, reason)
