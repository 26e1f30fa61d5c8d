"""The disaggregation decider on constructed situations: where a prompt is prefilled
given its length, the queues, the cached prefixes and the measured rates."""

import pytest

from splitserve.router.balancer import Prompt
from splitserve.router.decider import Decider, Placement, Reason
from splitserve.router.policy import PolicySpec
from splitserve.wire.prefix import PrefixUpdate, prompt_block_hashes
from tests.unit.router.fakes import record

RATE = 1000.0  # prompt tokens per second, as a worker reports it
STEP_S = 0.03  # the decode worker's decode step, as it reports it
POLICY = PolicySpec(local_prefill_max_stall_steps=10)  # 300 ms at STEP_S


def _decode(running: int = 8, queued: int = 0, rate: float = RATE, step_s: float = STEP_S):
    return record(
        "d",
        "decode",
        free_blocks=1000,
        num_blocks=1000,
        running=running,
        queued=queued,
        prefill_rate=rate,
        decode_step=(running, step_s),
    )


def _prefill(queued: int = 0, rate: float = RATE):
    return record("p", "prefill", queued=queued, prefill_rate=rate)


def _decider(handover_s: float = 0.05) -> Decider:
    decider = Decider()
    decider.observe_handover(handover_s)
    return decider


def _prompt(n: int) -> Prompt:
    return Prompt.of(list(range(n)), 16)


def test_a_prompt_whose_prefill_costs_less_than_the_handover_is_prefilled_in_place():
    # 40 tokens take 40 ms here, the handover 50 ms: the request gains 50 ms and costs
    # the decoding batch 40.
    d = _decider().decide(POLICY, _prompt(40), _decode(), _prefill())
    assert (d.placement, d.reason) == (Placement.LOCAL, Reason.GAIN)
    assert d.stall_s == pytest.approx(0.04)
    assert d.remote_s - d.local_s == pytest.approx(0.05)


def test_a_longer_prompt_goes_to_an_idle_prefill_worker():
    # 200 tokens: 200 ms of stall for a 50 ms gain.
    d = _decider().decide(POLICY, _prompt(200), _decode(), _prefill())
    assert (d.placement, d.reason) == (Placement.REMOTE, Reason.NO_GAIN)


def test_a_queued_prefill_pool_makes_local_prefill_pay():
    # The prefill worker has 1000 tokens ahead: remote finishes 1.05 s after local.
    d = _decider().decide(POLICY, _prompt(200), _decode(), _prefill(queued=1000))
    assert (d.placement, d.reason) == (Placement.LOCAL, Reason.GAIN)
    # ...unless the decode worker itself has prompts queued as long.
    d = _decider().decide(POLICY, _prompt(200), _decode(queued=1200), _prefill(queued=1000))
    assert d.placement == Placement.REMOTE


def test_a_prefix_the_decode_worker_holds_is_prefilled_there():
    tokens = list(range(400))
    decode = _decode()
    hashes = prompt_block_hashes(tokens[:384], 16)
    decode.prefix.apply(PrefixUpdate("e", len(hashes), tuple((h, True) for h in hashes), snapshot=True))
    d = _decider().decide(POLICY, Prompt.of(tokens, 16), decode, _prefill())
    # 16 uncached tokens (the last block is always computed) against 400 + handover.
    assert (d.placement, d.reason) == (Placement.LOCAL, Reason.GAIN)
    assert d.stall_s == pytest.approx(0.016)
    # The same prompt without the cache goes out.
    assert (
        _decider().decide(POLICY, Prompt.of(tokens, 16), _decode(), _prefill()).placement == Placement.REMOTE
    )


