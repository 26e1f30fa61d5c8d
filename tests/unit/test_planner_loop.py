"""What the live planner loop feeds the planner, from the traces the router recorded."""

from __future__ import annotations

from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.planner import Planner
from splitserve.cluster.pools import WorkerPool
from splitserve.cluster.slo_autoscale import PlannerLoop
from splitserve.router.registry import WorkerRegistry
from splitserve.router.trace import Mark, RequestTrace


def _trace(rid: str, outcome: str, ok: bool, output: int, t0: float) -> RequestTrace:
    marks = [Mark("admitted", t0)]
    if output:
        marks += [Mark("first_token", t0 + 0.1), Mark("finished", t0 + 0.1 + 0.02 * (output - 1))]
    else:
        marks += [Mark("finished", t0 + 0.001)]
    return RequestTrace(rid, outcome, ok, 100, 0, output, "prefill-0", "decode-0", 0, 0.0, tuple(marks), ())


def test_requests_refused_for_want_of_a_decode_batch_count_as_demand_not_as_empty_requests():
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
    pools = {role: WorkerPool(role, config, registry) for role in ("prefill", "decode")}
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
