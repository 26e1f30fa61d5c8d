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

from splitserve.decode_worker.handover import DecodeSide, Ending, Phase, WayIn, transitions
from splitserve.decode_worker.outbox import Outbox
from splitserve.wire.decode import DecodeTask

_NEXT = transitions((Phase.LINKING, Phase.WAITING_FOR_BLOCKS, Phase.PULLING, Phase.ACTIVATING, Phase.RUNNING))


class Migration(WayIn):
    """One moved request from its start here to RUNNING or ENDED; run as a task by the
    worker (cancelling it ends the migration, freeing what its phase held)."""

    def __init__(self, task: DecodeTask, deadline: float | None, outbox: Outbox, side: DecodeSide):
        """``deadline``: the request's, in ``time.monotonic()``, or None."""
        if task.moved is None or task.moved_from is None:
            raise ValueError("a migration takes a request moved from another decode worker")
        super().__init__(task, deadline, outbox, side, Phase.LINKING, _NEXT)

    async def run(self) -> Ending | None:
        """None once the request is RUNNING here; else, ENDED, the error it ends with."""
        try:
            pulled = await self._pull_in(self.task.moved_from, self.task.moved.handoff)
            await self._activate(pulled.pulled_s, [])
            return None
        except asyncio.CancelledError:
            await self._end()
            raise
        except Exception as e:
            ending = Ending(e)
        await self._end()
        return ending
