"""Routing policy: which prefill and decode worker a request goes to."""

from splitserve.router.balancer import WorkerRef, pick_decode, pick_prefill


def _w(wid, role="prefill", **kw):
    return WorkerRef(wid, role, handle=None, **kw)


def test_prefill_least_queued_tokens_and_skips_draining_and_dead():
    a, b, c = _w("a", queued_prompt_tokens=500), _w("b", queued_prompt_tokens=100), _w("c")
    c.draining = True
    assert pick_prefill([a, b, c], [1, 2, 3]) is b
    b.alive = False
    assert pick_prefill([a, b, c], [1, 2, 3]) is a
    a.draining = True
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
    first.queued_prompt_tokens = 10_000
    assert pick_prefill(workers, prompt, prefix_affinity=True, affinity_slack_tokens=2048) is not first


def test_decode_most_free_tokens_after_reservations():
    a = _w("a", "decode", free_blocks=100, block_size=16)
    b = _w("b", "decode", free_blocks=60, block_size=16)
    assert pick_decode([a, b], 10) is a
    a.reserved_tokens = 1000  # requests sent since the last stats poll
    assert pick_decode([a, b], 10) is b
    # When nothing fits, the least-full worker still gets it (it waits for room).
    assert pick_decode([a, b], 100_000) is b
    assert pick_decode([], 1) is None
