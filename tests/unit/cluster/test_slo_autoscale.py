"""What the live planner loop feeds the planner, from the traces the router recorded."""

from __future__ import annotations

import asyncio

from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.planner import Planner, PlannerDecision, PoolDecision, PoolView
from splitserve.cluster.pools import WorkerPool
from splitserve.cluster.slo_autoscale import PlannerLoop
from splitserve.router.registry import Membership, WorkerRegistry
from splitserve.router.roles import Role
from splitserve.router.trace import Mark, RequestTrace


def _trace(rid: str, outcome: str, ok: bool, output: int, t0: float) -> RequestTrace:
    marks = [Mark("admitted", t0)]
    if output:
        marks += [Mark("first_token", t0 + 0.1), Mark("finished", t0 + 0.1 + 0.02 * (output - 1))]
    else:
        marks += [Mark("finished", t0 + 0.001)]
    return RequestTrace(rid, outcome, ok, 100, 0, output, "prefill-0", "decode-0", 0, 0.0, tuple(marks), ())


def _pools() -> tuple[ClusterConfig, WorkerRegistry, dict[str, WorkerPool]]:
    """Both pools under the SLO planner (1-4 workers each), with no workers yet."""
    pool = {"autoscaling": {"policy": "slo", "min_replicas": 1, "max_replicas": 4}}
    config = ClusterConfig.model_validate(
        {
            "model": {"name": "random"},
            "prefill": pool,
            "decode": pool,
            "planner": {"ttft_ms": 500, "tpot_ms": 50},
        }
    )
    registry = WorkerRegistry()
    return config, registry, {role: WorkerPool(role, config, registry) for role in ("prefill", "decode")}


def test_requests_refused_for_want_of_a_decode_batch_count_as_demand_not_as_empty_requests():
    config, registry, pools = _pools()
    admitted = [0]
    now = [0.0]
    loop = PlannerLoop(Planner(config.planner), pools, lambda: admitted[0], clock=lambda: now[0])
    # 10 s: 4 requests served whole (64 tokens each), 6 refused at the decode cap
    for i in range(4):
        loop.window.record(_trace(f"ok{i}", "length", True, 64, float(i)))
    for i in range(6):
        loop.window.record(_trace(f"no{i}", "RESOURCE_EXHAUSTED", False, 0, float(i)))
    admitted[0], now[0] = 10, 10.0
    p0 = registry.add("prefill-0", "prefill", client=None, block_size=16)
    with registry.prefilling(p0, "waiting-1", 300), registry.prefilling(p0, "waiting-2", 200):
        inp = loop._input()
    assert inp.queued_prompt_tokens == 500 and inp.queued_requests == 2  # the backlog now
    assert inp.arrivals == 10  # the demand includes what was refused
    assert inp.finished == 4 and inp.output_tokens == 4 * 64  # 64 per request, not 25.6
    assert inp.prompt_tokens == 4 * 100
    assert inp.tpot_p90_s is not None and abs(inp.tpot_p90_s - 0.02) < 1e-9


def test_shrinking_never_drains_a_routable_worker_for_one_still_warming():
    """A pool of one routable and one warming worker told to shrink to one keeps the
    routable one (draining it left the pool with none routable until the other
    loaded: every request failed meanwhile); once both are routable, one drains."""
    config, registry, pools = _pools()
    drained: list[str] = []

    async def remove(worker_id: str, drain_timeout_s: float, drain: str = "wait") -> None:
        drained.append(worker_id)

    pools["decode"].remove = remove
    loop = PlannerLoop(Planner(config.planner), pools, lambda: 0)
    spawned = []
    loop._spawn = spawned.append  # the coroutines it would run
    busy = registry.add("decode-0", "decode", client=None, block_size=16)
    busy.state = Membership.ACTIVE
    warming = registry.add("decode-1", "decode", client=None, block_size=16)
    assert loop._view("decode") == PoolView(1, 1, 1, 4, config.decode.engine.max_num_seqs)
    loop._apply(PoolDecision("decode", current=2, desired=1, target=1, reason="test"))
    assert spawned == []
    warming.state = Membership.ACTIVE
    busy.decoding["r"] = 16  # the busier one stays
    loop._apply(PoolDecision("decode", current=2, desired=1, target=1, reason="test"))
    for coro in spawned:
        asyncio.run(coro)
    assert drained == ["decode-1"]


