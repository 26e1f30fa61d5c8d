"""The router's state for one request in flight, and its deadline."""

from __future__ import annotations

import asyncio
import time

from splitserve.engine.errors import DeadlineExceeded
from splitserve.engine.sampling_params import SamplingParams
from splitserve.router.registry import WorkerRecord


class RequestState:
    """Owned by the one ``Dispatcher.generate`` call serving the request."""

    def __init__(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None
    ):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.accepted = time.time()
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.touched: list[WorkerRecord] = []  # workers to abort on when the request ends
        self.sent: list[int] = []  # token ids yielded to the client so far
        self.first_token_at: float | None = None
        self.prefill_started: float | None = None
        self.prefilled_at: float | None = None  # time.monotonic() when a prefill worker's result came
        self.transfer_s = 0.0
        self.cached = 0

    def remaining(self) -> float | None:
        """Seconds left before the deadline (at least 1 ms), or None without one."""
        return None if self.deadline is None else max(0.001, self.deadline - time.monotonic())

    async def within(self, awaitable):
        """Await a worker call; past the deadline, ``DeadlineExceeded`` (the call is cancelled)."""
        if self.deadline is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, self.deadline - time.monotonic())
        except TimeoutError:
            raise DeadlineExceeded(
                f"request {self.request_id} did not finish within {self.timeout_s:.3g} s"
            ) from None
