"""Routing policy: which prefill and decode worker a request goes to, by load and by
the prefixes workers report cached."""

from splitserve.router.balancer import Prompt, pick_decode, pick_prefill
from splitserve.router.registry import Membership, WorkerRecord, WorkerRegistry
from splitserve.wire.prefix import PrefixUpdate, prompt_block_hashes
from tests.unit.router.fakes import record as _w


def _holds(w: WorkerRecord, token_ids: list[int]) -> WorkerRecord:
    """``w`` reported (on its last poll) the full blocks of ``token_ids`` as cached."""
    hashes = prompt_block_hashes(token_ids, w.block_size)
    w.prefix.apply(PrefixUpdate("epoch", len(hashes), tuple((h, True) for h in hashes), snapshot=True))
    return w


def _p(token_ids: list[int]) -> Prompt:
    return Prompt.of(token_ids, 16)


def test_prefill_least_queued_tokens_and_skips_draining_and_dead():
    a, b, c = _w("a", queued=500), _w("b", queued=100), _w("c")
    c.state = Membership.DRAINING
    assert pick_prefill([a, b, c], _p([1, 2, 3])) is b
    b.alive = False
    assert pick_prefill([a, b, c], _p([1, 2, 3])) is a
    a.state = Membership.STARTING
    assert pick_prefill([a, b, c], _p([1, 2, 3])) is None


def test_prefill_counts_a_cached_prefix_against_the_queue():
    prompt = list(range(1000))
    a, b = _w("a", queued=300), _holds(_w("b", queued=500), prompt[:512])
    # b would compute 500 queued + 1000 - 512 cached = 988 tokens; a 1300.
    assert pick_prefill([a, b], _p(prompt)) is b
    # A longer queue outweighs the cache.
    b.prefilling["more"] = 400
    assert pick_prefill([a, b], _p(prompt)) is a
    # A different prompt (another first block) finds nothing cached on b.
    b.prefilling.pop("more")
    assert pick_prefill([a, b], _p([7] + prompt[1:])) is a


def test_prefix_affinity_is_sticky_until_the_preferred_worker_is_much_busier():
    workers = [_w(f"p{i}") for i in range(4)]
    prompt = list(range(40))
    first = pick_prefill(workers, _p(prompt), prefix_affinity=True)
    # The same first block maps to the same worker, whatever follows it.
    assert pick_prefill(workers, _p(prompt[:16] + [999] * 30), prefix_affinity=True) is first
    # Different first blocks spread over workers.
    chosen = {pick_prefill(workers, _p([i] * 16), prefix_affinity=True).worker_id for i in range(40)}
    assert len(chosen) > 1
    first.prefilling["other"] = 10_000
    assert pick_prefill(workers, _p(prompt), prefix_affinity=True, affinity_slack_tokens=2048) is not first


def test_prefix_affinity_yields_to_a_worker_that_reports_the_prefix():
    workers = [_w(f"p{i}") for i in range(4)]
    prompt = list(range(40))
    preferred = pick_prefill(workers, _p(prompt), prefix_affinity=True)
    other = next(w for w in workers if w is not preferred)
    _holds(other, prompt)
    assert pick_prefill(workers, _p(prompt), prefix_affinity=True) is other


def test_decode_most_free_tokens_after_reservations():
    a = _w("a", "decode", free_blocks=100, num_blocks=100, block_size=16)
    b = _w("b", "decode", free_blocks=60, num_blocks=100, block_size=16)
    assert pick_decode([a, b], _p([1] * 10), 10) is a
    registry = WorkerRegistry()
    with registry.decoding(a, "r1", 1000):  # a request sent since the last stats poll
        assert a.reserved_tokens == 1000
        assert pick_decode([a, b], _p([1] * 10), 10) is b
        # When nothing fits, the least-full worker still gets it (it waits for room).
        assert pick_decode([a, b], _p([1] * 10), 100_000) is b
    assert a.reserved_tokens == 0
    assert pick_decode([], _p([1]), 1) is None


def test_decode_prefers_the_worker_holding_the_prompt_unless_it_cannot_fit_it():
    prompt = list(range(300))
    a = _w("a", "decode", free_blocks=100, num_blocks=100)
    b = _holds(_w("b", "decode", free_blocks=70, num_blocks=100, active=1), prompt)
    assert pick_decode([a, b], _p(prompt), 301) is b
    # Without room for the sequence, a cached prefix does not help.
    assert pick_decode([a, b], _p(prompt), 70 * 16 + 1) is a
