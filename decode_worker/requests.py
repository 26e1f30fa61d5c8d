"""The requests a decode worker started and has not ended, the outboxes their
consumers read, and their text: one owner for all three (``RequestTable``), on the
actor's loop.

The engine's steps emit token ids; their text is made here, as they are delivered
(``engine.text``), off the engine's thread. A stop string found here ends the request:
its consumer gets the last batch at once, and the engine is told to abort it (it may
have run it one step further; that step's tokens reach no one).

A request ends here once (``end``): its deadline timer is cancelled, a way in still
running (a handover or a migration) is cancelled, and it frees what its phase held;
otherwise, with ``abort``, the engine frees the request's blocks. ``fail`` ends it
with an error, the last batch its consumer gets. A stream whose consumer goes ends
every request of its outbox.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from splitserve.decode_worker.handover import Phase, WayIn
from splitserve.decode_worker.outbox import Outbox
from splitserve.engine.containment import contained
from splitserve.engine.text import Texts
from splitserve.engine.tokenizer import Tokenizer
from splitserve.wire.decode import TokenBatch
from splitserve.wire.errors import DeadlineExceeded, InvalidRequest
from splitserve.wire.outputs import RequestOutput


@dataclass(eq=False)
class StartedRequest:
    """A request started here and not yet ended."""

    request_id: str
    outbox: Outbox
    deadline: asyncio.TimerHandle | None = None  # ends it with DeadlineExceeded
    handover: WayIn | None = None  # an imported or moved-in request's way in
    importing: asyncio.Task | None = None  # runs the way in


class RequestTable:
    """The decode worker's started requests by id, and its outboxes by id (the module
    docstring); on the actor's loop."""

    def __init__(self, abort_in_engine: Callable[[str], object], tokenizer: Tokenizer | None):
        """``abort_in_engine``: frees a request's blocks in the engine (not awaited);
        ``tokenizer``: the engine's, which makes the requests' text."""
        self._abort_in_engine = abort_in_engine
        self._texts = Texts(tokenizer)
        self.text_failures = 0  # requests failed here because their text could not be made
        self._requests: dict[str, StartedRequest] = {}
        self._outboxes: dict[str, Outbox] = {}  # by outbox id (one per consumer)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def get(self, request_id: str) -> StartedRequest | None:
        return self._requests.get(request_id)

    def phases(self) -> list[Phase]:
        """The phase of each request still on its way in (or RUNNING after one)."""
        return [r.handover.phase for r in self._requests.values() if r.handover is not None]

    def add(self, request_id: str, outbox_id: str, timeout_s: float | None) -> StartedRequest:
        """Start ``request_id`` on ``outbox_id``; past ``timeout_s`` (None: never) it fails
        with ``DeadlineExceeded``. ``InvalidRequest`` if the id is in use."""
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        req = self._requests[request_id] = StartedRequest(request_id, self.outbox(outbox_id))
        if timeout_s is not None:
            loop = asyncio.get_running_loop()
            error = DeadlineExceeded(f"request {request_id} ran past its {timeout_s:.3g} s")
            req.deadline = loop.call_at(loop.time() + timeout_s, self.fail, request_id, error)
        return req

    def outbox(self, outbox_id: str) -> Outbox:
        outbox = self._outboxes.get(outbox_id)
        if outbox is None:
            outbox = self._outboxes[outbox_id] = Outbox(outbox_id)
        return outbox

    async def stream(self, outbox_id: str) -> AsyncIterator[tuple[TokenBatch, ...]]:
        """``outbox_id``'s batches, as ``DecodeWorker.stream`` serves them; once its reader
        closes it, every request of the outbox still here ends."""
        outbox = self.outbox(outbox_id)
        if outbox.reading:
            raise InvalidRequest(f"outbox {outbox_id!r} already has a reader")
        outbox.reading = True
        try:
            while True:
                yield await outbox.take()
        finally:
            for rid in [rid for rid, req in self._requests.items() if req.outbox is outbox]:
                self.end(rid)
            self._outboxes.pop(outbox_id, None)

    def end(self, request_id: str, abort: bool = True) -> bool:
        """Forget ``request_id``; with ``abort``, free what it holds in the engine (a way in
        still running is cancelled and frees it once its pull is over). Returns whether
        the request was here."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._texts.forget(request_id)
        if req.deadline is not None:
            req.deadline.cancel()
        importing = req.importing
        if importing is not None and not importing.done() and importing is not asyncio.current_task():
            importing.cancel()
        elif abort:
            self._abort_in_engine(request_id)
        return True

    def fail(self, request_id: str, error: Exception, abort: bool = True) -> None:
        """End ``request_id`` with ``error``, the last batch its consumer gets."""
        req = self._requests.get(request_id)
        if req is not None:
            req.outbox.put(TokenBatch.failure(request_id, error))
            self.end(request_id, abort)

    def fail_all(self, error: Exception) -> None:
        for rid in list(self._requests):
            self.fail(rid, error)

    async def run_way_in(self, req: StartedRequest) -> None:
        """Run ``req``'s way in; once it ended before RUNNING, end the request as it says
        (its blocks are free already)."""
        ending = await req.handover.run()
        if ending is None:
            return
        if ending.error is None:  # the consumer has its end already
            self.end(req.request_id, abort=False)
        else:
            self.fail(req.request_id, ending.error, abort=False)

    def deliver(self, outputs: list[RequestOutput], now: float) -> bool:
        """One engine step's outputs, their text made, to their requests' outboxes
        (``now``: when the step handed them over, ``time.time()``); whether the engine
        freed any request's blocks. A request whose text ends at a stop string, or whose
        text cannot be made (it fails alone), ends here and is aborted in the engine."""
        freed = False
        for out in outputs:
            rid = out.request_id
            req = self._requests.get(rid)
            if req is None:
                continue
            try:
                stopped = self._texts.feed(out)
            except Exception as e:
                self.text_failures += 1
                self.fail(rid, contained("detokenization", e), abort=not out.finished)
                freed |= out.finished
                continue
            req.outbox.put(TokenBatch.of_output(out, now))
            if out.finished:
                freed |= not stopped
                self.end(rid, abort=stopped)
        return freed
