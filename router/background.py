"""Worker calls the router does not wait for (abort, confirm, a first token), and
read-aheads it gives up: their outcome is of no interest to the request that made
them, but they must run to the end and their errors must not go unretrieved."""

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


async def cancel(task: asyncio.Future) -> None:
    """Cancel ``task`` and let it end; what it raised is dropped."""
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved
