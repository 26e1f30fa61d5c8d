"""Decode admission: imported requests wait here, in arrival order, for KV blocks.

A request with a ``KVHandoff`` waits here in its handover's WAITING_FOR_BLOCKS
phase (``decode_worker.handover``); only the queue's head is offered blocks, and
once they are allocated it leaves the queue to pull its KV into them.

Only the head is tried, so under block pressure requests are admitted in the
order they arrived: a small request never overtakes a large one queued before
it, and nothing starves. A head that waits for a LoRA slot, not for blocks
(``LoRASlotsBusy``: every slot holds an adapter in use), lets those behind it be
tried in order, up to the first that waits for blocks: a request under another
adapter, or the base model, never waits for a slot it does not need. The head
is tried again when the engine frees blocks (``wake``: a request finished or was
aborted) and, as a fallback, every ``retry_s``. A request leaves the queue without blocks when

- the queue already holds ``max_waiting`` requests when it arrives: ``Overloaded``;
- its deadline comes first: ``DeadlineExceeded``;
- its KV lease would end first (less than ``lease_margin_s`` left, too little
  to pull): ``Overloaded``, naming the lease (the worker had no room in time);
- its lease had (all but) ended when it arrived: ``LeaseExpired``, a transfer
  failure (the router recomputes, under ``transfer.on_failure: recompute``).

One asyncio loop owns the queue, the one its first ``admit`` ran on (it may be made
before); ``wake_threadsafe`` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from splitserve.wire.errors import DeadlineExceeded, LeaseExpired, LoRASlotsBusy, Overloaded

Allocate = Callable[[], Awaitable[list[int] | None]]  # the blocks, or None while the cache is full


@dataclass(eq=False)
class _Waiting:
    request_id: str
    allocate: Allocate
    deadline: float | None  # time.monotonic()
    lease_end: float  # time.monotonic() past which the pull could not start in time
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class AdmissionQueue:
    def __init__(self, worker_id: str, max_waiting: int, retry_s: float = 0.5, lease_margin_s: float = 1.0):
        if max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        self.worker_id = worker_id
        self.max_waiting = max_waiting
        self.retry_s = retry_s
        self.lease_margin_s = lease_margin_s
        self._queue: deque[_Waiting] = deque()
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # the owner's, from the first admit on
        self._runner: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._queue)

    async def admit(
        self, request_id: str, allocate: Allocate, deadline: float | None, lease_s: float
    ) -> list[int]:
        """Wait for this request's turn and its blocks; returns the block ids
        ``allocate`` produced. Raises ``LeaseExpired``, ``Overloaded`` or ``DeadlineExceeded`` (see the
        module docstring), or what ``allocate`` raised. If the caller is cancelled
        the request leaves the queue; blocks allocated meanwhile are the caller's
        to free (by request id)."""
        if lease_s <= self.lease_margin_s:
            raise LeaseExpired(
                f"the KV lease of request {request_id} ended before decode worker {self.worker_id} "
                f"got it ({lease_s * 1000:.0f} ms left)"
            )
        if len(self._queue) >= self.max_waiting:
            raise Overloaded(
                f"decode worker {self.worker_id} has {len(self._queue)} requests waiting for KV blocks; "
                "retry later"
            )
        self._loop = asyncio.get_running_loop()
        lease_end = time.monotonic() + lease_s - self.lease_margin_s
        entry = _Waiting(request_id, allocate, deadline, lease_end)
        self._queue.append(entry)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        else:
            self._wake.set()
        try:
            return await entry.future
        finally:
            if entry.future.cancelled() or not entry.future.done():  # the caller was cancelled
                entry.future.cancel()
                self._drop(entry)
                self._wake.set()  # the runner may have been waiting on this entry

    def wake(self) -> None:
        """Blocks may have been freed: try the head again now."""
        self._wake.set()

    def wake_threadsafe(self) -> None:
        """``wake`` from any thread (before any request came, nothing waits: no-op)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _drop(self, entry: _Waiting) -> None:
        with contextlib.suppress(ValueError):
            self._queue.remove(entry)

    async def _run(self) -> None:
        while self._queue:
            head = self._queue[0]
            now = time.monotonic()
            error = self._expired(head, now)
            if error is not None:
                self._drop(head)
                head.future.set_exception(error)
                continue
            self._wake.clear()  # a wake during allocate() below is not lost
            try:
                blocks = await head.allocate()
            except LoRASlotsBusy:  # it waits for a slot: those behind it may go meanwhile
                if await self._behind(head):
                    continue
                blocks = None
            except Exception as e:  # e.g. InvalidRequest: this request only
                self._drop(head)
                if not head.future.done():
                    head.future.set_exception(e)
                continue
            if blocks is not None:
                self._drop(head)
                if not head.future.done():  # else its caller gave up meanwhile and frees them
                    head.future.set_result(blocks)
                continue
            wait = min(self.retry_s, head.lease_end - now)
            if head.deadline is not None:
                wait = min(wait, head.deadline - now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(wait, 0.0))

    async def _behind(self, head: _Waiting) -> bool:
        """Try the requests behind ``head`` in order, up to the first that waits for blocks;
        whether one was admitted (or left with its error)."""
        for entry in list(self._queue)[1:]:
            error = self._expired(entry, time.monotonic())
            try:
                if error is not None:
                    raise error
                blocks = await entry.allocate()
            except LoRASlotsBusy:
                continue
            except Exception as e:
                self._drop(entry)
                if not entry.future.done():
                    entry.future.set_exception(e)
                return True
            if blocks is None:  # block pressure: the order of arrival rules again
                return False
            self._drop(entry)
            if not entry.future.done():
                entry.future.set_result(blocks)
            return True
        return False

    def _expired(self, head: _Waiting, now: float) -> Exception | None:
        if head.deadline is not None and now >= head.deadline:
            return DeadlineExceeded(
                f"request {head.request_id} found no KV blocks on {self.worker_id} before its deadline"
            )
        if now >= head.lease_end:
            return Overloaded(
                f"decode worker {self.worker_id} had no room for request {head.request_id} "
                "before its KV lease ran out"
            )
        return None
