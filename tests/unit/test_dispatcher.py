"""The dispatcher without Ray: the request path against fake worker clients
(``tests.unit.router_fakes``), whose "model" is a fixed next-token rule, so
every output has an exact expected value.

Retry of a lost prefill worker, resumption after a lost decode worker (no
token repeated or skipped), admission limits, confirmations forwarded,
handshakes once per peer pair, and the registry's load bookkeeping returning
to zero after 1,000 requests with random cancels and errors."""

from __future__ import annotations

import asyncio
import random

import pytest

from splitserve.engine import InvalidRequest, Overloaded, SamplingParams
from splitserve.router.decider import Placement, Reason
from splitserve.router.dispatch import Dispatcher
from splitserve.router.errors import WorkerLost
from splitserve.router.events import FinalEvent, GenerateInput, TokenEvent
from splitserve.router.policy import LimitsSpec, PolicySpec
from splitserve.router.registry import WorkerRegistry
from tests.unit.router_fakes import VALIDATOR, FakeDecode, FakePrefill, expected_tokens


def _cluster(prefills, decodes, **limits) -> Dispatcher:
    registry = WorkerRegistry()

    async def setup():
        for role, fakes in (("prefill", prefills), ("decode", decodes)):
            for fake in fakes:
                registry.add(fake.worker_id, role, fake, 16)
                await registry.activate(fake.worker_id)

    asyncio.run(setup())
    return Dispatcher(registry, VALIDATOR, "tiny", limits=LimitsSpec(**limits))


async def _collect(d: Dispatcher, prompt, max_tokens=8, **kw) -> tuple[list[int], FinalEvent]:
    tokens, final = [], None
    inp = GenerateInput(SamplingParams(max_tokens=max_tokens), prompt=prompt, **kw)
    async for event in d.generate(inp):
        if isinstance(event, TokenEvent):
            tokens.extend(event.token_ids)
        else:
            final = event
    return tokens, final


def _lost(task):
    raise WorkerLost("the actor died")


def test_lost_prefill_worker_is_retried_on_another():
    p0, p1 = FakePrefill("p0", fail=_lost), FakePrefill("p1")
    d = _cluster([p0, p1], [FakeDecode("d0")])
    prompt = [5, 6, 7]
    tokens, final = asyncio.run(_collect(d, prompt))
    assert len(p0.calls) == 1 and len(p1.calls) == 1  # p0 (first of two idle ones) lost it; p1 served it
    assert tokens == expected_tokens(prompt, 8)
    assert final.prefill_worker == "p1" and final.decode_worker == "d0"


def test_lost_decode_worker_mid_stream_resumes_elsewhere_without_repeating():
    d0, d1 = FakeDecode("d0", batch=2, lose_after=4), FakeDecode("d1")
    d = _cluster([FakePrefill("p0")], [d0, d1])
    d.registry.get("d1").decoding["other"] = 10**6  # d0 looks emptier: it is chosen first
    d.registry.get("d1").unpolled.add("other")
    prompt = [1, 2, 3, 4]
    tokens, final = asyncio.run(_collect(d, prompt, max_tokens=10))
    assert tokens == expected_tokens(prompt, 10)  # nothing repeated, nothing skipped
    assert final.decode_worker == "d1" and final.completion_tokens == 10
    (resumed,) = d1.calls
    sent = expected_tokens(prompt, 5)  # the prefill token and d0's two batches
    assert resumed.prompt_token_ids == prompt and resumed.output_token_ids == sent
    assert resumed.handoff is None and resumed.params.max_tokens == 10  # the sent tokens count
    assert d0.aborted == [final_id := resumed.request_id] and final_id in d1.aborted


def test_a_request_whose_prefill_workers_were_all_lost_is_prefilled_by_its_decode_worker():
    p0 = FakePrefill("p0", fail=_lost)
    d = _cluster([p0], [d0 := FakeDecode("d0")])
    d.policy = PolicySpec(conditional_disaggregation=False)  # the fallback is not a policy
    tokens, final = asyncio.run(_collect(d, [1, 2]))
    assert len(p0.calls) == 1 and tokens == expected_tokens([1, 2], 8) and final.prefill_worker == ""
    (task,) = d0.calls
    assert task.handoff is None and task.output_token_ids == []  # d0 prefilled it
    assert d.decider.counts[Placement.LOCAL, Reason.NO_PREFILL_WORKER] == 1


