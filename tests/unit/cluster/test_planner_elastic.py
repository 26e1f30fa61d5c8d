"""The SLO planner in elastic mode (``PlannerInput.elastic_workers``): it pools a fixed
set of workers (prefill role at none: every worker prefills its own prompts) unless a
split takes the load and pooled decoding misses the TPOT target, pools them when the
prompts need more cores than a split leaves them, comes back only once the prompt
demand has fallen well below the level that pooled them, and never flaps under a
steady load."""

from __future__ import annotations

import re

from splitserve.cluster.planner import (
    Planner,
    PlannerInput,
    PlannerProfile,
    PlannerSpec,
    PoolView,
    role_switch,
)
from splitserve.router.roles import Role

# elastic bounds: prefill 0-2, decode 1-2; shrinking wanted for 10 s moves a role
SPEC = PlannerSpec(ttft_ms=500, tpot_ms=50, downscale_delay_s=10, min_reversal_s=20, max_step_fraction=0)
# a worker prefills 2000 prompt tokens/s; a decode step is 10 ms + 1 ms per sequence.
# At 200-token prompts (0.1 s each) one prefill worker takes 1778 tok/s within the TTFT target.
PROFILE = PlannerProfile(2000.0, ((1, 0.011), (8, 0.018), (32, 0.042)))


def interval(now, rate, prompt, p, d, n=2, output=10, s=5.0, **kw) -> PlannerInput:
    """``s`` seconds at ``rate`` requests/s of ``prompt`` uncached tokens; with no prefill
    worker (``p`` 0) the decode workers prefilled them, as the live loop reports it."""
    k = int(rate * s)
    fields = dict(
        now=now,
        interval_s=s,
        arrivals=k,
        finished=k,
        prompt_tokens=k * prompt if p else 0,
        local_prompt_tokens=0 if p else k * prompt,
        output_tokens=k * output,
        ttft_p90_s=None,
        tpot_p90_s=None,
        prefill_tokens_per_s=0.0,
        decode_points=(),
        prefill=PoolView(p, 0, 0, 2, 256),
        decode=PoolView(d, 0, 1, 2, 256),
        elastic_workers=n,
    )
    return PlannerInput(**(fields | kw))


def run(planner, start, seconds, rate, prompt, p, d, **kw):
    """Steps the planner every 5 s, switching a worker by the product's rule
    (``planner.role_switch``, as ``PlannerLoop._split`` runs it, each role's
    ``min_replicas`` its floor); returns the roles after each step and where they
    ended. A ``pooled_tpot`` is what the workers measure while pooled (split, they meet
    the target)."""
    roles = []
    for now in range(start, start + seconds, 5):
        tpot = {"tpot_p90_s": kw["pooled_tpot"] if p == 0 else 0.03} if "pooled_tpot" in kw else {}
        more = {k: v for k, v in kw.items() if k != "pooled_tpot"} | tpot
        inp = interval(now, rate, prompt, p, d, **more)
        floors = {Role.PREFILL: inp.prefill.min_replicas, Role.DECODE: inp.decode.min_replicas}
        switch = role_switch(planner.decide(inp), {Role.PREFILL: p, Role.DECODE: d}, floors)
        if switch is not None:
            giver, _ = switch
            p, d = (p + 1, d - 1) if giver == Role.DECODE else (p - 1, d + 1)
        roles.append((p, d))
    return roles, p, d


def test_a_split_that_takes_the_load_stays_split_under_a_steady_load():
    planner = Planner(SPEC, PROFILE)
    roles, _, _ = run(planner, 0, 300, rate=4, prompt=200, p=1, d=1)  # 800 prompt tok/s
    assert set(roles) == {(1, 1)}
    assert "split" in planner.decide(interval(300, 4, 200, 1, 1)).prefill.reason


def test_prompts_that_need_more_cores_than_the_split_leaves_pool_every_worker():
    planner = Planner(SPEC, PROFILE)
    first = planner.decide(interval(0, 10, 200, 1, 1))  # 2000 tok/s: two prefill workers' worth
    assert (first.prefill.desired, first.decode.desired) == (0, 2)
    assert first.prefill.reason.startswith("pooled: the split needs 2 prefill + 1 decode of 2")
    assert (first.prefill.target, first.decode.target) == (1, 2)  # decode grows now, prefill shrinks late
    roles, p, d = run(planner, 5, 300, rate=10, prompt=200, p=1, d=1)
    assert (p, d) == (0, 2)
    switches = sum(a != b for a, b in zip(roles, roles[1:], strict=False))
    assert switches == 1  # once to pooled, and never back under the same load


