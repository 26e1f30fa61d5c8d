"""Calls a caller does not wait for (a router's aborts; a decode worker's confirmations
and releases to a prefill worker): their outcome is of no interest to the request
that made them, but they must run to the end and their errors must not go
unretrieved. And ``cancelled_by_caller``: whether a ``CancelledError`` was meant for
the task it ends. Plain asyncio (no torch), shared by router and workers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable


class Background:
    """Runs awaitables to their end without awaiting them. Used from one asyncio loop."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def run(self, call: Awaitable[object]) -> None:
        """Run ``call``; its errors are dropped (a lost worker frees everything anyway; a
        lease ends by itself)."""

        async def quiet() -> None:
            with contextlib.suppress(Exception):
                await call

        task = asyncio.ensure_future(quiet())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def cancelled_by_caller() -> bool:
    """Whether the running task was asked to stop (``Task.cancel``: its client left, its
    deadline passed, its server shuts down). A ``CancelledError`` raised in a task that
    was not is a stray one (e.g. the call of a gRPC channel that closed under it): it
    stands for an error of that call and must be answered as one, never passed on as
    a cancellation (grpc.aio ends a handler that raises it without any status)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
