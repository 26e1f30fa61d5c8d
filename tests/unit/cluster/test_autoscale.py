"""The per-phase autoscaling policy, without Ray: load, desired size, hysteresis."""

import pytest

from splitserve.cluster.autoscale import ScaleDecision, desired_replicas, pool_load
from splitserve.cluster.config import AutoscalingSpec
from splitserve.router.registry import Membership
from tests.unit.router.fakes import record


def spec(**kw):
    base = dict(min_replicas=1, max_replicas=4, target=0.5, upscale_delay_s=2, downscale_delay_s=10)
    return AutoscalingSpec(**(base | kw))


def test_load_per_phase():
    p = [record("p0", "prefill", queued=3000), record("p1", "prefill")]
    assert pool_load("prefill", p, 64) == 1500
    d0 = record("d0", "decode", free_blocks=25, num_blocks=100, active=2)  # KV 75% used
    d1 = record("d1", "decode", free_blocks=100, num_blocks=100, active=8)  # 8/16 seqs
    assert pool_load("decode", [d0, d1], 16) == pytest.approx((0.75 + 0.5) / 2)
    d1.state = Membership.DRAINING  # a draining worker no longer counts
    assert pool_load("decode", [d0, d1], 16) == pytest.approx(0.75)
    assert pool_load("decode", [], 16) == 0.0


def test_desired_replicas_is_proportional_and_clamped():
    s = spec()
    assert desired_replicas(2, 0.5, s) == 2
    assert desired_replicas(2, 1.0, s) == 4
    assert desired_replicas(2, 5.0, s) == 4  # max_replicas
    assert desired_replicas(3, 0.2, s) == 2
    assert desired_replicas(3, 0.0, s) == 1  # min_replicas


def test_hysteresis_one_step_at_a_time():
    now = [0.0]
    d = ScaleDecision(spec(), clock=lambda: now[0])
    assert d.update(1, 2.0) is None  # wanted, not yet for long enough
    now[0] = 1.0
    assert d.update(1, 2.0) is None
    now[0] = 2.0
    assert d.update(1, 2.0) == 2  # one step, not straight to 4
    now[0] = 2.5
    assert d.update(2, 0.1) is None  # shrinking needs 10 s
    now[0] = 5.0
    assert d.update(2, 0.5) is None  # load back at target: the clock resets
    now[0] = 6.0
    assert d.update(2, 0.1) is None
    now[0] = 15.9
    assert d.update(2, 0.1) is None
    now[0] = 16.0
    assert d.update(2, 0.1) == 1


def test_spec_is_validated():
    with pytest.raises(ValueError, match="min_replicas"):
        spec(min_replicas=3, max_replicas=2)