def test_in_elastic_mode_a_decision_switches_a_worker_between_roles_one_at_a_time():
    """With a ``switch`` (elastic mode) the planner adds and drains no worker: a role
    wanting one more takes the least busy worker of a role that wants one fewer, one
    switch at a time, and never a role's last worker."""
    config, registry, pools = _pools()
    switched: list[tuple[str, str]] = []
    release = asyncio.Event()

    async def switch(worker_id: str, role: Role) -> float:
        switched.append((worker_id, role))
        await release.wait()
        return 0.0

    async def scenario():
        loop = PlannerLoop(Planner(config.planner), pools, lambda: 0, switch=switch)
        for wid, role in [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")]:
            registry.add(wid, role, client=None, block_size=16).state = Membership.ACTIVE
        registry.get("d0").decoding["r"] = 16  # busier: d1 goes
        grow_prefill = PlannerDecision(
            PoolDecision("prefill", 1, 2, 2, "test"), PoolDecision("decode", 2, 1, 1, "test"), 1, 1, 1, 1, 1
        )
        loop._split(grow_prefill)
        loop._split(grow_prefill)  # one at a time: the first is still switching
        await asyncio.sleep(0)
        assert switched == [("d1", Role.PREFILL)]
        release.set()
        await asyncio.sleep(0)
        registry.remove("d1")  # as if it had left the decode role
        loop._split(grow_prefill)  # decode's last worker is never taken
        await asyncio.sleep(0)
        assert switched == [("d1", Role.PREFILL)]
        steady = PlannerDecision(
            PoolDecision("prefill", 1, 1, 1, "test"), PoolDecision("decode", 1, 2, 2, "test"), 1, 1, 1, 1, 1
        )
        loop._split(steady)  # decode wants one, prefill spares none: nothing moves
        await asyncio.sleep(0)
        assert switched == [("d1", Role.PREFILL)]

    asyncio.run(scenario())


def test_in_elastic_mode_the_prefill_role_may_give_its_last_worker_where_its_minimum_is_none():
    """An elastic cluster whose prefill role may shrink to none (every worker then
    prefills its own prompts): the planner switches the last prefill worker to decode;
    the decode role always keeps one. The loop tells the planner how many workers the
    roles share."""
    none = {"policy": "slo", "min_replicas": 0, "max_replicas": 2}
    config = ClusterConfig.model_validate(
        {
            "mode": "elastic",
            "model": {"name": "random"},
            "prefill": {"autoscaling": none},
            "decode": {"autoscaling": {**none, "min_replicas": 1}},
            "planner": {"ttft_ms": 500, "tpot_ms": 50},
        }
    )
    registry = WorkerRegistry()
    pools = {role: WorkerPool(role, config, registry) for role in ("prefill", "decode")}
    switched: list[tuple[str, str]] = []

    async def switch(worker_id: str, role: Role) -> float:
        switched.append((worker_id, role))
        return 0.0

    async def scenario():
        loop = PlannerLoop(Planner(config.planner), pools, lambda: 0, switch=switch)
        for wid, role in [("p0", "prefill"), ("d0", "decode")]:
            registry.add(wid, role, client=None, block_size=16).state = Membership.ACTIVE
        assert loop._input().elastic_workers == 2
        pool = PlannerDecision(
            PoolDecision("prefill", 1, 0, 0, "test"), PoolDecision("decode", 1, 2, 2, "test"), 1, 1, 1, 1, 1
        )
        loop._split(pool)
        await asyncio.sleep(0)
        assert switched == [("p0", Role.DECODE)]
        registry.remove("p0")  # as if it had switched
        registry.add("p0", "decode", client=None, block_size=16).state = Membership.ACTIVE
        split = PlannerDecision(
            PoolDecision("prefill", 0, 1, 1, "test"), PoolDecision("decode", 2, 1, 1, "test"), 1, 1, 1, 1, 1
        )
        loop._split(split)
        await asyncio.sleep(0)
        assert switched[-1][1] == Role.PREFILL  # one of the two decode workers goes back
        registry.remove("p0")  # one decode worker left
        loop._split(split)
        await asyncio.sleep(0)
        assert len(switched) == 2  # decode's last worker never goes

    asyncio.run(scenario())
