"""Handshakes once per peer pair: ``PeerLinks`` remembers which decode worker holds
which prefill worker incarnation's handshakes, and sends them only when a
handoff names an incarnation its decode worker does not hold yet.

A decode worker that lost them (it restarted) says so with
``HandshakeRequired``; the dispatcher then ``forget``s its links and links
again. Concurrent requests for one new pair wait for one ``connect`` call.
A source that cannot be reached for its handshakes (the prefill worker died
or restarted since it exported) is ``PeerLost``: its KV is gone.
"""

from __future__ import annotations

import asyncio

from splitserve.kv_transfer.contract import KVHandoff
from splitserve.kv_transfer.errors import PeerLost
from splitserve.router.errors import WorkerLost
from splitserve.router.registry import WorkerRecord, WorkerRegistry


class PeerLinks:
    def __init__(self, registry: WorkerRegistry):
        self.registry = registry
        self._linked: dict[tuple[str, str], tuple[str, ...]] = {}  # (decode, prefill) -> incarnations
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def ensure(self, decode: WorkerRecord, prefill: WorkerRecord, handoff: KVHandoff) -> None:
        """Make sure ``decode`` holds the handshakes of ``handoff``'s source incarnations.
        Raises ``PeerLost`` if the source is gone, ``WorkerLost`` if ``decode`` is."""
        key = (decode.worker_id, prefill.worker_id)
        if self._linked.get(key) == handoff.incarnations:
            return
        async with self._locks.setdefault(key, asyncio.Lock()):
            if self._linked.get(key) == handoff.incarnations:
                return
            try:
                handshakes = await self.registry.handshakes_for(prefill, handoff.incarnations)
            except WorkerLost as e:
                raise PeerLost(f"prefill worker {prefill.worker_id} is gone with this KV: {e}") from None
            await decode.client.connect(handshakes)
            self._linked[key] = handoff.incarnations

    def forget(self, decode_id: str) -> None:
        """``decode_id`` may have lost every handshake (it restarted or is gone)."""
        for key in [k for k in self._linked if k[0] == decode_id]:
            del self._linked[key]
