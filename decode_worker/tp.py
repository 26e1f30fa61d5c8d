"""A decode (or colocated) worker as a tensor-parallel group: rank 0 is the
``DecodeWorker`` the router talks to; ranks 1.. are ``DecodeRank``s, each a
process (a Ray actor in the same placement group) with its shard of the model
and its own KV cache holding its KV heads, in the blocks rank 0 allocates.

Two channels, each doing one thing::

    rank 0 (DecodeWorker)                      rank r (DecodeRank)
    ---------------------                      -------------------
    the group's broadcast channel (engine thread; ``Engine.follow``):
    engine.step()        -- StepInputs ------>  forward (collectives pair up)
    tick, every timeout/4 -- Heartbeat ------>  (nothing)
    shutdown             -- None ------------>  leave the loop, close

    direct calls (a Ray call each, from rank 0's event loop):
    a source seen first  -- link(handshakes) ->  RankSink.connect (transfer thread)
    a request's KV       -- pull(descs, blocks)  RankSink.pull: rank r's heads into
                                 <-- confirmations   the same block ids (transfer thread)

The pulls go beside the step channel, not on it: every rank pulls at once,
while the group keeps decoding the running batch, and rank 0 activates the
request once every rank's pull ended (it frees the blocks only then, whatever
happened, since bytes may still be landing in them on some rank).

Under expert parallelism (``engine.ep_size``) the protocol is the same, but a
request's KV goes to one rank only, the one whose share of the group's blocks
holds it (whole, into its own block ids), and each rank runs attention for its
own sequences of each step.

Failure: a rank that dies breaks the group's collectives; rank 0's engine loop
then stops and ends every request with ``WorkerLost`` (the router resumes
them on another decode worker), and the pool replaces the whole group.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from splitserve.engine.device import resolve_device
from splitserve.engine.engine import Engine
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.worker_group import Heartbeat, RankFollower, join_group
from splitserve.engine.state_blocks import StateMapper
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.tp_mapping import RankSink
from splitserve.wire.decode import DecodeWorkerSpec
from splitserve.wire.kv import Confirmation, Handshake, KVDescriptor


def join_decode_group(spec: DecodeWorkerSpec) -> TPGroup:
    """Pin and size this process as ``spec`` says, then join its TP group (blocks until
    every rank has joined)."""
    return join_group(spec.tp, resolve_device(spec.engine), spec.cpu_ids, spec.torch_threads)


def rank_sink(worker_id: str, spec: DecodeWorkerSpec, engine: Engine) -> RankSink | None:
    """The sink a rank of a decode worker pulls its KV heads with (None: colocated)."""
    if spec.backend is None:
        return None
    compat = engine.kv_compat()
    max_blocks = compat.layout.most_ids(-(-engine.max_model_len // engine.config.block_size))
    states = None
    if engine.kv_cache.state_plan is not None:  # a hybrid model: its states rebuilt across TP sizes
        states = StateMapper(engine.model_config, compat.layout, engine.kv_cache.states[0].conv.dtype)
        max_blocks += 2 * states.blocks_per_slot + 2  # a source rank's slot, of about as many blocks
    sink = get_backend(spec.backend).sink
    return RankSink(worker_id, engine.kv_cache.tensor, compat, sink, max_blocks, states)


class DecodeRank:
    """Rank r > 0 of a decode worker's TP group. Its constructor returns once the group
    has formed and the shard is loaded; a thread then follows rank 0's steps."""

    def __init__(self, spec: DecodeWorkerSpec):
        if spec.tp is None or spec.tp.rank == 0:
            raise ValueError("a DecodeRank is rank 1 or above of a TP group")
        self.spec = spec
        self.name = f"{spec.worker_id}/tp{spec.tp.rank}"
        self.group = join_decode_group(spec)
        build = lambda: Engine(spec.engine, tp=self.group)  # noqa: E731
        self._follower = RankFollower(build, self._on_message, self._close, name=f"{self.name}-follow")
        self.engine = self._follower.engine
        self.sink = rank_sink(self.name, spec, self.engine)
        self._transfer = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-kv")  # drives the sink
        self._follower.start()

    async def info(self) -> str:
        """What its engine chose (``Engine.summary``): answered once the shard is loaded."""
        return self.engine.summary

    async def link(self, handshakes: tuple[Handshake, ...]) -> None:
        """Link this rank's sink to a source group (``RankSink.connect``)."""
        sink = self._sink()
        await asyncio.get_running_loop().run_in_executor(self._transfer, sink.connect, list(handshakes))

    async def pull(
        self, descriptors: tuple[KVDescriptor, ...], blocks: list[int], timeout: float
    ) -> tuple[list[Confirmation], float]:
        """Pull this rank's KV heads of one request into ``blocks`` (``RankSink.pull``);
        returns its confirmations and the seconds it waited for a streamed source's
        layers. Errors are ``KVSink.pull``'s. The blocks are rank 0's to free (only rank
        0 allocates), and only once every rank's pull has returned; bounded by ``timeout``."""
        sink = self._sink()
        return await asyncio.get_running_loop().run_in_executor(
            self._transfer, sink.pull, descriptors, blocks, timeout
        )

    def wait(self, timeout: float | None = None) -> None:
        """Block until rank 0 stops the group (for a rank hosted outside Ray)."""
        self._follower.join(timeout)

    def _sink(self) -> RankSink:
        if self.sink is None:
            raise RuntimeError(f"{self.name} is colocated and takes no KV from elsewhere")
        return self.sink

    def _close(self) -> None:  # the follower thread, last
        self._transfer.shutdown(wait=True)
        if self.sink is not None:
            self.sink.close()
        self.group.destroy()

    def _on_message(self, msg: object) -> None:
        if not isinstance(msg, Heartbeat):
            raise RuntimeError(f"unknown message {type(msg).__name__} from TP rank 0")
