"""The planner study at CI's size (``bench.planner_study``; docs/autoscaling.md
quotes the 64-worker run): on a trace with a 5x load step and bursts, the SLO
planner meets the SLO for at least as many requests as the proportional policy
at any target that spends no more replica-seconds, and as the best fixed
prefill:decode split of the same replica-seconds, spends
fewer replica-seconds than the cheapest fixed split that matches it, and never
reverses a pool twice within a minute."""

from __future__ import annotations

from splitserve.bench.planner_study import Study, trace_for
from splitserve.cluster.simulator import SimProfile

PROFILE = SimProfile(
    prefill_tokens_per_s=1000.0,
    prefill_step_s=0.0,
    max_batched_tokens=512,
    decode_step_s=(0.017, 0.0007),
    max_batch=256,
    transfer_s=0.014,
    start_s=30.0,
)


def test_the_slo_planner_beats_proportional_and_fixed_splits_on_a_load_step():
    trace = trace_for(base_rate=2.0, prompt=(64, 448), output=(100, 200), seed=0)
    rows = Study(PROFILE, trace, ttft_ms=1000, tpot_ms=50, max_per_pool=12).run()
    slo = rows["slo"]
    proportional = [r for name, r in rows.items() if name.startswith("proportional")]
    for row in proportional:
        assert row.replica_seconds > slo.replica_seconds or slo.attainment >= row.attainment, row.label
    assert slo.attainment >= rows["fixed, same replica-seconds"].attainment
    cheapest = rows["fixed, cheapest at slo's attainment"]
    assert cheapest is None or cheapest.replica_seconds > slo.replica_seconds
    for pool in ("prefill", "decode"):
        assert slo.result.reversals_per_minute(pool) <= 1
    # the step was real: the planner grew both pools past where they started
    assert max(p for _, p, _ in slo.result.timeline) > 2 and max(d for _, _, d in slo.result.timeline) > 2
