"""Prefixes a prefill worker takes from another prefill worker instead of computing them.

When the router knows that another prefill worker (the holder) caches a prompt's
leading blocks that this one lacks, and judged copying them cheaper than computing
them (``router.decider``), the task names it (``PrefillTask.prefix_from``). Before
the prompt enters the engine, ``PrefixBorrower.borrow``::

    engine.reserve_prefix   hold the prefix blocks this engine has, allocate the rest
    holder.lend_prefix      the holder exports the blocks after those (a lease)
    link, pull              a leased pull (``kv_transfer.leased_pull``) by the worker's
                            ``KVPuller``: the holder's handshake once per incarnation,
                            the bytes over the transfer backend, verified per layer,
                            confirmed to the holder (by the backend, or by confirm)
    -> Borrowed             the caller adopts the blocks (engine.adopt_prefix) and adds
                            the prompt in the same engine call: the prompt finds them cached

Whatever fails on the way (no room, the holder evicted them or is gone, the pull
failed, timed out or was corrupt) is logged and counted, the blocks are freed here and
released there, and ``borrow`` returns None: the prompt is computed as if no pull had
been planned. No request fails for a pull. A borrow the caller cancels frees its blocks
only once the pull in flight ended (bytes may still be landing in them).

One worker of TP=1 (its engine's group of one) on each side; the holder refuses a loan
otherwise (it returns None).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from splitserve.kv_transfer.leased_pull import LeasedPull, Puller, why_failed
from splitserve.wire.background import Background
from splitserve.wire.engine_commands import Abort, EngineCommand, ReservePrefix
from splitserve.wire.errors import InvalidRequest, Overloaded, PeerLost
from splitserve.wire.prefill import PrefillTask, PrefixLoan, PrefixPull

log = logging.getLogger(__name__)

Submit = Callable[[EngineCommand], Awaitable[Any]]  # runs a command on the engine's thread


@dataclass(frozen=True)
class Borrowed:
    """A prefix reserved under ``loan_id`` whose first ``num_blocks`` hold their KV now;
    ``pulled_tokens`` of them came from ``holder_id``."""

    loan_id: str
    num_blocks: int
    pulled_tokens: int
    holder_id: str


class PrefixBorrower:
    """Pulls prefixes into one engine's cache. Used from the worker's asyncio loop."""

    def __init__(self, worker_id: str, puller: Puller, block_size: int, submit: Submit, timeout_s: float):
        """``puller``: the worker's (its handshakes and transfer thread); ``timeout_s``
        bounds one borrow (the loan, the link and the pull; a task's own ``timeout_s``,
        if shorter)."""
        self.worker_id = worker_id
        self.block_size = block_size
        self.timeout_s = timeout_s
        self._puller = puller
        self._submit = submit
        self._background = Background()  # confirmations and releases to holders, not awaited
        self.pulls = 0  # borrows that moved KV in
        self.failures = 0  # borrows that moved nothing (the prompt computed it)

    async def borrow(self, task: PrefillTask) -> Borrowed | None:
        """Take ``task.prefix_from``'s blocks of ``task``'s prompt into the engine (see
        the module docstring); None when nothing is to be adopted."""
        pull = task.prefix_from
        prompt, bs = task.prompt_token_ids, self.block_size
        num_blocks = min(pull.num_blocks, (len(prompt) - 1) // bs)  # the last token's block computes
        if num_blocks <= 0:
            return None
        loan_id, prefix = f"{task.request_id}/prefix", prompt[: num_blocks * bs]
        try:
            held, blocks = await self._submit(ReservePrefix(loan_id, prefix))
        except (Overloaded, InvalidRequest) as e:  # no room, or this model borrows no prefix (hybrid)
            return self._failed(task, pull, e)
        if not blocks:  # it holds them all already
            return Borrowed(loan_id, held, 0, "")
        limit = self.timeout_s if task.timeout_s is None else min(self.timeout_s, task.timeout_s)
        what = f"the prefix of request {task.request_id}"
        lease = LeasedPull(self._puller, pull.holder, loan_id, self._background.run, what)
        try:
            async with asyncio.timeout(limit):
                loaned = await pull.holder.lend_prefix(PrefixLoan(loan_id, prefix, held))
                if loaned is None:
                    raise PeerLost(f"{pull.holder_id} holds none of the blocks it was asked for")
                lent = loaned.descriptors[0]
                got = blocks[: len(lent.block_ids)]  # the lender may hold fewer (never with layer groups)
                await lease.link(loaned)
                await lease.pull(loaned, got, limit)
        except asyncio.CancelledError:
            await lease.end(lambda: self._submit(Abort(loan_id)))
            raise
        except Exception as e:  # whatever it was, the prompt is computed instead
            await lease.end(lambda: self._submit(Abort(loan_id)))
            return self._failed(task, pull, e)
        self.pulls += 1
        return Borrowed(loan_id, held + lent.num_tokens // bs, lent.num_tokens, pull.holder_id)

    # ---- internals ---------------------------------------------------------------
    def _failed(self, task: PrefillTask, pull: PrefixPull, error: Exception) -> None:
        self.failures += 1
        why, traceback = why_failed(error)
        log.warning(
            "%s: pulling %s's prefix of %s failed (%s); computing it",
            self.worker_id,
            pull.holder_id,
            task.request_id,
            why,
            exc_info=traceback,
        )
        return None
