"""Waiting in tests: for a condition, with a generous deadline, never a fixed sleep.
Every test that waits uses these two (``wait_until`` from a thread, ``until`` on an
event loop), so a deadline's failure always says what did not happen."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object], what: str, timeout: float = 120.0, every: float = 0.2
) -> None:
    """Poll ``condition`` until it holds; past ``timeout`` s, fail saying ``what`` did not happen."""
    if not isinstance(what, str):  # a timeout passed where the sentence goes
        raise TypeError(f"wait_until's second argument is what to wait for, a sentence; got {what!r}")
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} (within {timeout:g} s)")
        time.sleep(every)


async def until(condition: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    """``wait_until`` on the caller's event loop (it keeps running between polls)."""
    if not isinstance(what, str):
        raise TypeError(f"until's second argument is what to wait for, a sentence; got {what!r}")
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} (within {timeout:g} s)")
        await asyncio.sleep(0.001)
