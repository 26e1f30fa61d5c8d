"""The dispatcher without Ray: the request path against fake worker clients
(``tests.unit.router.fakes``), whose "model" is a fixed next-token rule, so
every output has an exact expected value.

Every failure path of ``docs/reliability.md`` through the request's lifecycle:
retry of a prefill worker lost before its KV came, recompute after a failed
handover, resumption after a lost decode worker (no token repeated or
skipped); admission limits; confirmations and handshakes between the workers,
not through the router; aborts only where the request is still held; and the
registry's load bookkeeping returning to zero after 1,000 requests with random
cancels and errors."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from splitserve.router.decider import Placement, Reason
from splitserve.router.dispatch import MAX_WORKER_LOSSES, Dispatcher
from splitserve.router.errors import status_for
from splitserve.router.events import FinalEvent, GenerateInput, TokenEvent
from splitserve.router.policy import LimitsSpec, PolicySpec
from splitserve.router.registry import NodePlacement, WorkerRegistry
from splitserve.wire.errors import (
    LeaseExpired,
    Overloaded,
    PeerLost,
    RequestCrashesWorkers,
    UnknownModel,
    WorkerLost,
    WorkerUnreachable,
)
from splitserve.wire.prefill import PrefillStats
from splitserve.wire.prefix import PrefixUpdate, prompt_block_hashes
from splitserve.wire.sampling import SamplingParams
from tests.unit.router.fakes import VALIDATOR, FakeDecode, FakePrefill, engine_stats, expected_tokens
from tests.waiting import until


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
    p0, p1, d0 = FakePrefill("p0", fail=_lost), FakePrefill("p1"), FakeDecode("d0")
    d = _cluster([p0, p1], [d0])
    prompt = [5, 6, 7]
    tokens, final = asyncio.run(_collect(d, prompt))
    assert len(p0.calls) == 1 and len(p1.calls) == 1  # p0 (first of two idle ones) lost it; p1 served it
    assert [t.source for t in d0.calls] == [p0, p1]  # the decode worker was asked twice, each with its source
    assert tokens == expected_tokens(prompt, 8)
    assert final.prefill_worker == "p1" and final.decode_worker == "d0"
    assert (p1.aborted, d0.aborted) == ([], [])  # a success aborts nothing


def test_lost_decode_worker_mid_stream_resumes_elsewhere_without_repeating():
    d0, d1 = FakeDecode("d0", batch=2, lose_after=4), FakeDecode("d1")
    d = _cluster([p0 := FakePrefill("p0")], [d0, d1])
    d.registry.get("d1").decoding["other"] = 10**6  # d0 looks emptier: it is chosen first
    d.registry.get("d1").unpolled.add("other")
    prompt = [1, 2, 3, 4]
    tokens, final = asyncio.run(_collect(d, prompt, max_tokens=10))
    assert tokens == expected_tokens(prompt, 10)  # nothing repeated, nothing skipped
    assert final.decode_worker == "d1" and final.completion_tokens == 10
    (resumed,) = d1.calls
    sent = expected_tokens(prompt, 5)  # the prefill token and d0's two batches
    assert resumed.prompt_token_ids == prompt and resumed.output_token_ids == sent
    assert resumed.source is None and resumed.params.max_tokens == 10  # the sent tokens count
    rid = resumed.request_id
    assert (
        d0.aborted == [rid] and d1.aborted == []
    )  # the lost one may hold it; the one that finished does not
    assert p0.aborted == [rid]  # the source may still hold an export for the lost one


def test_a_request_whose_prefill_workers_were_all_lost_is_prefilled_by_its_decode_worker():
    p0 = FakePrefill("p0", fail=_lost)
    d = _cluster([p0], [d0 := FakeDecode("d0")])
    d.policy = PolicySpec(conditional_disaggregation=False)  # the fallback is not a policy
    tokens, final = asyncio.run(_collect(d, [1, 2]))
    assert len(p0.calls) == 1 and tokens == expected_tokens([1, 2], 8) and final.prefill_worker == ""
    remote, local = d0.calls
    assert remote.source is p0 and local.source is None and local.output_token_ids == []  # d0 prefilled it
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
        await until(lambda: d.num_inflight == 2, "both requests admitted")  # prefilling
        with pytest.raises(Overloaded, match="capacity"):
            await _collect(d, [9, 9])
        await asyncio.gather(*first)
        assert await _collect(d, [9, 9])  # room again

    asyncio.run(run())
    d = _cluster([FakePrefill("p0", delay_s=0.05)], [FakeDecode("d0")], max_queued_prompt_tokens=100)

    async def queued():
        busy = asyncio.ensure_future(_collect(d, list(range(80))))
        await until(lambda: d.registry.get("p0").queued_prompt_tokens == 80, "the prompt queued on p0")
        with pytest.raises(Overloaded, match="prefill queues are full"):
            await _collect(d, list(range(30)))
        await busy

    asyncio.run(queued())
    with pytest.raises(UnknownModel, match="unknown model"):
        asyncio.run(_collect(d, [1], model="gpt-5"))


def test_a_request_is_refused_at_once_when_every_decode_worker_has_its_batch():
    decodes = [FakeDecode("d0", step_s=0.01), FakeDecode("d1", step_s=0.01)]
    d = _cluster([FakePrefill("p0", delay_s=0.05)], decodes, max_decode_batch=1)
    workers = d.registry.workers("decode")

    async def run():
        busy = [asyncio.ensure_future(_collect(d, [i, 1])) for i in range(2)]
        await until(lambda: sum(len(w.decoding) for w in workers) == 2, "both requests picked a worker")
        assert [len(w.decoding) for w in workers] == [1, 1]  # one each, counted from the pick
        assert all(w.queued_prompt_tokens == 0 for w in workers)  # still prefilling elsewhere
        with pytest.raises(Overloaded, match="max_decode_batch"):
            await _collect(d, [9, 9])
        await asyncio.gather(*busy)
        assert not any(w.decoding for w in workers)
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

    async def run():
        await d.registry.poll()
        await d.registry.poll()
        assert w0.steps.largest_batch(0.0145) == 2 and w1.steps.largest_batch(0.0145) is None
        assert d.batch_caps() == {"d0": 2}  # what /metrics shows
        d.registry.drain("d1")  # d0 alone: its cap decides
        busy = [asyncio.ensure_future(_collect(d, [i, 1])) for i in range(2)]
        await until(lambda: len(w0.decoding) + len(w1.decoding) == 2, "both requests picked a worker")
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
    # info: once when the worker joined (the registry), once by the decode worker to link
    assert d0.connect_calls == 1 and p0.info_calls == 2
    p0.restart()  # a new incarnation: the decode worker asks it again and links again
    asyncio.run(run(5))
    assert d0.connect_calls == 2 and p0.info_calls == 3
    d0.restart()  # the decode worker lost its handshakes: it links again by itself
    tokens, _ = asyncio.run(_collect(d, [4, 4], max_tokens=5))
    assert tokens == expected_tokens([4, 4], 5) and d0.connect_calls == 3 and p0.info_calls == 4


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
            outcomes["ok"] += 1
        except asyncio.CancelledError:
            outcomes["cancelled"] += 1
        except Exception as e:
            outcomes["timeout" if "did not finish" in str(e) else "error"] += 1
        else:  # outside the try: a wrong token fails the test, it is not an "error" outcome
            assert tokens == expected_tokens(prompt, final.completion_tokens)

    async def run():
        for start in range(0, 1000, 50):
            await asyncio.gather(*(one(i) for i in range(start, start + 50)))
            if start % 200 == 0:
                await d.registry.poll()  # polls interleave with requests in flight
        # background aborts and confirmations finish
        await until(
            lambda: d.num_inflight == 0 and not any(w.prefilling or w.decoding for w in d.registry.workers()),
            "every request ended and let go of its workers",
        )

    asyncio.run(run())
    assert sum(outcomes.values()) == 1000 and min(outcomes.values()) > 0, outcomes
    assert d.num_inflight == 0
    for w in d.registry.workers():
        assert (w.prefilling, w.decoding, w.unpolled) == ({}, {}, set()), w.worker_id
        assert (w.queued_prompt_tokens, w.active, w.reserved_tokens) == (0, 0, 0)


@pytest.mark.parametrize("error", [PeerLost("the source is gone"), LeaseExpired("the lease ran out")])
def test_a_failed_pull_is_recomputed_on_the_decode_worker_and_the_export_released(error):
    """The pull fails after the first token was passed on: the decode worker prefills
    prompt + first token itself, the client sees every token once, and the source
    is told to let go of the export (it was never confirmed)."""

    def fail(handoff):
        raise error

    p0, d0 = FakePrefill("p0"), FakeDecode("d0", pull_fails=fail)
    d = _cluster([p0], [d0])
    prompt = [7, 7, 7]
    tokens, final = asyncio.run(_collect(d, prompt, max_tokens=6))
    assert tokens == expected_tokens(prompt, 6)
    remote, local = d0.calls
    assert remote.source is p0 and (local.source, local.output_token_ids) == (None, tokens[:1])
    assert p0.aborted == [remote.request_id] and p0.confirmed == []
    assert d.transfer_failures == {(type(error).__name__, "recompute"): 1}
    assert final.prefill_worker == "p0" and final.completion_tokens == 6


def test_a_failed_pull_ends_the_request_when_the_policy_says_fail():
    def fail(handoff):
        raise PeerLost("the source is gone")

    p0, d0 = FakePrefill("p0"), FakeDecode("d0", pull_fails=fail)
    d = _cluster([p0], [d0])
    d.on_transfer_failure = "fail"
    with pytest.raises(PeerLost):
        asyncio.run(_collect(d, [1, 2, 3]))
    assert len(d0.calls) == 1 and d.transfer_failures == {("PeerLost", "fail"): 1}
    assert p0.aborted == [d0.calls[0].request_id]


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
    remote, local = d0.calls
    assert local.source is None and (local.prompt_token_ids, local.output_token_ids) == (prompt, tokens[:1])
    assert final.completion_tokens == 6 and d.transfer_failures == {("PeerLost", "recompute"): 1}


def test_a_streamed_handoff_passes_its_first_token_through_the_decode_worker():
    """A prefill worker that streams KV hands its handoff over before its result: the
    decode worker takes both, passes the first token on and continues after it; the
    router sent one task and read one stream."""
    p0, d0 = FakePrefill("p0", delay_s=0.01, streams=True), FakeDecode("d0")
    d = _cluster([p0], [d0])
    prompt = [4, 5, 6, 7]
    tokens, final = asyncio.run(_collect(d, prompt, max_tokens=6))
    assert tokens == expected_tokens(prompt, 6)
    (task,) = d0.calls
    assert task.source is p0 and task.output_token_ids == []
    assert [c.source_worker for c in p0.confirmed] == ["p0"]
    assert (final.prefill_worker, final.decode_worker, final.completion_tokens) == ("p0", "d0", 6)
    assert (p0.aborted, d0.aborted) == ([], [])
    (trace,) = d.traces.latest(1)
    assert trace.kv_streamed and trace.kv_bytes == 64 and trace.prefill_worker == "p0"


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
    assert streamed.source is p0
    assert recomputed.source is None and recomputed.output_token_ids == []
    assert d.transfer_failures == {("PeerLost", "recompute"): 1}
    assert final.completion_tokens == 7 and final.prefill_worker == ""


def test_a_streamed_request_that_ends_at_its_first_token_ends_on_the_decode_worker_too():
    p0, d0 = FakePrefill("p0", streams=True), FakeDecode("d0")
    d = _cluster([p0], [d0])
    prompt = [2, 7, 1, 8]
    tokens, final = asyncio.run(_collect(d, prompt, max_tokens=1))
    assert tokens == expected_tokens(prompt, 1) and final.completion_tokens == 1
    assert [t.source for t in d0.calls] == [p0] and (final.prefill_worker, final.decode_worker) == ("p0", "")
    assert d0.aborted == [] and p0.aborted == [d0.calls[0].request_id]  # the streamed export is released


def test_a_prefill_worker_is_told_to_copy_the_prefix_another_prefill_worker_holds():
    """p0 holds the prompt's first 4 blocks but has a queue; the prompt goes to p1, whose
    task names p0 as where to copy them from; a retry on p0 itself copies nothing; with
    policy.prefix_pulls off nothing is copied."""
    p0, p1, d0 = FakePrefill("p0"), FakePrefill("p1", fail=_lost), FakeDecode("d0")
    d = _cluster([p0, p1], [d0])
    prompt = list(range(100, 180))  # 5 full blocks of 16
    hashes = prompt_block_hashes(prompt, 16)[:4]
    holder = d.registry.get("p0")
    holder.prefix.apply(PrefixUpdate("e", 4, tuple((h, True) for h in hashes), snapshot=True))
    holder.stats = PrefillStats("p0", engine_stats(prefill_rate=1000.0), (), 0, 0, 0)

    async def run(policy: PolicySpec) -> list[int]:
        d.policy = policy
        with d.registry.prefilling(holder, "queued", 500):
            tokens, _ = await _collect(d, prompt)
        return tokens

    assert asyncio.run(run(PolicySpec())) == expected_tokens(prompt, 8)
    first, retry = d0.calls
    assert first.source is p1 and first.prefix_from.holder is p0
    assert (first.prefix_from.holder_id, first.prefix_from.num_blocks) == ("p0", 4)
    assert retry.source is p0 and retry.prefix_from is None  # p1 was lost; p0 holds it itself
    d0.calls.clear()
    p1.fail = None
    asyncio.run(run(PolicySpec(prefix_pulls=False)))
    assert d0.calls[0].source is p1 and d0.calls[0].prefix_from is None


POISON = [9, 9, 9, 9]


def _crash_on_poison(task):
    if task.prompt_token_ids == POISON:
        raise WorkerLost("the actor died")


async def _poison_and_a_good_one(d: Dispatcher):
    good = asyncio.ensure_future(_collect(d, [1, 2, 3]))
    with pytest.raises(RequestCrashesWorkers) as caught:
        await _collect(d, POISON)
    return caught.value, await good


def test_a_request_present_at_two_worker_losses_ends_with_internal_and_is_not_tried_on_a_third():
    decodes = [FakeDecode(f"d{i}", fail=_crash_on_poison) for i in range(3)]
    d = _cluster([FakePrefill("p0")], decodes)
    error, (tokens, final) = asyncio.run(_poison_and_a_good_one(d))
    assert sum(POISON == t.prompt_token_ids for dw in decodes for t in dw.calls) == MAX_WORKER_LOSSES
    assert tokens == expected_tokens([1, 2, 3], 8) and final.finish_reason.value == "length"
    code, message = status_for(error)
    assert code == grpc.StatusCode.INTERNAL and "fingerprint" in message and "2 workers" in message
    crashed = [dw.worker_id for dw in decodes if any(POISON == t.prompt_token_ids for t in dw.calls)]
    assert f"({', '.join(crashed)})" in message  # the sentence names the workers lost
    for w in d.registry.workers():  # nothing stays held for either request
        assert (w.prefilling, w.decoding) == ({}, {})
    assert d.num_inflight == 0


def test_a_failed_start_is_no_loss_and_takes_the_worker_out_of_routing_at_once():
    """d0 is routable but dead: the request's start there fails (it never ran there);
    d1 is lost 4 tokens into it; d2 is healthy. One loss only: the request completes on
    d2 with every token once, prefilled first by p0 (the start on d0 never reached it),
    and d0 leaves routing at once instead of waiting for a poll."""

    def unreachable(task):
        raise WorkerUnreachable("a decode worker could not be reached (UNAVAILABLE: connection refused)")

    d0, d1, d2 = FakeDecode("d0", fail=unreachable), FakeDecode("d1", lose_after=4), FakeDecode("d2")
    d = _cluster([p0 := FakePrefill("p0")], [d0, d1, d2])
    d.registry.get("d2").decoding["other"] = 0  # d1 looks emptier than d2: d0, then d1, then d2
    prompt = [6, 5, 4, 3]
    tokens, final = asyncio.run(_collect(d, prompt, max_tokens=10))
    assert tokens == expected_tokens(prompt, 10) and final.decode_worker == "d2"
    assert [t.source for t in d0.calls] == [p0] and [t.source for t in d1.calls] == [p0]
    assert len(p0.calls) == 1  # asked once, by d1
    (resumed,) = d2.calls
    assert resumed.source is None and resumed.output_token_ids == expected_tokens(prompt, 5)
    w0 = d.registry.get("d0")
    assert not w0.routable and "connection refused" in w0.error
    (trace,) = d.traces.latest(1)
    assert [m.worker for m in trace.marks if m.name in ("redirected", "resumed")] == ["d1", "d2"]


def test_a_start_whose_answer_was_lost_is_let_go_of_before_the_request_returns_there():
    """d0 took the request but its answer was lost (``WorkerUnreachable``: it holds the
    request unseen); the request starts on d1, and d0 is heard from again. d1 is lost 4
    tokens in: the request resumes on d0, which is told to let go of its leftover first,
    so the start is not refused as a request id in use (a false INVALID_ARGUMENT seen in
    a chaos run), and the request completes there with every token once."""
    d0, d1 = FakeDecode("d0"), FakeDecode("d1", lose_after=4)
    d = _cluster([FakePrefill("p0")], [d0, d1])

    def answer_lost(task):
        if len(d0.calls) == 1:
            d0.held.add(task.request_id)
            raise WorkerUnreachable("a decode worker's connection closed before it answered the start")

    def heard_from_d0_again(task):
        w0 = d.registry.get("d0")
        w0.alive, w0.error = True, ""

    d0.fail, d1.fail = answer_lost, heard_from_d0_again
    d.registry.get("d1").decoding["other"] = 0  # d0 looks emptier: d0 first
    prompt = [6, 5, 4, 3]
    tokens, final = asyncio.run(_collect(d, prompt, max_tokens=10))
    assert tokens == expected_tokens(prompt, 10) and final.decode_worker == "d0"
    assert len(d0.calls) == 2 and d0.calls[1].output_token_ids == expected_tokens(prompt, 5)  # 1 + 4
    assert d0.aborted and d0.aborted[0] == d0.calls[0].request_id
    assert not d0.held and not d1.held and d.num_inflight == 0


def test_a_prefill_worker_dead_before_it_took_the_request_is_no_loss_and_leaves_routing():
    """p0 is routable but already dead (its stream fails before ``PrefillAccepted``); the
    request prefills on p1, then d0 is lost 4 tokens into it and it resumes on d1. One
    loss only (d0): it completes with every token once, and p0 leaves routing at once.
    (Counted as a loss, p0's death would have ended it with INTERNAL at d0's: the chaos
    run's 10 two-loss INTERNALs of requests that never ran on the first worker.)"""
    p0 = FakePrefill("p0", fail=_lost, takes=False)
    p1, d0, d1 = FakePrefill("p1"), FakeDecode("d0", lose_after=4), FakeDecode("d1")
    d = _cluster([p0, p1], [d0, d1])
    d.registry.get("d1").decoding["other"] = 0  # d0 looks emptier: d0 first
    prompt = [9, 8, 7, 6]
    tokens, final = asyncio.run(_collect(d, prompt, max_tokens=10))
    assert tokens == expected_tokens(prompt, 10) and final.decode_worker == "d1"
    assert [t.source for t in d0.calls] == [p0, p1] and len(p1.calls) == 1
    w0 = d.registry.get("p0")
    assert not w0.routable and "PrefillUnreachable" in w0.error


def test_a_request_whose_every_start_fails_ends_unavailable_after_trying_each_worker_once():
    def unreachable(task):
        raise WorkerUnreachable("connection refused")

    decodes = [FakeDecode(f"d{i}", fail=unreachable) for i in range(3)]
    d = _cluster([FakePrefill("p0")], decodes)
    with pytest.raises(WorkerUnreachable) as caught:
        asyncio.run(_collect(d, [1, 2]))
    assert status_for(caught.value)[0] == grpc.StatusCode.UNAVAILABLE
    assert [len(dw.calls) for dw in decodes] == [1, 1, 1]
    assert d.registry.routable("decode") == []


def test_a_poll_that_times_out_never_marks_a_worker_alive():
    d0 = FakeDecode("d0")
    d = _cluster([], [d0])
    w = d.registry.get("d0")
    d.registry.unreachable(w, "WorkerUnreachable: connection refused")
    stalled = asyncio.Event()

    async def no_answer(prefix_since=None):
        await stalled.wait()

    d0.stats = no_answer
    d.registry.poll_timeout_s = 0.01
    asyncio.run(d.registry.poll())
    assert not w.alive and "no answer" in w.error
    w.alive = True  # a busy worker that is alive stays so
    asyncio.run(d.registry.poll())
    assert w.alive
    del d0.stats  # answers again: routable again
    asyncio.run(d.registry.poll())
    assert w.routable and w.error == ""


def test_prefill_and_decode_losses_count_together():
    prefills = [FakePrefill(f"p{i}", fail=_lost) for i in range(3)]
    d = _cluster(prefills, [FakeDecode("d0")])
    with pytest.raises(RequestCrashesWorkers):
        asyncio.run(_collect(d, [4, 5]))
    assert sum(len(p.calls) for p in prefills) == MAX_WORKER_LOSSES  # the third never saw it


@pytest.mark.parametrize("same_node", [True, False])
def test_one_nodes_failure_counts_as_one_loss(same_node):
    """p0 is lost (d0 reports PrefillLost), then d0 itself: on one node that is one
    failure, and the request resumes on d1; on two nodes, two losses end it."""
    reported = []

    def lost_on_its_second_task(task):
        reported.append(task)
        if len(reported) == 2:
            raise WorkerLost("the node died")

    p0, p1 = FakePrefill("p0", fail=_lost), FakePrefill("p1")
    d0, d1 = FakeDecode("d0", fail=lost_on_its_second_task), FakeDecode("d1")
    d = _cluster([p0, p1], [d0, d1])
    d.registry.get("d1").decoding["other"] = 10**6  # d0 looks emptier: it is chosen first
    d.registry.get("d1").unpolled.add("other")
    d.registry.placed("p0", NodePlacement("node-a", "cpu"))
    d.registry.placed("d0", NodePlacement("node-a" if same_node else "node-b", "cpu"))
    if same_node:
        tokens, final = asyncio.run(_collect(d, [7, 8, 9]))
        assert tokens == expected_tokens([7, 8, 9], 8) and final.decode_worker == "d1"
    else:
        with pytest.raises(RequestCrashesWorkers):
            asyncio.run(_collect(d, [7, 8, 9]))
        assert d1.calls == []


def test_workers_of_two_revisions_are_never_paired():
    """Prefill and decode workers of revisions A and B, 60 requests: each is prefilled
    by a worker of its decode worker's revision (or by the decode worker itself, for
    revision C, which has no prefill worker), and its trace says so."""
    pa, pb = FakePrefill("p-a", revision="A"), FakePrefill("p-b", revision="B")
    decodes = [FakeDecode(f"d-{r}", revision=r) for r in ("A", "B", "C")]
    d = _cluster([pa, pb], decodes)
    d.policy = PolicySpec(conditional_disaggregation=False)  # always remote where one is of its revision

    async def run_all():
        prompts = [[i % 7 + 1, i % 5 + 2, i % 3 + 3] for i in range(60)]
        return await asyncio.gather(*(_collect(d, p, max_tokens=4) for p in prompts)), prompts

    results, prompts = asyncio.run(run_all())
    for (tokens, _), prompt in zip(results, prompts):
        assert tokens == expected_tokens(prompt, 4)
    served = {dw.revision: [t.source for t in dw.calls] for dw in decodes}
    assert all(served.values())  # every decode worker took some
    assert {s.worker_id for s in served["A"]} == {"p-a"} and {s.worker_id for s in served["B"]} == {"p-b"}
    assert served["C"] == [None] * len(served["C"])  # prefilled on d-C itself
    assert len(pa.calls) + len(pb.calls) == len(served["A"]) + len(served["B"])
    traces = d.traces.latest(60)
    assert len(traces) == 60
    for t in traces:
        assert t.decode_revision == t.decode_worker[-1]
        assert t.prefill_revision == (t.decode_revision if t.prefill_worker else "")