def test_no_decode_worker_and_lost_twice_fail_clearly():
    d = _cluster([FakePrefill("p0")], [])
    with pytest.raises(WorkerLost, match="no decode worker"):
        asyncio.run(_collect(d, [1, 2]))
    d = _cluster([FakePrefill("p0")], [FakeDecode("d0", lose_after=1)])
    with pytest.raises(WorkerLost):  # the only decode worker is lost: nowhere to resume
        asyncio.run(_collect(d, [1, 2]))


def test_without_a_prefill_worker_the_decode_worker_prefills_whatever_the_policy():
    d = _cluster([], [FakeDecode("d0")])
    tokens, final = asyncio.run(_collect(d, [3, 4, 5]))
    assert tokens == expected_tokens([3, 4, 5], 8) and final.prefill_worker == ""
    d.policy = PolicySpec(conditional_disaggregation=False)
    tokens, final = asyncio.run(_collect(d, [3, 4, 5]))
    assert tokens == expected_tokens([3, 4, 5], 8) and final.prefill_worker == ""


def test_admission_limits():
    d = _cluster([FakePrefill("p0", delay_s=0.05)], [FakeDecode("d0")], max_inflight_requests=2)

    async def run():
        first = [asyncio.ensure_future(_collect(d, [i, 1])) for i in range(2)]
        await asyncio.sleep(0.01)  # both admitted, prefilling
        assert len(d.inflight) == 2
        with pytest.raises(Overloaded, match="capacity"):
            await _collect(d, [9, 9])
        await asyncio.gather(*first)
        assert await _collect(d, [9, 9])  # room again

    asyncio.run(run())
    d = _cluster([FakePrefill("p0", delay_s=0.05)], [FakeDecode("d0")], max_queued_prompt_tokens=100)

    async def queued():
        busy = asyncio.ensure_future(_collect(d, list(range(80))))
        await asyncio.sleep(0.01)
        assert d.registry.get("p0").queued_prompt_tokens == 80
        with pytest.raises(Overloaded, match="prefill queues are full"):
            await _collect(d, list(range(30)))
        await busy

    asyncio.run(queued())
    with pytest.raises(InvalidRequest, match="unknown model"):
        asyncio.run(_collect(d, [1], model="gpt-5"))


def test_a_request_is_refused_at_once_when_every_decode_worker_has_its_batch():
    decodes = [FakeDecode("d0", step_s=0.01), FakeDecode("d1", step_s=0.01)]
    d = _cluster([FakePrefill("p0", delay_s=0.05)], decodes, max_decode_batch=1)
    workers = d.registry.workers("decode")

    async def picked():  # both requests picked their decode worker
        while sum(len(w.assigned) for w in workers) < 2:
            await asyncio.sleep(0.001)

    async def run():
        busy = [asyncio.ensure_future(_collect(d, [i, 1])) for i in range(2)]
        await asyncio.wait_for(picked(), 60)
        assert [len(w.assigned) for w in workers] == [1, 1]  # one each, counted from the pick
        assert all(w.queued_prompt_tokens == 0 for w in workers)  # still prefilling elsewhere
        with pytest.raises(Overloaded, match="max_decode_batch"):
            await _collect(d, [9, 9])
        await asyncio.gather(*busy)
        assert not any(w.assigned for w in workers)
        tokens, _ = await _collect(d, [9, 9])  # room again
        assert tokens == expected_tokens([9, 9], 8)

    asyncio.run(run())


def test_admission_by_tpot_caps_each_decode_worker_at_the_batch_its_step_times_allow():
    # d0 reports steps of 12 ms at 1 sequence and 18 ms at 4: 10 ms + 2 ms per sequence,
    # so a 14.5 ms TPOT allows it 2 requests; d1 has not reported a decode step yet
    d0 = FakeDecode("d0", step_s=0.01, decode_steps=[(1, 0.012), (4, 0.018)])
    d1 = FakeDecode("d1", step_s=0.01)
    d = _cluster([FakePrefill("p0", delay_s=0.05)], [d0, d1], decode_tpot_ms=14.5)
    w0, w1 = d.registry.workers("decode")

    async def picked(n):
        while len(w0.assigned) + len(w1.assigned) < n:
            await asyncio.sleep(0.001)

    async def run():
        await d.registry.poll()
        await d.registry.poll()
        assert w0.steps.largest_batch(0.0145) == 2 and w1.steps.largest_batch(0.0145) is None
        assert d.batch_caps() == {"d0": 2}  # what /metrics shows
        d.registry.drain("d1")  # d0 alone: its cap decides
        busy = [asyncio.ensure_future(_collect(d, [i, 1])) for i in range(2)]
        await asyncio.wait_for(picked(2), 60)
        with pytest.raises(Overloaded, match="decode_tpot_ms 14.5"):
            await _collect(d, [9, 9])
        await asyncio.gather(*busy)
        tokens, _ = await _collect(d, [9, 9])  # room again
        assert tokens == expected_tokens([9, 9], 8)

    asyncio.run(run())


