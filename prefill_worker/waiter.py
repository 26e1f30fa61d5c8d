"""A ``prefill`` call's side of its request: what it waits for, and until when.

The worker's event loop makes one ``Waiter`` per ``prefill``/``prefill_stream``
call; the engine thread resolves it (``resolve``, ``announce``), by way of the
loop's ``call_soon_threadsafe``, so the futures are only touched on their loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from splitserve.engine.containment import contained
from splitserve.engine.text import Texts
from splitserve.prefill_worker.borrow import Borrowed
from splitserve.wire.errors import DeadlineExceeded, SequenceFailed
from splitserve.wire.kv import KVHandoff
from splitserve.wire.outputs import RequestOutput
from splitserve.wire.prefill import PrefillResult, PrefillTask
from splitserve.wire.sampling import FinishReason


@dataclass
class Waiter:
    """A ``prefill`` call awaiting its request. Resolved from the engine thread."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future  # the PrefillResult
    streamed: asyncio.Future | None = None  # the KVHandoff, once its export streams (prefill_stream)
    deadline: float | None = None  # loop.time() past which the call gives up
    readers: tuple[int, ...] = (1,)  # per TP rank here: the decode ranks that read its export
    borrowed: Borrowed | None = None  # its prompt's prefix, pulled from another prefill worker

    def resolve(self, result: PrefillResult | None = None, error: BaseException | None = None) -> None:
        def _set() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        self.loop.call_soon_threadsafe(_set)

    def announce(self, handoff: KVHandoff) -> None:
        def _set() -> None:
            if self.streamed is not None and not self.streamed.done():
                self.streamed.set_result(handoff)

        self.loop.call_soon_threadsafe(_set)

    async def within(self, task: PrefillTask, awaitable):
        """``awaitable``'s result, or ``DeadlineExceeded`` once the call's deadline passed."""
        try:
            async with asyncio.timeout_at(self.deadline):
                return await awaitable
        except TimeoutError:
            raise DeadlineExceeded(
                f"request {task.request_id} was not prefilled within {task.timeout_s:.3g} s"
            ) from None

    def result(
        self, out: RequestOutput, worker_id: str, revision: str, handoff: KVHandoff | None
    ) -> PrefillResult:
        """The call's answer for its prefilled request ``out`` (exported as ``handoff``,
        None when it ended at its first token), from ``worker_id`` serving ``revision``."""
        borrowed = self.borrowed
        return PrefillResult(
            request_id=out.request_id,
            worker_id=worker_id,
            revision=revision,
            output_token_ids=list(out.new_token_ids),
            text=out.text,
            logprobs=list(out.new_logprobs),
            top_logprobs=list(out.new_top_logprobs),
            prompt_logprobs=out.prompt_logprobs,
            token_time=time.time(),
            finish_reason=None if out.finish_reason == FinishReason.PREFILL_DONE else out.finish_reason,
            num_cached_tokens=out.num_cached_tokens,
            handoff=handoff,
            scheduled_at=out.scheduled_at,
            pulled_tokens=borrowed.pulled_tokens if borrowed is not None else 0,
            pulled_from=borrowed.holder_id if borrowed is not None and borrowed.pulled_tokens else "",
        )


def first_text(texts: Texts, out: RequestOutput) -> SequenceFailed | None:
    """Make the text of a prefilled request's first token (``out``, its one output, in
    place: a stop string there ends it, ``STOP``); the failure to, as its own."""
    try:
        texts.feed(out)
    except Exception as e:
        return contained("detokenization", e)
    return None
