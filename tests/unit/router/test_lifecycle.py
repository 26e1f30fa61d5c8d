"""``RequestLifecycle``: its phases and named transitions, what each batch makes of
it (events, marks, the trace), and ``watch``, the router's per-request deadline
around each worker call."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.router.events import FinalEvent, TokenEvent
from splitserve.router.lifecycle import Phase, RequestLifecycle
from splitserve.wire.decode import Prefilled, TokenBatch
from splitserve.wire.errors import DeadlineExceeded, MeaningMismatch
from splitserve.wire.sampling import FinishReason, SamplingParams
from tests.unit.router.fakes import FakePrefill, record


def _state(timeout_s: float | None) -> RequestLifecycle:
    return RequestLifecycle("r1", [1, 2, 3], SamplingParams(max_tokens=4), timeout_s)


def _batch(ids=(), finish=None, **kw) -> TokenBatch:
    return TokenBatch("r1", list(ids), "", [0.0] * len(ids), [1.0] * len(ids), finish, 0, **kw)


def test_a_request_prefilled_elsewhere_moves_through_every_phase_once():
    life, dw, pw = _state(None), record("d0", "decode"), record("p0")
    pw.client = FakePrefill("p0")
    task = life.place(dw, pw)
    assert (life.phase, task.source, task.output_token_ids) == (Phase.PREFILLING, pw.client, [])
    prefilled = Prefilled("p0", scheduled_at=0.5, exported_at=0.6, streamed=True, kv_bytes=4096)
    (first,) = life.on_batch(_batch([7], prefilled=prefilled))
    assert isinstance(first, TokenEvent) and life.first_token_passed and life.phase == Phase.HANDING_OVER
    assert life.on_batch(_batch(transfer_s=0.01, started_at=2.0)) == []
    assert life.phase == Phase.DECODING
    tokens, final = life.on_batch(_batch([8, 9], FinishReason.LENGTH))
    assert tokens.token_ids == [8, 9] and isinstance(final, FinalEvent) and life.phase == Phase.FINISHED
    assert (final.prefill_worker, final.decode_worker, final.completion_tokens) == ("p0", "d0", 3)
    trace = life.trace("length", True)
    assert (trace.kv_bytes, trace.kv_streamed, trace.kv_pull_s) == (4096, True, 0.01)
    names = [m.name for m in trace.marks]
    for name in ("admitted", "prefill_started", "kv_exported", "first_token", "decode_admitted", "finished"):
        assert names.count(name) == 1, name
    with pytest.raises(RuntimeError, match="finished"):
        life.on_batch(_batch([1]))  # nothing moves a finished request


def test_a_request_that_ends_at_its_sources_first_token_never_reaches_decode():
    life, dw, pw = _state(None), record("d0", "decode"), record("p0")
    life.place(dw, pw)
    prefilled = Prefilled("p0", 0.5, None, False, 0)
    _, final = life.on_batch(_batch([7], FinishReason.STOP, prefilled=prefilled))
    assert (final.prefill_worker, final.decode_worker) == ("p0", "")
    assert life.trace("stop", True).phases_s()["decode"] == 0.0


def test_the_transitions_give_the_task_to_send_next_and_keep_what_was_sent():
    life, d0, d1, p0, p1 = (
        _state(None),
        record("d0", "decode"),
        record("d1", "decode"),
        record("p0"),
        record("p1"),
    )
    life.place(d0, p0)
    task = life.retry_prefill(p1)  # p0 lost before any KV came
    assert task.source is p1.client and life.source is p1 and life.phase == Phase.PREFILLING
    life.on_batch(_batch([7], prefilled=Prefilled("p1", 0.5, 0.6, False, 64)))
    task = life.recompute(MeaningMismatch("layer 3 position 40"))  # the pull failed after the first token
    assert (task.source, task.output_token_ids, life.decode_worker) == (None, [7], d0)
    life.on_batch(_batch([8]))
    task = life.resume(d1)  # d0 lost
    assert (task.source, task.output_token_ids, life.decode_worker, life.phase) == (
        None,
        [7, 8],
        d1,
        Phase.PREFILLING,
    )
    with pytest.raises(RuntimeError):
        life.place(d1, None)  # placed once
    _, final = life.on_batch(_batch([9], FinishReason.LENGTH))
    assert final.completion_tokens == 3 and final.decode_worker == "d1" and final.prefill_worker == "p1"
    marks = life.trace("length", True).marks
    names = [m.name for m in marks]
    assert names.count("kv_recompute") == 1 and names.count("resumed") == 1
    (failed,) = [m for m in marks if m.name == "kv_recompute"]  # it names the pair and the error
    assert failed.detail == "the KV from p1 to d0 failed: MeaningMismatch: layer 3 position 40"


async def _within(life, awaitable):
    with life.watch() as deadline:
        return await deadline.wait(awaitable)


def test_a_wait_returns_what_the_call_returns_before_the_deadline():
    assert asyncio.run(_within(_state(60), asyncio.sleep(0, result="tokens"))) == "tokens"


def test_a_wait_without_a_deadline_awaits_as_is():
    assert asyncio.run(_within(_state(None), asyncio.sleep(0.01, result=7))) == 7


def test_a_wait_past_the_deadline_cancels_the_call_and_says_so():
    cancelled = asyncio.Event()

    async def worker_call():
        try:
            await asyncio.Event().wait()  # never answers
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main():
        with pytest.raises(DeadlineExceeded, match="did not finish within"):
            await _within(_state(0.05), worker_call())
        assert cancelled.is_set()

    asyncio.run(main())


def test_one_watch_bounds_a_stream_until_the_deadline_then_closes_it():
    """One deadline over many ``anext`` calls on the same stream, as ``_stream`` uses it."""
    closed = asyncio.Event()

    async def stream():
        try:
            for i in range(3):
                yield i
            await asyncio.Event().wait()  # then goes quiet
        finally:
            closed.set()

    async def main():
        items = []
        it = stream()
        with _state(0.2).watch() as deadline, pytest.raises(DeadlineExceeded):
            while True:
                items.append(await deadline.wait(anext(it)))
        assert items == [0, 1, 2]
        await it.aclose()
        assert closed.is_set()

    asyncio.run(main())


def test_a_deadline_passing_between_waits_fails_the_next_wait_and_cancels_nothing_else():
    """The caller's own work between two waits (a gRPC write) is never cancelled by the
    deadline; the next wait raises at once."""

    async def main():
        with _state(0.05).watch() as deadline:
            assert await deadline.wait(asyncio.sleep(0, result=1)) == 1
            await asyncio.sleep(0.2)  # the caller's own work, past the deadline: not cancelled
            with pytest.raises(DeadlineExceeded):
                await deadline.wait(asyncio.sleep(0, result=2))

    asyncio.run(main())


def test_a_cancelled_caller_is_cancelled_not_timed_out():
    """The client going away cancels the handler's task: that must stay a cancellation,
    not become ``DeadlineExceeded``."""

    async def main():
        started = asyncio.Event()

        async def handler():
            started.set()
            await _within(_state(60), asyncio.Event().wait())

        task = asyncio.ensure_future(handler())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_the_final_sums_each_decode_workers_speculation_counts():
    """Counts come cumulative per worker (a batch repeats the worker's total so far); a
    request that resumed on another worker adds that worker's own."""
    life, d0, d1 = _state(None), record("d0", "decode"), record("d1", "decode")
    life.place(d0, None)
    life.on_batch(_batch([7], draft_tokens=3, accepted_draft_tokens=2))
    life.on_batch(_batch([8, 9], draft_tokens=5, accepted_draft_tokens=4))
    life.resume(d1)  # d0 lost
    life.on_batch(_batch([10], draft_tokens=2, accepted_draft_tokens=1))
    _, final = life.on_batch(_batch([11], FinishReason.LENGTH, draft_tokens=4, accepted_draft_tokens=3))
    assert (final.draft_tokens, final.accepted_draft_tokens) == (5 + 4, 4 + 3)
