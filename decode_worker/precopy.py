"""Pre-copy: a decode worker copies a running request's KV from the decode worker it
runs on before the request moves here (live migration), so that the move itself,
while the client waits, copies only the blocks the request filled since.

The router asks (``DecodeWorker.precopy`` with a ``PreCopy``) while the request still
decodes on the holder; ``PreCopier.copy``::

    engine.reserve_moving   hold the request's full blocks so far this engine has,
                            allocate the others (IMPORTING under the request's id)
    holder.lend_running     the holder exports the request's blocks after those (a
                            lease), sharing them while the request decodes on
    link, pull              over the transfer backend, verified; confirmed to the holder
    engine.fill_moving      the blocks hold their KV now
    -> the blocks it holds  the router passes them to the holder's ``move_out``
                            (``from_block``): the move exports only the blocks after

The move then starts here as any (``decode_worker.migration``): its import
(``Engine.import_request``) takes the blocks held under its id and allocates the rest.
Whatever fails on the way is logged, everything is freed here and released there, and
``copy`` returns 0: the move copies all of the KV, as without a pre-copy. A copy the
move does not follow within the lease (the router gave up, or is gone) is freed
(``held``'s timers); so is one the router aborts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from splitserve.kv_transfer.leased_pull import LeasedPull, Puller, why_failed
from splitserve.wire.background import Background
from splitserve.wire.decode import PreCopy, RunningLoan
from splitserve.wire.engine_commands import Abort, EngineCommand, FillMoving, ReserveMoving
from splitserve.wire.errors import PeerLost, SplitserveError

log = logging.getLogger(__name__)

Submit = Callable[[EngineCommand], Awaitable[Any]]  # runs a command on the engine's thread


class PreCopier:
    """Copies moving requests' KV into one engine ahead of their moves. On the worker's
    asyncio loop."""

    def __init__(self, worker_id: str, puller: Puller, block_size: int, submit: Submit, lease_s: float):
        """``lease_s``: how long a copy waits for its move before it is freed."""
        self.worker_id = worker_id
        self.block_size = block_size
        self.lease_s = lease_s
        self._puller = puller
        self._submit = submit
        self._background = Background()  # confirmations and releases to holders, not awaited
        self.held: dict[str, asyncio.TimerHandle] = {}  # copies waiting for their move -> expiry
        self.copies = 0  # copies that moved KV in
        self.failures = 0  # copies that moved nothing (the move copies it all)

    async def copy(self, task: PreCopy) -> int:
        """Copy ``task``'s full blocks so far (see the module docstring). Returns how many
        leading blocks of the request this engine holds now (0: none; nothing held)."""
        rid, bs = task.request_id, self.block_size
        self.taken(rid)  # a stale copy of it (its move failed) is dropped first
        prompt, outputs, params = task.prompt_token_ids, task.output_token_ids, task.params
        try:
            held, blocks = await asyncio.shield(self._submit(ReserveMoving(rid, prompt, outputs, params)))
        except asyncio.CancelledError:  # it may hold the blocks now: they are freed
            await self._submit(Abort(rid))
            raise
        except SplitserveError as e:  # no room, or nothing to copy yet: the move copies it all
            return self._failed(task, e)
        loan_id, lease, digest = f"{rid}/precopy", None, None
        try:
            async with asyncio.timeout(task.timeout_s):
                if blocks:
                    tokens = [*task.prompt_token_ids, *task.output_token_ids][: (held + len(blocks)) * bs]
                    what = f"the KV copied ahead of moving request {rid}"
                    lease = LeasedPull(self._puller, task.holder, loan_id, self._background.run, what)
                    loaned = await task.holder.lend_running(RunningLoan(loan_id, rid, tokens, held))
                    if loaned is None:
                        raise PeerLost(f"{task.holder_id} holds none of the blocks it was asked for")
                    blocks = blocks[: len(loaned.descriptors[0].block_ids)]
                    await lease.link(loaned)
                    await lease.pull(loaned, blocks, task.timeout_s)
                    digest = loaned.adapter_digest
                await self._submit(FillMoving(rid, held + len(blocks), digest))
        except asyncio.CancelledError:
            await self._give_up(rid, lease)
            raise
        except Exception as e:  # whatever it was, the move copies it all
            await self._give_up(rid, lease)
            return self._failed(task, e)
        self.copies += 1
        self.held[rid] = asyncio.get_running_loop().call_later(self.lease_s, self._expire, rid)
        return held + len(blocks)

    def taken(self, request_id: str) -> None:
        """The move came for ``request_id`` (or it was aborted here): its copy no longer
        waits for it."""
        timer = self.held.pop(request_id, None)
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        for timer in self.held.values():
            timer.cancel()
        self.held.clear()

    # ---- internals ---------------------------------------------------------------
    def _expire(self, request_id: str) -> None:
        if self.held.pop(request_id, None) is not None:
            log.warning(
                "%s: the move of %s did not come; its pre-copied KV is freed", self.worker_id, request_id
            )
            self._background.run(self._submit(Abort(request_id)))

    async def _give_up(self, rid: str, lease: LeasedPull | None) -> None:
        """Free the reserved blocks once no pull writes into them; release the loan if the
        holder was asked for one (it may have lent it after this side gave up)."""
        free = lambda: self._submit(Abort(rid))  # noqa: E731
        await (free() if lease is None else lease.end(free))

    def _failed(self, task: PreCopy, error: Exception) -> int:
        self.failures += 1
        why, traceback = why_failed(error)
        log.warning(
            "%s: copying %s's KV of moving request %s ahead failed (%s); the move copies it all",
            self.worker_id,
            task.holder_id,
            task.request_id,
            why,
            exc_info=traceback,
        )
        return 0
