"""Handshakes once per peer pair: ``PeerLinks`` remembers which decode worker holds
which prefill worker incarnation's handshakes, and sends them only when a
handoff names an incarnation its decode worker does not hold yet.

A decode worker that lost them (it restarted) says so with
``HandshakeRequired``; the dispatcher then ``forget``s its links and links
again. Concurrent requests for one new pair wait for one ``connect`` call.
"""

from __future__ import annotations

import asyncio

from splitserve.kv_transfer.contract import KVHandoff
from splitserve.router.registry import WorkerRecord, WorkerRegistry


class PeerLinks:
    def __init__(self, registry: WorkerRegistry):
        self.registry = registry
        self._linked: dict[tuple[str, str], tuple[str, ...]] = {}  # (decode, prefill) -> incarnations
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def ensure(self, decode: WorkerRecord, prefill: WorkerRecord, handoff: KVHandoff) -> None:
        """Make sure ``decode`` holds the handshakes of ``handoff``'s source incarnations."""
        key = (decode.worker_id, prefill.worker_id)
        if self._linked.get(key) == handoff.incarnations:
            return
        async with self._locks.setdefault(key, asyncio.Lock()):
            if self._linked.get(key) == handoff.incarnations:
                return
            handshakes = await self.registry.handshakes_for(prefill, handoff.incarnations)
            await decode.client.connect(handshakes)
            self._linked[key] = handoff.incarnations

    def forget(self, decode_id: str) -> None:
        """``decode_id`` may have lost every handshake (it restarted or is gone)."""
        for key in [k for k in self._linked if k[0] == decode_id]:
            del self._linked[key]