def test_pooled_workers_split_again_only_once_the_prompt_demand_falls_well_below():
    planner = Planner(SPEC, PROFILE)
    _, p, d = run(planner, 0, 60, rate=10, prompt=200, p=1, d=1)
    assert (p, d) == (0, 2)
    # 1600 tok/s: one prefill worker could take it (1778), but it is above 0.7 x 2000, and
    # the demand it was pooled at is what it must fall below 0.7x of
    # (pooled decoding misses TPOT throughout, so only the demand holds it pooled)
    roles, p, d = run(planner, 60, 300, rate=8, prompt=200, p=0, d=2, pooled_tpot=0.08)
    assert set(roles) == {(0, 2)}
    reason = planner.decide(interval(360, 8, 200, 0, 2, tpot_p90_s=0.08)).prefill.reason
    assert re.search(r"pooled until under \d+ tok/s", reason)
    roles, p, d = run(planner, 365, 300, rate=5, prompt=200, p=0, d=2, pooled_tpot=0.08)  # 1000 tok/s
    assert (p, d) == (1, 1)
    assert sum(a != b for a, b in zip(roles, roles[1:], strict=False)) == 1


def test_a_missed_ttft_pools_only_when_prompts_queue_at_the_prefill_workers():
    planner = Planner(SPEC, PROFILE)
    # a lone long prompt missed the target, nothing waits: another prefill core would not help
    lone = planner.decide(interval(0, 1, 200, 1, 1, ttft_p90_s=2.0, queued_prompt_tokens=500))
    assert lone.prefill.desired == 1 and lone.prefill.reason.startswith("split")
    # nor one long prompt waiting longer than the target: it is no queue
    long = planner.decide(
        interval(5, 1, 200, 1, 1, ttft_p90_s=2.0, queued_prompt_tokens=4000, queued_requests=1)
    )
    assert long.prefill.desired == 1 and long.prefill.reason.startswith("split")
    # a burst of cold prompts waits longer than the target to prefill: the split fell short
    burst = planner.decide(
        interval(10, 1, 200, 1, 1, ttft_p90_s=2.0, queued_prompt_tokens=4000, queued_requests=4)
    )
    assert burst.prefill.desired == 0 and "p90 2000 ms > 500 ms" in burst.prefill.reason
    # and stays pooled under the same arrivals once the burst has been prefilled
    roles, p, d = run(planner, 15, 120, rate=1, prompt=200, p=1, d=1)
    assert set(roles[roles.index((0, 2)) :]) == {(0, 2)}


def test_more_workers_are_shared_in_proportion_to_need_and_decode_keeps_one():
    planner = Planner(SPEC.model_copy(update={"max_step": 4}), PROFILE)
    spec = dict(n=4, prefill=PoolView(2, 0, 0, 4, 256), decode=PoolView(2, 0, 1, 4, 256))
    d = planner.decide(interval(0, 6, 200, 2, 2, **spec))  # 1200 tok/s: one prefill worker's worth
    assert (d.prefill.desired, d.decode.desired) == (2, 2)  # 1:1 need, four workers
    d = planner.decide(interval(5, 16, 200, 2, 2, **spec))  # 3200 tok/s: two
    assert (d.prefill.desired, d.decode.desired) == (3, 1)


def test_with_no_load_the_roles_stay_as_they_are():
    planner = Planner(SPEC, PROFILE)
    for p, d in [(0, 2), (1, 1)]:
        roles, _, _ = run(planner, 0, 60, rate=0, prompt=0, p=p, d=d)
        assert set(roles) == {(p, d)}


def test_pooled_workers_that_meet_the_tpot_target_stay_pooled_where_a_split_would_fit():
    planner = Planner(SPEC, PROFILE)
    roles, p, d = run(planner, 0, 120, rate=2, prompt=200, p=0, d=2, pooled_tpot=0.03)
    assert set(roles) == {(0, 2)}  # 400 tok/s fits one prefill worker, but nothing to gain
    assert (
        "pooled decoding meets the TPOT target" in planner.decide(interval(120, 2, 200, 0, 2)).prefill.reason
    )
    roles, p, d = run(planner, 125, 20, rate=2, prompt=200, p=0, d=2, pooled_tpot=0.08)
    assert (p, d) == (1, 1)  # their prompts stall their decoding past the target: split
    roles, p, d = run(planner, 145, 120, rate=2, prompt=200, p=1, d=1, pooled_tpot=0.08)
    assert set(roles) == {(1, 1)}  # and split (meeting TPOT) it stays
