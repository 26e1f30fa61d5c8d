"""``RequestState.within``: the router's per-request deadline around each worker call."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.engine.errors import DeadlineExceeded
from splitserve.engine.sampling_params import SamplingParams
from splitserve.router.request import RequestState


def _state(timeout_s: float | None) -> RequestState:
    return RequestState("r1", [1, 2, 3], SamplingParams(max_tokens=4), timeout_s)


def test_within_returns_what_the_call_returns_before_the_deadline():
    async def main():
        return await _state(60).within(asyncio.sleep(0, result="tokens"))

    assert asyncio.run(main()) == "tokens"


def test_within_without_a_deadline_awaits_as_is():
    async def main():
        return await _state(None).within(asyncio.sleep(0.01, result=7))

    assert asyncio.run(main()) == 7


def test_within_past_the_deadline_cancels_the_call_and_says_so():
    cancelled = asyncio.Event()

    async def worker_call():
        try:
            await asyncio.Event().wait()  # never answers
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main():
        with pytest.raises(DeadlineExceeded, match="did not finish within"):
            await _state(0.05).within(worker_call())
        assert cancelled.is_set()

    asyncio.run(main())


def test_within_a_stream_takes_items_until_the_deadline_then_closes_it():
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
        req, items = _state(0.2), []
        it = stream()
        with pytest.raises(DeadlineExceeded):
            while True:
                items.append(await req.within(anext(it)))
        assert items == [0, 1, 2]
        assert closed.is_set()

    asyncio.run(main())


def test_a_cancelled_caller_is_cancelled_not_timed_out():
    """The client going away cancels the handler's task: that must stay a cancellation,
    not become ``DeadlineExceeded``."""

    async def main():
        started = asyncio.Event()

        async def handler():
            started.set()
            await _state(60).within(asyncio.Event().wait())

        task = asyncio.ensure_future(handler())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