def test_the_stall_budget_is_counted_in_the_decode_workers_own_steps():
    # 200 tokens stall for 200 ms; a queued pool makes the request gain more than that.
    queued = _prefill(queued=1000)
    d = _decider().decide(POLICY, _prompt(200), _decode(step_s=0.03), queued)
    assert (d.placement, d.reason, d.budget_s) == (Placement.LOCAL, Reason.GAIN, pytest.approx(0.3))
    # A decode worker whose steps take 15 ms allows 150 ms: too short for this prompt.
    d = _decider().decide(POLICY, _prompt(200), _decode(step_s=0.015), queued)
    assert (d.placement, d.reason, d.budget_s) == (Placement.REMOTE, Reason.STALL_CAP, pytest.approx(0.15))
    # A machine twice as fast at both (2000 tok/s, 15 ms steps) decides as the first one.
    fast = _decider().decide(POLICY, _prompt(200), _decode(rate=2000, step_s=0.015), _prefill(1000, 2000))
    assert (fast.placement, fast.reason) == (Placement.LOCAL, Reason.GAIN)
    assert fast.stall_s == pytest.approx(0.1)
    # The budget bounds every prompt waiting at the decode worker, this one's included:
    # 150 tokens queued there already and these 200 hold up its batch for 350 ms.
    d = _decider().decide(POLICY, _prompt(200), _decode(queued=150), queued)
    assert (d.placement, d.reason) == (Placement.REMOTE, Reason.STALL_CAP)
    assert (d.stall_s, d.local_s) == (pytest.approx(0.2), pytest.approx(0.35))
    # No step measured yet: no budget, even on an idle decode worker (the floor still applies).
    for running in (0, 8):
        d = _decider().decide(POLICY, _prompt(20), _decode(running=running, step_s=0.0), queued)
        assert (d.placement, d.reason) == (Placement.REMOTE, Reason.STALL_CAP)
    floor = POLICY.model_copy(update={"local_prefill_below_tokens": 32})
    assert _decider().decide(floor, _prompt(20), _decode(step_s=0.0), queued).placement == Placement.LOCAL
    # A fixed budget in milliseconds overrides the steps.
    fixed = PolicySpec(local_prefill_max_stall_ms=250)
    d = _decider().decide(fixed, _prompt(200), _decode(step_s=0.0), queued)
    assert (d.placement, d.budget_s) == (Placement.LOCAL, pytest.approx(0.25))


def test_with_a_tpot_target_the_stall_budget_is_the_slack_the_steps_leave():
    queued = _prefill(queued=1000)
    slo = POLICY.model_copy(update={"stall_tpot_ms": 50})
    # 30 ms steps against a 50 ms TPOT: 10 steps leave 10 x 20 ms = 200 ms for a stall, so
    # the 10 steps and the stall take 500 ms, the target's mean; a 200-token prompt fits
    d = _decider().decide(slo, _prompt(200), _decode(step_s=0.03), queued)
    assert (d.placement, d.reason, d.budget_s) == (Placement.LOCAL, Reason.GAIN, pytest.approx(0.2))
    # a busier worker (40 ms steps) has 100 ms of slack: the prompt goes to the prefill pool
    d = _decider().decide(slo, _prompt(200), _decode(step_s=0.04), queued)
    assert (d.placement, d.reason, d.budget_s) == (Placement.REMOTE, Reason.STALL_CAP, pytest.approx(0.1))
    # steps that already take the target leave nothing, whatever the gain
    d = _decider().decide(slo, _prompt(10), _decode(step_s=0.06), _prefill(queued=5000))
    assert (d.placement, d.budget_s) == (Placement.REMOTE, 0.0)
    # a looser target gives more: at 100 ms, 10 x 70 ms
    loose = POLICY.model_copy(update={"stall_tpot_ms": 100})
    assert _decider().decide(loose, _prompt(200), _decode(), queued).budget_s == pytest.approx(0.7)


def test_the_stall_budget_caps_local_prefill_however_queued_the_pool():
    d = _decider().decide(POLICY, _prompt(2048), _decode(), _prefill(queued=100_000))
    assert (d.placement, d.reason) == (Placement.REMOTE, Reason.STALL_CAP)
    d = _decider().decide(
        PolicySpec(local_prefill_max_stall_ms=5000), _prompt(2048), _decode(), _prefill(queued=100_000)
    )
    assert d.placement == Placement.LOCAL


