"""Calls a caller does not wait for (a router's aborts; a decode worker's confirmations
and releases to a prefill worker): their outcome is of no interest to the request
that made them, but they must run to the end and their errors must not go
unretrieved. Plain asyncio (no torch), shared by router and workers."""

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
