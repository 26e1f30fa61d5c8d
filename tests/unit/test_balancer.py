"""Routing policy: which prefill and decode worker a request goes to."""

from splitserve.router.balancer import pick_decode, pick_prefill
from splitserve.router.registry import Membership, WorkerRegistry
from tests.unit.router_fakes import record as _w


def test_prefill_least_queued_tokens_and_skips_draining_and_dead():
    a, b, c = _w("a", queued=500), _w("b", queued=100), _w("c")
    c.state = Membership.DRAINING
    assert pick_prefill([a, b, c], [1, 2, 3]) is b
    b.alive = False
    assert pick_prefill([a, b, c], [1, 2, 3]) is a
    a.state = Membership.STARTING
    assert pick_prefill([a, b, c], [1, 2, 3]) is None


def test_prefix_affinity_is_sticky_until_the_preferred_worker_is_much_busier():
    workers = [_w(f"p{i}") for i in range(4)]
    prompt = list(range(40))
    first = pick_prefill(workers, prompt, prefix_affinity=True)
    # The same first block maps to the same worker, whatever follows it.
    assert pick_prefill(workers, prompt[:16] + [999] * 30, prefix_affinity=True) is first
    # Different first blocks spread over workers.
    chosen = {pick_prefill(workers, [i] * 16, prefix_affinity=True).worker_id for i in range(40)}
    assert len(chosen) > 1
    first.prefilling["other"] = 10_000
    assert pick_prefill(workers, prompt, prefix_affinity=True, affinity_slack_tokens=2048) is not first


def test_decode_most_free_tokens_after_reservations():
    a = _w("a", "decode", free_blocks=100, num_blocks=100, block_size=16)
    b = _w("b", "decode", free_blocks=60, num_blocks=100, block_size=16)
    assert pick_decode([a, b], 10) is a
    registry = WorkerRegistry()
    with registry.decoding(a, "r1", 1000):  # a request sent since the last stats poll
        assert a.reserved_tokens == 1000
        assert pick_decode([a, b], 10) is b
        # When nothing fits, the least-full worker still gets it (it waits for room).
        assert pick_decode([a, b], 100_000) is b
    assert a.reserved_tokens == 0
    assert pick_decode([], 1) is None
