"""How the router talks to a worker: the ``WorkerClient`` protocol.

Everything the dispatcher and the registry do to a worker goes through these
calls, and every error comes back as splitserve's own exception (a dead worker
is ``WorkerLost``), so the request path never sees the transport. Over Ray,
``cluster.worker_client`` implements it; the router's tests drive it with plain
fakes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from splitserve.wire.decode import (
    DecodePeer,
    DecodeStats,
    DecodeTask,
    DecodeWorkerInfo,
    MovedRequest,
    PreCopy,
    TokenBatch,
)
from splitserve.wire.engine_commands import LoadAdapter, UnloadAdapter
from splitserve.wire.prefill import PrefillStats, PrefillWorkerInfo
from splitserve.wire.prefix import PrefixCursor

WorkerStats = PrefillStats | DecodeStats
WorkerInfo = PrefillWorkerInfo | DecodeWorkerInfo


class WorkerClient(Protocol):
    """A prefill, decode or colocated worker as the router sees it. A prefill worker's
    client is also a ``PrefillPeer``: the router hands it to a decode worker in
    ``DecodeTask.source``. Calls a role does not have raise (the router never makes
    them)."""

    async def info(self) -> WorkerInfo: ...

    async def stats(self, prefix_since: PrefixCursor | None = None) -> WorkerStats:
        """Load figures, with the worker's prefix-cache changes since ``prefix_since``."""
        ...

    async def abort(self, request_id: str) -> bool: ...

    async def change_adapters(self, change: LoadAdapter | UnloadAdapter) -> str | None:
        """Load a LoRA adapter on the worker's engine (its digest) or unload one."""
        ...

    def generate(self, task: DecodeTask) -> AsyncIterator[TokenBatch]:
        """A decode worker's batches of ``task``, up to the one with ``finish_reason`` (or
        marked ``moved``: it left for another decode worker). A batch's ``error`` is
        raised after its tokens; a lost worker is ``WorkerLost``. Leaving early aborts
        the request on the worker (which lets go of what the prefill worker holds for it)."""
        ...

    async def move_out(self, request_id: str, export: bool = True, from_block: int = 0) -> MovedRequest:
        """A decode worker: let go of running ``request_id`` for another to take over (live
        migration), exporting its KV after the first ``from_block`` blocks (the taker
        copied those ahead: ``precopy``) or not at all (the taker recomputes it); its
        stream here then ends marked ``moved``."""
        ...

    async def precopy(self, task: PreCopy) -> int:
        """A decode worker a request is about to move to: copy its KV's full blocks so far
        from the worker it runs on (which it still decodes on). Returns the leading blocks
        it holds now (0: none, holding nothing); ``abort`` frees them."""
        ...

    def peer(self) -> DecodePeer:
        """A decode worker as another calls it to take over a request it moved away
        (picklable: it travels in ``DecodeTask.moved_from``)."""
        ...

    async def close(self) -> None:
        """Let go of what this client keeps open to the worker (a decode worker's token
        stream; requests still running on it are aborted there). Before removal."""
