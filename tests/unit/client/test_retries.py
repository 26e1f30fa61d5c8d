"""The SDK's retries of UNAVAILABLE, against a real gRPC server that answers every
call UNAVAILABLE and notes what deadline each attempt arrived with: a call's
``timeout`` covers all its attempts (each gets what is left of it), and a call
without a timeout makes exactly ``retries`` + 1 attempts."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures

import grpc
import pytest

from splitserve.client import AsyncClient, Client, DeadlineExceeded, Unavailable
from splitserve.client.client import DEADLINE_GRACE_S
from splitserve.proto import splitserve_pb2_grpc as pb_grpc

TIMEOUT_S = 3.0


class Down(pb_grpc.SplitserveServicer):
    """Every call: UNAVAILABLE. ``attempts``: (arrival, the call's time remaining)."""

    def __init__(self):
        self.attempts: list[tuple[float, float | None]] = []

    def _refuse(self, context):
        self.attempts.append((time.monotonic(), context.time_remaining()))
        context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is available")

    def Generate(self, request, context):
        self._refuse(context)
        yield from ()

    def ListModels(self, request, context):
        self._refuse(context)


@pytest.fixture
def down():
    servicer = Down()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_SplitserveServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def _within_one_deadline(attempts) -> None:
    """Every attempt's deadline is the first one's: arrival + time remaining does not grow."""
    first_at, first_left = attempts[0]
    for at, left in attempts[1:]:
        assert left is not None and at + left <= first_at + first_left + 0.05


def test_retries_of_a_stream_share_its_timeout(down):
    servicer, address = down
    with Client(address, retries=3, backoff_s=0.2) as c, pytest.raises(Unavailable):
        c.generate([1, 2, 3], temperature=0, max_tokens=4, timeout=TIMEOUT_S)
    assert len(servicer.attempts) == 4
    _within_one_deadline(servicer.attempts)


def test_no_retry_starts_past_the_timeout(down):
    servicer, address = down
    with Client(address, retries=10, backoff_s=0.5) as c, pytest.raises(Unavailable):
        c.generate([1, 2, 3], temperature=0, max_tokens=4, timeout=TIMEOUT_S)
    # 0.5 + 1 + 2 s of backoff would pass the 3 s deadline: the fourth attempt is not made
    assert len(servicer.attempts) == 3
    _within_one_deadline(servicer.attempts)


def test_async_retries_share_the_timeout_too(down):
    servicer, address = down

    async def call():
        async with AsyncClient(address, retries=3, backoff_s=0.2, timeout=TIMEOUT_S) as c:
            with pytest.raises(Unavailable):
                await c.generate([1, 2, 3], temperature=0, max_tokens=4)
            with pytest.raises(Unavailable):
                await c.list_models()

    asyncio.run(call())
    assert len(servicer.attempts) == 8
    _within_one_deadline(servicer.attempts[:4])
    _within_one_deadline(servicer.attempts[4:])


def test_without_a_timeout_every_retry_is_made(down):
    servicer, address = down
    with Client(address, retries=2, backoff_s=0.01) as c, pytest.raises(Unavailable):
        c.list_models()
    assert len(servicer.attempts) == 3
    assert all(left > 10**9 for _, left in servicer.attempts)  # gRPC's "no deadline"


class Silent(pb_grpc.SplitserveServicer):
    """Takes a Generate call and never answers it (a server that lost track of it);
    ``deadlines``: the time remaining each call arrived with."""

    def __init__(self):
        self.deadlines: list[float | None] = []
        self.release = threading.Event()

    def Generate(self, request, context):
        self.deadlines.append(context.time_remaining())
        self.release.wait(120)
        yield from ()


def test_a_request_with_timeout_ms_never_outlives_it_even_if_the_server_never_answers():
    """No client ``timeout``, but the request's ``timeout_ms``: the call gets a deadline
    of its own, ``DEADLINE_GRACE_S`` past it, sync and async alike."""
    servicer = Silent()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_SplitserveServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()

    async def async_call():
        async with AsyncClient(address, retries=0) as c:
            await c.generate([1, 2], max_tokens=2, timeout_ms=300)

    try:
        with Client(address, retries=0) as c, pytest.raises(DeadlineExceeded):
            c.generate([1, 2], max_tokens=2, timeout_ms=300)
        with pytest.raises(DeadlineExceeded):
            asyncio.run(async_call())
        for left in servicer.deadlines:  # what the server was told: timeout_ms + the grace
            # (gRPC's timeout header carries the deadline rounded up: 2.309 s was seen)
            assert left is not None and left <= 0.3 + DEADLINE_GRACE_S + 0.05
    finally:
        servicer.release.set()
        server.stop(None)