def test_confirmations_reach_the_prefill_worker():
    p0 = FakePrefill("p0")
    d = _cluster([p0], [FakeDecode("d0")])
    asyncio.run(_collect(d, [3, 3, 3]))
    (conf,) = p0.confirmed
    assert conf.source_worker == "p0" and conf.transfer_id.endswith(":t")


def test_handshakes_once_per_pair_and_again_after_a_restart():
    p0, d0 = FakePrefill("p0"), FakeDecode("d0")
    d = _cluster([p0], [d0])

    async def run(n):
        for i in range(n):
            await _collect(d, [i, 2, 3], max_tokens=3)

    asyncio.run(run(10))
    assert d0.connect_calls == 1 and p0.info_calls == 1  # info: once, when the worker joined
    p0.restart()  # a new incarnation: the registry asks it again, the decode worker is linked again
    asyncio.run(run(5))
    assert d0.connect_calls == 2 and p0.info_calls == 2
    d0.restart()  # the decode worker lost its handshakes: it says so, the router links again
    tokens, _ = asyncio.run(_collect(d, [4, 4], max_tokens=5))
    assert tokens == expected_tokens([4, 4], 5) and d0.connect_calls == 3


def test_reservations_return_to_zero_after_1000_requests_with_cancels_and_errors():
    rng = random.Random(0)

    def flaky_prefill(task):
        if rng.random() < 0.05:
            raise WorkerLost("flaky prefill")

    def flaky_decode(task):
        if rng.random() < 0.05:
            raise RuntimeError("a bug in the decode worker")

    prefills = [FakePrefill(f"p{i}", fail=flaky_prefill) for i in range(2)]
    decodes = [FakeDecode(f"d{i}", fail=flaky_decode, step_s=0.0005) for i in range(2)]
    decodes.append(FakeDecode("d2", lose_after=2, step_s=0.0005))
    d = _cluster(prefills, decodes, max_inflight_requests=10_000)
    outcomes = {"ok": 0, "cancelled": 0, "error": 0, "timeout": 0}

    async def one(i):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        timeout = 0.002 if i % 17 == 0 else None
        task = asyncio.ensure_future(_collect(d, prompt, max_tokens=rng.randrange(1, 12), timeout_s=timeout))
        if i % 7 == 0:
            await asyncio.sleep(rng.random() * 0.003)
            task.cancel()
        try:
            tokens, final = await task
            assert tokens == expected_tokens(prompt, final.completion_tokens)
            outcomes["ok"] += 1
        except asyncio.CancelledError:
            outcomes["cancelled"] += 1
        except Exception as e:
            outcomes["timeout" if "did not finish" in str(e) else "error"] += 1

    async def run():
        for start in range(0, 1000, 50):
            await asyncio.gather(*(one(i) for i in range(start, start + 50)))
            if start % 200 == 0:
                await d.registry.poll()  # polls interleave with requests in flight
        await asyncio.sleep(0.05)  # background aborts and confirmations finish

    asyncio.run(run())
    assert sum(outcomes.values()) == 1000 and min(outcomes.values()) > 0, outcomes
    assert d.inflight == {}
    for w in d.registry.workers():
        assert (w.prefilling, w.decoding, w.unpolled) == ({}, {}, set()), w.worker_id
        assert (w.queued_prompt_tokens, w.active, w.reserved_tokens) == (0, 0, 0)


