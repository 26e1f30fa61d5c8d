"""The router's connection to a decode worker's token server (``_Inbox``), against a
real ``TokenServer`` on localhost (no Ray: the actor is asked only for the address):
a start whose answer never comes because the worker's stream broke ends as
``WorkerUnreachable`` (a ``WorkerLost``), not as a stray cancellation that would
leave the client's call open; a caller's own cancellation stays a cancellation."""

from __future__ import annotations

import asyncio
import types

import pytest

from splitserve.cluster.worker_client import RayDecodeWorker, _Inbox
from splitserve.decode_worker.token_server import TokenServer
from splitserve.wire.decode import DecodeTask
from splitserve.wire.errors import WorkerLost, WorkerUnreachable
from splitserve.wire.sampling import SamplingParams

DEADLINE_S = 60.0


class _Worker:
    """A decode worker's token server whose ``start`` never answers until released,
    and whose stream yields nothing until ``end_stream`` is set (or the server stops)."""

    def __init__(self):
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.end_stream = asyncio.Event()
        self.server = TokenServer(self._stream, self._start)

    async def _stream(self, outbox_id: str):
        await self.end_stream.wait()
        return
        yield ()

    async def _start(self, outbox_id: str, task: DecodeTask) -> None:
        self.started.set()
        await self.release.wait()

    def actor(self) -> object:
        """What ``_Inbox`` asks for the address: ``actor.token_address.remote()``."""

        async def address() -> str:
            return self.server.address

        return types.SimpleNamespace(token_address=types.SimpleNamespace(remote=address))


def _task() -> DecodeTask:
    return DecodeTask("r1", [1, 2, 3], SamplingParams(max_tokens=4), None)


@pytest.mark.parametrize("how", ["the stream ends", "the server stops"])
def test_a_start_pending_when_the_token_stream_breaks_raises_worker_lost(how):
    """The stream's end makes the inbox close its channel, which cancels the START call
    still in flight (grpc.aio): that must reach the caller as a lost worker."""

    async def run():
        worker = _Worker()
        await worker.server.start("127.0.0.1")
        inbox = _Inbox(worker.actor())
        inbox.open("r1")
        start = asyncio.ensure_future(inbox.start(_task()))
        await asyncio.wait_for(worker.started.wait(), DEADLINE_S)
        if how == "the stream ends":
            worker.end_stream.set()
        else:
            await worker.server.stop()
        with pytest.raises(WorkerLost) as caught:
            await asyncio.wait_for(start, DEADLINE_S)
        await inbox.close_all()
        worker.release.set()
        await worker.server.stop()
        return caught.value

    error = asyncio.run(run())
    assert isinstance(error, WorkerUnreachable), repr(error)


def test_a_request_placed_on_a_worker_whose_server_is_gone_raises_worker_unreachable():
    async def run():
        worker = _Worker()
        await worker.server.start("127.0.0.1")
        await worker.server.stop()
        client = RayDecodeWorker(worker.actor())
        stream = client.generate(_task())
        with pytest.raises(WorkerUnreachable):
            await asyncio.wait_for(anext(stream), DEADLINE_S)
        await client.close()

    asyncio.run(run())


def test_the_callers_own_cancellation_stays_a_cancellation():
    async def run():
        worker = _Worker()
        await worker.server.start("127.0.0.1")
        inbox = _Inbox(worker.actor())
        inbox.open("r1")
        start = asyncio.ensure_future(inbox.start(_task()))
        await asyncio.wait_for(worker.started.wait(), DEADLINE_S)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        await inbox.close_all()
        worker.release.set()
        await worker.server.stop()

    asyncio.run(run())
