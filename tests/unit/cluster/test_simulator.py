"""The cluster simulator against queueing theory and against itself: a lone
request costs exactly the profile's times, a prefill worker under Poisson load
queues as an M/D/1 queue does (Pollaczek-Khinchine), and the policies it runs
are the cluster's own (the SLO planner grows the pool a load step needs)."""

from __future__ import annotations

import pytest

from splitserve.cluster.config import AutoscalingSpec
from splitserve.cluster.planner import PlannerSpec, percentile
from splitserve.cluster.sim_trace import SimRequest, bursty_trace
from splitserve.cluster.simulator import PoolLimits, SimProfile, Simulation

PROFILE = SimProfile(
    prefill_tokens_per_s=10_000,
    prefill_step_s=0.01,
    max_batched_tokens=1000,
    decode_step_s=(0.02, 0.001),
    max_batch=32,
    transfer_s=0.005,
    transfer_s_per_token=1e-6,
    start_s=10,
)
ONE = PoolLimits(1, 1, 1)


def test_a_lone_request_costs_exactly_the_profile():
    req = SimRequest(arrival_s=3.0, prompt_tokens=800, output_tokens=11)
    result = Simulation(PROFILE, [req], ONE, ONE).run()
    prefill = 0.01 + 800 / 10_000
    handover = 0.005 + 800e-6
    assert result.ttft_s() == [pytest.approx(prefill)]
    # ten decode steps of one sequence, after the handover
    assert result.tpot_s() == [pytest.approx((handover + 10 * 0.021) / 10)]
    assert result.end_s == pytest.approx(3.0 + prefill + handover + 10 * 0.021)


def test_prefill_queueing_matches_md1():
    """Poisson arrivals, one prompt per step, constant service S: mean TTFT =
    S + rho S / (2 (1 - rho)) (Pollaczek-Khinchine for deterministic service)."""
    service = 0.01 + 900 / 10_000  # 0.1 s
    for rho in (0.5, 0.8):
        rate = rho / service
        trace = bursty_trace(3000 / rate, rate, rate, 1.0, 1.0, (900, 900), (1, 1), seed=7)
        result = Simulation(PROFILE, trace, ONE, ONE).run()
        ttft = result.ttft_s()
        expected = service + rho * service / (2 * (1 - rho))
        assert sum(ttft) / len(ttft) == pytest.approx(expected, rel=0.12), rho


def test_bursty_trace_has_its_rates():
    trace = bursty_trace(1000, 2.0, 20.0, 100, 20, (10, 20), (5, 6), seed=1)
    in_burst = sum(1 for r in trace if r.arrival_s % 100 < 20)
    assert in_burst / 200 == pytest.approx(20.0, rel=0.1)  # 10 bursts of 20 s
    assert (len(trace) - in_burst) / 800 == pytest.approx(2.0, rel=0.1)
    assert all(10 <= r.prompt_tokens <= 20 and 5 <= r.output_tokens <= 6 for r in trace)


def _step_trace():
    """2 req/s for 120 s, then 12 req/s for 200 s, then 2 req/s for 280 s."""
    low = bursty_trace(600, 2.0, 2.0, 1.0, 1.0, (600, 1000), (20, 40), seed=3)
    high = bursty_trace(200, 10.0, 10.0, 1.0, 1.0, (600, 1000), (20, 40), seed=4)
    shifted = [SimRequest(r.arrival_s + 120, r.prompt_tokens, r.output_tokens) for r in high]
    return sorted(low + shifted, key=lambda r: r.arrival_s)


def test_slo_planner_grows_prefill_for_a_load_step_and_shrinks_after():
    spec = PlannerSpec(ttft_ms=400, tpot_ms=100, interval_s=5, downscale_delay_s=30, min_reversal_s=60)
    pools = PoolLimits(1, 1, 8)
    slo = Simulation(PROFILE, _step_trace(), pools, pools, "slo", planner=spec).run()
    fixed = Simulation(PROFILE, _step_trace(), pools, pools).run()
    peak_prefill = max(p for _, p, _ in slo.timeline)
    assert peak_prefill >= 2  # the step needs ~0.9 prefill workers at 100 % busy: more to meet 400 ms
    assert slo.timeline[-1][1] < peak_prefill  # and it drained again after the step
    assert slo.attainment(400, 100) > fixed.attainment(400, 100) + 0.2
    assert slo.reversals_per_minute("prefill") <= 1 and slo.reversals_per_minute("decode") <= 1
    assert percentile(slo.ttft_s(), 50) < 0.4