def test_a_prefill_worker_that_left_before_the_handover_is_not_relied_on():
    """Removed from the cluster between its answer and the decode call: its KV may be
    gone, so the decode worker prefills prompt + first token itself."""
    p0, d0 = FakePrefill("p0", delay_s=0.01), FakeDecode("d0")
    d = _cluster([p0], [d0])
    prompt = [7, 7, 7]

    async def run():
        request = asyncio.ensure_future(_collect(d, prompt, max_tokens=6))
        while not p0.calls:  # the prefill has started
            await asyncio.sleep(0)
        d.registry.remove("p0")
        return await request

    tokens, final = asyncio.run(run())
    assert tokens == expected_tokens(prompt, 6)
    (task,) = d0.calls
    assert task.handoff is None and (task.prompt_token_ids, task.output_token_ids) == (prompt, tokens[:1])
    assert d0.connect_calls == 0


def test_a_prefill_worker_lost_between_export_and_pull_is_recomputed_on_the_decode_worker():
    """The prefill worker restarted after exporting (a new incarnation) and then died:
    its handshakes cannot be had, its KV is gone; the decode worker prefills prompt +
    first token itself instead of failing the request."""
    p0, d0 = FakePrefill("p0"), FakeDecode("d0")
    d = _cluster([p0], [d0])
    prompt = [9, 8, 7]

    async def info_lost():
        raise WorkerLost("the prefill actor died")

    async def run():
        p0.restart()  # the registry holds the old incarnation's handshakes
        p0.info = info_lost
        return await _collect(d, prompt, max_tokens=6)

    tokens, final = asyncio.run(run())
    assert tokens == expected_tokens(prompt, 6)
    (task,) = d0.calls
    assert task.handoff is None and (task.prompt_token_ids, task.output_token_ids) == (prompt, tokens[:1])
    assert final.completion_tokens == 6


def test_a_streamed_handoff_starts_the_decode_side_before_the_first_token():
    """A prefill worker that streams KV hands its handoff over before its result: the
    decode worker gets the task (and starts pulling) first, with no first token; the
    router passes the prefill's first token on and then gives it to the decode worker,
    which continues after it."""
    p0, d0 = FakePrefill("p0", delay_s=0.01, streams=True), FakeDecode("d0")
    d = _cluster([p0], [d0])
    prompt = [4, 5, 6, 7]
    seen_before_result: list[int] = []

    async def run():
        request = asyncio.ensure_future(_collect(d, prompt, max_tokens=6))
        while not d0.calls:  # the decode side has the task while the prefill still runs
            await asyncio.sleep(0)
        seen_before_result.append(len(d0.calls))
        return await request

    tokens, final = asyncio.run(run())
    assert tokens == expected_tokens(prompt, 6)
    assert seen_before_result == [1]
    (task,) = d0.calls
    assert task.handoff is not None and task.first_token_later
    assert d0.first_tokens[task.request_id].result() == tokens[:1]
    assert [c.transfer_id for c in p0.confirmed] == [task.handoff.descriptors[0].transfer_id]
    assert (final.prefill_worker, final.decode_worker, final.completion_tokens) == ("p0", "d0", 6)


def test_a_prefill_worker_lost_while_its_kv_streams_is_recomputed_on_the_decode_worker():
    """The prefill worker dies after the decode side began pulling, before the first
    token: the decode worker is told (its request ends with PeerLost), and prefills
    the prompt itself; the client sees every token once."""
    p0, d0 = FakePrefill("p0", fail=_lost, streams=True), FakeDecode("d0")
    d = _cluster([p0], [d0])
    prompt = [3, 1, 4, 1, 5]
    tokens, final = asyncio.run(_collect(d, prompt, max_tokens=7))
    assert tokens == expected_tokens(prompt, 7)
    streamed, recomputed = d0.calls
    assert streamed.first_token_later
    assert recomputed.handoff is None and recomputed.output_token_ids == []
    assert d.transfer_failures == {("PeerLost", "recompute"): 1}
    assert final.completion_tokens == 7 and final.prefill_worker == ""


def test_a_streamed_request_that_ends_at_its_first_token_ends_on_the_decode_worker_too():
    p0, d0 = FakePrefill("p0", streams=True), FakeDecode("d0")
    d = _cluster([p0], [d0])
    prompt = [2, 7, 1, 8]
    tokens, final = asyncio.run(_collect(d, prompt, max_tokens=1))
    assert tokens == expected_tokens(prompt, 1) and final.completion_tokens == 1
    assert [t.first_token_later for t in d0.calls] == [True]
    assert d0.aborted == [d0.calls[0].request_id]