def test_an_idle_decode_worker_takes_whatever_it_finishes_sooner_within_the_budget():
    d = _decider().decide(POLICY, _prompt(250), _decode(running=0), _prefill())
    assert (d.placement, d.reason) == (Placement.LOCAL, Reason.DECODE_IDLE)
    # 150 tokens queued at the decode worker: 250 ms there, 150 on the prefill worker.
    d = _decider().decide(POLICY, _prompt(100), _decode(running=0, queued=150), _prefill())
    assert (d.placement, d.reason) == (Placement.REMOTE, Reason.DECODE_IDLE)


def test_fixed_rules_before_the_cost_model():
    decider = _decider()
    assert decider.decide(POLICY, _prompt(5000), _decode(), None, colocated=True).reason == Reason.COLOCATED
    assert decider.decide(POLICY, _prompt(5000), _decode(), None).reason == Reason.NO_PREFILL_WORKER
    floor = PolicySpec(local_prefill_below_tokens=64)
    d = decider.decide(floor, _prompt(63), _decode(), _prefill())
    assert (d.placement, d.reason) == (Placement.LOCAL, Reason.BELOW_THRESHOLD)
    # Nothing measured yet: only the floor decides.
    d = decider.decide(POLICY, _prompt(40), _decode(rate=0.0), _prefill(rate=0.0))
    assert (d.placement, d.reason) == (Placement.REMOTE, Reason.FIXED_POLICY)
    off = PolicySpec(conditional_disaggregation=False)
    assert decider.decide(off, _prompt(40), _decode(), _prefill()).reason == Reason.FIXED_POLICY
    # Off too, a prefill pool with no routable worker is worked around: the cluster serves.
    assert decider.decide(off, _prompt(40), _decode(), None).reason == Reason.NO_PREFILL_WORKER
    # A rate measured on either side is used for both.
    d = decider.decide(POLICY, _prompt(40), _decode(rate=0.0), _prefill())
    assert d.placement == Placement.LOCAL
    assert decider.counts[Placement.REMOTE, Reason.FIXED_POLICY] == 2


def test_the_handover_estimate_follows_measurements():
    decider = Decider()
    assert decider.handover_s == 0.0  # unmeasured: remote looks as cheap as it can be
    decider.observe_handover(0.1)
    assert decider.handover_s == pytest.approx(0.1)
    for _ in range(30):
        decider.observe_handover(0.02)
    assert decider.handover_s == pytest.approx(0.02, rel=0.05)


def _holding(wid: str, prompt: Prompt, blocks: int, rate: float = 0.0):
    w = record(wid, "prefill", prefill_rate=rate)
    held = prompt.block_hashes[:blocks]
    w.prefix.apply(PrefixUpdate("e", len(held), tuple((h, True) for h in held), snapshot=True))
    return w


def test_a_prefill_worker_copies_a_prefix_only_where_computing_it_costs_more_than_a_handover():
    prompt = _prompt(1030)  # 64 full blocks
    p = _holding("p", prompt, 4)  # no rate measured yet: the holder's is used
    h1, h2 = _holding("h1", prompt, 40, rate=RATE), _holding("h2", prompt, 60, rate=RATE)
    # h2 holds 896 tokens more than p: 0.9 s to compute against a 50 ms handover
    assert _decider().pull_source(prompt, p, [h1, h2]) is h2
    # a handover of a second: computing 0.9 s is cheaper
    assert _decider(handover_s=1.0).pull_source(prompt, p, [h1, h2]) is None
    # nobody holds more than p, or no rate is known anywhere
    assert _decider().pull_source(prompt, _holding("p", prompt, 60), [h1, h2]) is None
    assert _decider().pull_source(prompt, p, [_holding("h", prompt, 60)]) is None
    assert _decider().pull_source(prompt, p, []) is None