def test_proportional_policy_runs_the_autoscalers_rule():
    pools = PoolLimits(1, 1, 8)
    specs = {
        "prefill": AutoscalingSpec(target=500, max_replicas=8, interval_s=1, upscale_delay_s=2),
        "decode": AutoscalingSpec(target=0.7, max_replicas=8, interval_s=1),
    }
    result = Simulation(PROFILE, _step_trace(), pools, pools, "proportional", proportional=specs).run()
    assert max(p for _, p, _ in result.timeline) >= 2
    assert all(d == 1 for _, d in result.moves["prefill"][:1])  # it grew first


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="fixed, proportional, slo or elastic"):
        Simulation(PROFILE, [], ONE, ONE, "magic")
    with pytest.raises(ValueError, match="planner spec"):
        Simulation(PROFILE, [], ONE, ONE, "slo")


def test_plan_simulate_cli_prints_a_row_per_policy(capsys):
    from splitserve.cli import main as cli
    from splitserve.cli import plan as plan_cli

    argv = ["plan", "simulate", "--duration", "120", "--policy", "fixed", "slo", "--seed", "5"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out[2:]}
    assert set(rows) == {"fixed", "slo"}
    args = cli.build_parser().parse_args(argv)
    results = plan_cli.run(args)  # the same trace and seed: the same figures
    for policy, r in results.items():
        assert float(rows[policy][3]) == pytest.approx(r.attainment(args.ttft_ms, args.tpot_ms), abs=5e-4)
    assert out[0].startswith(f"{len(results['fixed'].requests)} requests over 120 s")


def test_a_pooled_elastic_worker_prefills_its_own_prompt_at_the_profiles_cost():
    """Elastic, no prefill worker: the decode worker prefills the prompt in its own step
    (no handover), then decodes it."""
    spec = PlannerSpec(ttft_ms=400, tpot_ms=100, interval_s=3600)
    req = SimRequest(arrival_s=3.0, prompt_tokens=800, output_tokens=11)
    result = Simulation(
        PROFILE, [req], PoolLimits(0, 0, 1), PoolLimits(1, 1, 1), "elastic", planner=spec
    ).run()
    assert result.requests[0].local
    assert result.ttft_s() == [pytest.approx(0.01 + 800 / 10_000)]
    assert result.tpot_s() == [pytest.approx(0.021)]


def _shifting_trace():
    """Decode-heavy (5 req/s, 50-token prompts, 100 tokens out) for 60 s, prefill-heavy
    (30 req/s of 900-token prompts, 4 tokens out) for 60 s, decode-heavy for 120 s."""
    light = bursty_trace(240, 5.0, 5.0, 1.0, 1.0, (40, 60), (100, 100), seed=5)
    heavy = bursty_trace(60, 30.0, 30.0, 1.0, 1.0, (900, 900), (4, 4), seed=6)
    light = [r for r in light if not 60 <= r.arrival_s < 120]
    shifted = [SimRequest(r.arrival_s + 60, r.prompt_tokens, r.output_tokens) for r in heavy]
    return sorted(light + shifted, key=lambda r: r.arrival_s)


def test_elastic_roles_follow_a_shifting_load_and_beat_the_fixed_split():
    """Four workers, 2:2 at first: split while the prompts fit one split's prefill
    workers, pooled (no prefill worker) through the prefill-heavy minute, and pooled
    after it, since pooled decoding then meets the TPOT target; more requests meet the
    SLO than with the 2:2 split held fixed, and the roles change a handful of times."""
    spec = PlannerSpec(
        ttft_ms=400, tpot_ms=100, interval_s=2, downscale_delay_s=4, min_reversal_s=10, max_step_fraction=0
    )
    prefill, decode = PoolLimits(2, 0, 3), PoolLimits(2, 1, 4)
    elastic = Simulation(PROFILE, _shifting_trace(), prefill, decode, "elastic", planner=spec).run()
    fixed = Simulation(PROFILE, _shifting_trace(), prefill, decode).run()

    def prefill_at(t0: float, t1: float) -> set[int]:
        return {p for t, p, _ in elastic.timeline if t0 <= t < t1}

    assert prefill_at(20, 60) and 0 not in prefill_at(20, 60)
    assert prefill_at(100, 120) == {0}
    assert prefill_at(200, 240) == {0}
    late = [r.tpot_s for r in elastic.requests if r.spec.arrival_s >= 150 and r.tpot_s is not None]
    assert percentile(late, 90) < 0.1  # pooled meets TPOT: no reason to split
    assert all(p + d <= 4 for _, p, d in elastic.timeline)
    assert elastic.attainment(400, 100) > fixed.attainment(400, 100)
    assert len(elastic.moves["prefill"]) <= 8
