"""A worker's end of the KV data plane: the handshakes it holds per source, and each
pull run on every rank that takes the KV. One per worker that takes KV from elsewhere
(a decode worker; a prefill worker borrowing prefixes), under every leased pull it
makes (``kv_transfer.leased_pull``).

``KVPuller`` owns rank 0's ``RankSink`` (driven by one transfer thread, since a
sink is not thread-safe: pulls overlap the engine's steps) and calls the other
ranks of a TP group (``decode_worker.tp``) to pull their KV heads at the same
time. Handshakes cross once per source incarnation (``link``); a pull returns or
raises only once every rank's pull ended, because until then bytes may be landing
in the blocks. On the worker's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from splitserve.kv_transfer.tp_mapping import RankSink
from splitserve.wire.decode import DecodePeer, DecodeRankPeer
from splitserve.wire.errors import PeerLost, WorkerLost
from splitserve.wire.kv import Confirmation, KVHandoff
from splitserve.wire.prefill import PrefillPeer

Locate = Callable[[list[int]], tuple[int, list[int]]]  # under EP: the rank holding blocks, its ids


class KVPuller:
    def __init__(
        self, worker_id: str, sink: RankSink, ranks: Sequence[DecodeRankPeer], locate: Locate | None
    ):
        """``ranks``: the TP group's other ranks, in rank order (none for TP=1). ``locate``:
        under expert parallelism (each rank caches its own sequences), which rank's share
        of the group's blocks holds given block ids; None under TP, where every rank
        takes its KV heads into the same ids."""
        self.sink = sink
        self.ranks = tuple(ranks)
        self._locate = locate
        # prefill worker id -> the source incarnations (one per TP rank) whose handshakes every
        # rank's sink holds. Written once a link finished.
        self._peers: dict[str, tuple[str, ...]] = {}
        self._linking: dict[str, asyncio.Lock] = {}  # by prefill worker id: one link at a time
        self._transfer = ThreadPoolExecutor(1, thread_name_prefix=f"{worker_id}-kv")

    @property
    def peers(self) -> dict[str, tuple[str, ...]]:
        """The linked sources: prefill worker id -> its incarnations (a copy)."""
        return dict(self._peers)

    async def link(self, source: PrefillPeer | DecodePeer, handoff: KVHandoff) -> None:
        """Hold the handshakes of ``handoff``'s source incarnations (a prefill worker's, or
        a decode worker's a request moved from), fetching them from the source once per
        incarnation. ``PeerLost`` if it is gone or restarted since."""
        key = handoff.source_worker
        if self._peers.get(key) == handoff.incarnations:
            return
        async with self._linking.setdefault(key, asyncio.Lock()):
            if self._peers.get(key) == handoff.incarnations:
                return
            try:
                info = await source.info()
            except WorkerLost as e:
                raise PeerLost(f"worker {key} is gone with this KV: {e}") from None
            handshakes = info.handshakes
            if tuple(hs.incarnation for hs in handshakes) != handoff.incarnations:
                raise PeerLost(f"worker {key} restarted since it exported this KV")
            loop = asyncio.get_running_loop()
            own = loop.run_in_executor(self._transfer, self.sink.connect, list(handshakes))
            await all_of(own, *(rank.link(handshakes) for rank in self.ranks))
            self._peers[key] = handoff.incarnations

    async def pull(
        self, handoff: KVHandoff, blocks: list[int], timeout: float
    ) -> tuple[list[Confirmation], float]:
        """Under TP every rank pulls its KV heads of ``handoff`` into ``blocks`` at once;
        under EP the one rank whose share of the cache holds ``blocks`` pulls all the KV
        into its own block ids. Returns once all have ended (bytes may be landing in the
        blocks until then): every confirmation, and the seconds waited for a streamed
        source's layers. The first rank's error, if any, is raised after all have ended."""
        descs, loop = handoff.descriptors, asyncio.get_running_loop()
        pulls = [
            loop.run_in_executor(self._transfer, self.sink.pull, descs, ids, timeout)
            if rank == 0
            else self.ranks[rank - 1].pull(descs, ids, timeout)
            for rank, ids in self._holders(blocks)
        ]
        (confirmations, waited), *others = await all_of(*pulls)
        return [c for cs, _ in ((confirmations, waited), *others) for c in cs], waited

    def close(self) -> None:
        """After the last pull: stops the transfer thread and closes the sink."""
        self._transfer.shutdown(wait=True)
        self.sink.close()

    def _holders(self, blocks: list[int]) -> list[tuple[int, list[int]]]:
        """(rank, its block ids) of every rank that takes KV into ``blocks``."""
        if self._locate is None:
            return [(r, blocks) for r in range(1 + len(self.ranks))]
        return [self._locate(blocks)]


async def all_of(*awaitables):
    """The results of ``awaitables`` once every one has ended, or else the first error
    among them once every one has ended: a failure does not leave the others running
    unwatched. Cancelling the caller cancels none of them (they run to their end)."""
    results = await asyncio.shield(asyncio.gather(*awaitables, return_exceptions=True))
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        raise error
    return results
