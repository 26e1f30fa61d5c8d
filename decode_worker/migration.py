"""One request moving into a decode worker from another, running (live migration),
as a state machine: the other half of ``decode_worker.mover``.

The router suspended the request on the worker it ran on (``move_out``: its
tokens so far delivered, its KV exported under a lease) and starts it here with
``DecodeTask.moved``; this worker links to that worker's KV source, finds blocks
for the KV of the prompt and every token but the last in the admission queue,
pulls and verifies it, confirms it and puts the request into its batch, which
samples the next token as the other worker would have. No token is computed
again or sent twice. The phases (``handover.Phase``, a subset), and what each
holds::

    phase               entered when                          holds here        on the other worker
    LINKING             the migration starts                  nothing           the export, unconfirmed
    WAITING_FOR_BLOCKS  this worker holds its handshake        nothing           the export
    PULLING             the admission queue allocated blocks   all the blocks;   the export
                        for the KV; the pull began             bytes landing
    ACTIVATING          the pull ended whole within the lease  all the blocks    nothing (confirmed)
    RUNNING             the engine activated the request       (the engine's)    nothing
    ENDED               any end before RUNNING                 nothing           nothing

An end before RUNNING frees what the phase held in ``handover``'s order: a pull
in flight is awaited, the engine frees the blocks, an export not confirmed is
released on the other worker (``abort``). ``run`` returns the error the request
ends with (a ``KVTransferError``: the router then has this worker prefill it
with its tokens instead, as after any failed transfer).
"""

from __future__ import annotations

import asyncio
import time

from splitserve.decode_worker.handover import DecodeSide, Ending, Phase, end_import, pull_timeout, transitions
from splitserve.decode_worker.outbox import Outbox
from splitserve.kv_transfer.leased_pull import LeasedPull
from splitserve.wire.decode import DecodeTask, TokenBatch

_NEXT = transitions((Phase.LINKING, Phase.WAITING_FOR_BLOCKS, Phase.PULLING, Phase.ACTIVATING, Phase.RUNNING))


class Migration:
    """One moved request from its start here to RUNNING or ENDED; run as a task by the
    worker (cancelling it ends the migration, freeing what its phase held)."""

    def __init__(self, task: DecodeTask, deadline: float | None, outbox: Outbox, side: DecodeSide):
        """``deadline``: the request's, in ``time.monotonic()``, or None."""
        if task.moved is None or task.moved_from is None:
            raise ValueError("a migration takes a request moved from another decode worker")
        self.task = task
        self.request_id = task.request_id
        self._deadline = deadline
        self._outbox = outbox
        self._side = side
        self._phase = Phase.LINKING
        # the export's pull, from LINKING on: the other worker holds the export from the start
        self._lease = LeasedPull(
            side, task.moved_from, task.request_id, side.background, f"moved request {task.request_id}"
        )

    @property
    def phase(self) -> Phase:
        return self._phase

    async def run(self) -> Ending | None:
        """None once the request is RUNNING here; else, ENDED, the error it ends with."""
        try:
            await self._take_over()
            return None
        except asyncio.CancelledError:
            await self._end()
            raise
        except Exception as e:
            ending = Ending(e)
        await self._end()
        return ending

    async def _take_over(self) -> None:
        handoff, side = self.task.moved.handoff, self._side
        await self._lease.link(handoff)
        self._to(Phase.WAITING_FOR_BLOCKS)
        blocks = await side.admit(self.task, self._deadline, handoff.remaining_lease())
        self._to(Phase.PULLING)
        pulled = await self._lease.pull(handoff, blocks, pull_timeout(side.spec, self._deadline))
        self._to(Phase.ACTIVATING)
        # before any token: the pull's time, and when this worker took the request into its batch
        self._outbox.put(
            TokenBatch(self.request_id, [], "", [], [], None, 0, pulled.pulled_s, started_at=time.time())
        )
        await side.activate(self.request_id, [])
        self._to(Phase.RUNNING)

    async def _end(self) -> None:
        await end_import(self._side, self.request_id, self._lease)
        self._to(Phase.ENDED)

    def _to(self, phase: Phase) -> None:
        if phase not in _NEXT[self._phase]:
            raise RuntimeError(
                f"migration of {self.request_id}: no transition {self._phase.name} -> {phase.name}"
            )
        self._phase = phase
