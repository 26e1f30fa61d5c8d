"""The decode worker: takes prefilled requests (KV pulled from a prefill worker)
or whole ones, runs them in one continuous batch, and streams their tokens.

A request's life here (the queues SGLang's decode side names)::

    connect(handshakes)   once per prefill worker incarnation (the router sends it
                          before the first handoff from that incarnation)
    generate(task) with a handoff:
        handshakes held for handoff.incarnations? else HandshakeRequired (nothing held)
        -> WAITING_FOR_BLOCKS: the FIFO AdmissionQueue (decode_worker.admission)
        -> PULLING: import_request (blocks allocated) + sink.pull on the transfer
           thread (verified; from a TP prefill group, every rank's shard, heads
           merged by HeadMappingSink)
        -> first TokenBatch at once: transfer_s and the confirmations the backend
           could not deliver (the router forwards them to the prefill worker)
        -> activate --RUNNING in the batch-- tokens --> finished
    generate(task) without one (colocated, or a short prompt by policy):
        add_request --WAITING/RUNNING (the engine's own FIFO)-- tokens --> finished

``generate`` is an async generator: one call per request, yielding a
``TokenBatch`` whenever the consumer asks and tokens are ready, so a slow
consumer gets several tokens per item instead of one round trip per token.
Leaving it early (the router cancels, the deadline passes, the client goes)
aborts the request and frees its blocks; a pull in flight is first allowed to
end (it is bounded by ``transfer_timeout_s``), because its bytes are still
landing in those blocks.

The class imports no Ray: ``cluster`` wraps it with ``ray.remote``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import torch

from splitserve.decode_worker.admission import AdmissionQueue, AdmissionState
from splitserve.decode_worker.api import (
    DecodeStats,
    DecodeTask,
    DecodeWorkerInfo,
    DecodeWorkerSpec,
    TokenBatch,
)
from splitserve.engine import (
    DeadlineExceeded,
    Engine,
    EngineLoop,
    InvalidRequest,
    Overloaded,
    RequestOutput,
)
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.contract import CompatInfo, Confirmation, Handshake, KVHandoff
from splitserve.kv_transfer.errors import HandshakeRequired, LeaseExpired
from splitserve.kv_transfer.tp_mapping import HeadMappingSink

log = logging.getLogger(__name__)

_ABORTED = object()  # pushed into a stream by abort()


class _Stream:
    """One request's outputs, on the actor's event loop, for its generator."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    async def next_items(self, timeout: float | None) -> list:
        """Everything queued, waiting up to ``timeout`` for the first item."""
        items = []
        if self.queue.empty():
            get = self.queue.get()
            items.append(await (get if timeout is None else asyncio.wait_for(get, timeout)))
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items


class DecodeWorker:
    def __init__(self, spec: DecodeWorkerSpec):
        if spec.cpu_ids:
            os.sched_setaffinity(0, spec.cpu_ids)
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.worker_id = spec.worker_id
        self.engine = Engine(spec.engine)
        self.sink = None
        # By prefill worker id (TP groups only). Each holds staging caches for one request of
        # max_model_len per source rank, for the life of this worker.
        self._tp_sinks: dict[str, HeadMappingSink] = {}
        # prefill worker id -> the source incarnations (one per TP rank) whose handshakes the
        # sink holds. Written on the actor's event loop after connect() finished.
        self._peers: dict[str, tuple[str, ...]] = {}
        self._states: dict[str, AdmissionState] = {}  # imported requests, until they run
        self._admission: AdmissionQueue | None = None  # made on the actor's loop
        self._aloop: asyncio.AbstractEventLoop | None = None  # the actor's loop, once a request came
        if spec.backend is not None:
            self._compat = CompatInfo(model=spec.engine.model, layout=self.engine.kv_cache.layout)
            self._sink_cls = get_backend(spec.backend).sink
            self.sink = self._sink_cls(spec.worker_id, self.engine.kv_cache.tensor, self._compat)
        # One thread drives the sink (it is not thread-safe); pulls overlap decode steps.
        self._transfer = ThreadPoolExecutor(1, thread_name_prefix=f"{spec.worker_id}-kv")
        self._streams: dict[str, _Stream] = {}
        self.loop = EngineLoop(self.engine, self._on_outputs, name=f"{spec.worker_id}-engine")
        self.loop.start()

    # ---- called by the router (asyncio) ------------------------------------------
    async def info(self) -> DecodeWorkerInfo:
        return DecodeWorkerInfo(self.worker_id, self.engine.validator, colocated=self.sink is None)

    async def connect(self, handshakes: tuple[Handshake, ...]) -> None:
        """Take a prefill worker's handshakes (one per TP rank, rank order) and link to
        it; handoffs from exactly those incarnations are pulled from then on. Raises
        ``IncompatiblePeer`` (nothing is linked then)."""
        self._require_sink()
        await asyncio.get_running_loop().run_in_executor(self._transfer, self._connect, handshakes)
        self._peers[handshakes[0].worker_id] = tuple(hs.incarnation for hs in handshakes)

    async def generate(self, task: DecodeTask) -> AsyncIterator[TokenBatch]:
        """Run ``task`` to the end, yielding its new tokens. Raises ``InvalidRequest``,
        ``HandshakeRequired`` (before anything is held), ``Overloaded`` (the admission
        queue is full, or no room before the KV lease ran out), ``KVTransferError``
        subclasses, or ``DeadlineExceeded`` past ``task.timeout_s``."""
        rid = task.request_id
        if rid in self._streams:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        if task.handoff is not None:
            self._check_linked(task.handoff)
        deadline = None if task.timeout_s is None else time.monotonic() + task.timeout_s
        self._aloop = asyncio.get_running_loop()
        stream = _Stream()
        self._streams[rid] = stream
        finished = False
        try:
            if task.handoff is not None:
                transfer_s, confirmations = await self._import(task, deadline)
                yield TokenBatch([], "", [], [], None, 0, transfer_s, confirmations)
            else:
                await self._call(lambda e: e.add_request(task.prompt_token_ids, task.params, rid))
            while not finished:
                remaining = None if deadline is None else deadline - time.monotonic()
                try:
                    items = await stream.next_items(remaining)
                except TimeoutError:
                    raise DeadlineExceeded(f"request {rid} ran past its {task.timeout_s:.3g} s") from None
                if any(item is _ABORTED for item in items):
                    return
                batch = _batch(items)
                finished = batch.finish_reason is not None
                yield batch
        finally:
            self._streams.pop(rid, None)
            self._states.pop(rid, None)
            if not finished:
                self._abort_in_engine(rid)

    async def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` and free its blocks. Idempotent. Its ``generate`` stream
        ends without a finished batch, which a consumer still reading it (the
        router only aborts after it stopped) would take for a lost worker."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(_ABORTED)
        return await asyncio.wrap_future(self._abort_in_engine(request_id))

    async def stats(self) -> DecodeStats:
        engine = await self._call(lambda e: e.stats())
        states = list(self._states.values())
        return DecodeStats(
            self.worker_id,
            engine,
            len(self._streams),
            num_waiting_for_blocks=states.count(AdmissionState.WAITING_FOR_BLOCKS),
            num_pulling=states.count(AdmissionState.PULLING),
        )

    def shutdown(self) -> None:
        self.loop.stop()
        self._transfer.shutdown(wait=True)
        if self.sink is not None:
            self.sink.close()
        for sink in self._tp_sinks.values():
            sink.close()

    # ---- internals ------------------------------------------------------------
    async def _call(self, fn):
        return await asyncio.wrap_future(self.loop.call(fn))

    def _require_sink(self) -> None:
        if self.sink is None:
            raise InvalidRequest(f"worker {self.worker_id} is colocated and takes no KV from elsewhere")

    def _check_linked(self, handoff: KVHandoff) -> None:
        self._require_sink()
        held = self._peers.get(handoff.source_worker)
        if held != handoff.incarnations:
            raise HandshakeRequired(
                f"decode worker {self.worker_id} holds no handshake for this incarnation of "
                f"{handoff.source_worker}"
            )

    def _abort_in_engine(self, request_id: str):
        """Abort on the engine thread; once its blocks are free, the admission queue's
        head is offered them. Returns the engine call's future."""
        future = self.loop.call(lambda e: e.abort(request_id))
        if self._admission is not None:
            future.add_done_callback(lambda _: self._admission.wake_threadsafe())
        return future

    async def _import(
        self, task: DecodeTask, deadline: float | None
    ) -> tuple[float, tuple[Confirmation, ...]]:
        """Wait in the admission queue for blocks, pull and verify the KV, activate.
        Returns the pull's seconds and the confirmations still to deliver. On failure
        the caller's abort frees the blocks."""
        handoff, rid = task.handoff, task.request_id
        if self._admission is None:
            self._admission = AdmissionQueue(self.worker_id, self.spec.max_admission_queue)

        async def allocate() -> list[int] | None:
            try:
                return await self._call(
                    lambda e: e.import_request(rid, task.prompt_token_ids, task.output_token_ids, task.params)
                )
            except Overloaded:
                return None

        self._states[rid] = AdmissionState.WAITING_FOR_BLOCKS
        blocks = await self._admission.admit(rid, allocate, deadline, handoff.remaining_lease())
        self._states[rid] = AdmissionState.PULLING
        t0 = time.perf_counter()
        timeout = self.spec.transfer_timeout_s
        if deadline is not None:
            timeout = max(0.001, min(timeout, deadline - time.monotonic()))
        pull = asyncio.get_running_loop().run_in_executor(
            self._transfer, self._pull, handoff, blocks, timeout
        )
        try:
            confirmations = await asyncio.shield(pull)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await pull  # bytes may still be landing in the blocks: free them only after
            raise
        if handoff.remaining_lease() <= 0:
            raise LeaseExpired(f"the KV lease of request {rid} ran out")
        await self._call(lambda e: e.activate(rid))
        self._states[rid] = AdmissionState.RUNNING
        return time.perf_counter() - t0, tuple(c for c in confirmations if not c.delivered)

    def _connect(self, handshakes: tuple[Handshake, ...]) -> None:  # transfer thread
        if len(handshakes) == 1:
            self.sink.connect(handshakes[0])
            return
        source = handshakes[0].worker_id
        sink = self._tp_sinks.get(source)
        if sink is None:
            bs = self.engine.config.block_size
            max_blocks = -(-self.engine.max_model_len // bs)
            sink = self._tp_sinks[source] = HeadMappingSink(
                f"{self.worker_id}<{source}",
                self.engine.kv_cache.tensor,
                self._compat,
                self._sink_cls,
                max_blocks,
            )
        sink.connect(list(handshakes))

    def _pull(
        self, handoff: KVHandoff, blocks: list[int], timeout: float
    ) -> list[Confirmation]:  # transfer thread
        if len(handoff.descriptors) == 1:
            return [self.sink.pull(handoff.descriptors[0], blocks, timeout)]
        sink = self._tp_sinks[handoff.source_worker]
        return sink.pull(list(handoff.descriptors), blocks, timeout)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:  # engine thread
        """One hand-over to the actor's loop per step, whatever the batch size."""
        if self._aloop is not None:
            self._aloop.call_soon_threadsafe(self._deliver, outputs, time.time())

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:  # the actor's loop
        finished = False
        for out in outputs:
            finished = finished or out.finished
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait((out, now))
        if finished and self._admission is not None:
            self._admission.wake()  # blocks were freed


def _batch(items: list[tuple[RequestOutput, float]]) -> TokenBatch:
    token_ids, logprobs, times, text = [], [], [], []
    for out, t in items:
        token_ids.extend(out.new_token_ids)
        logprobs.extend(out.new_logprobs)
        times.extend([t] * len(out.new_token_ids))
        text.append(out.text)
    last = items[-1][0]
    return TokenBatch(
        token_ids=token_ids,
        text="".join(text),
        logprobs=logprobs,
        token_times=times,
        finish_reason=last.finish_reason if last.finished else None,
        num_cached_tokens=last.num_cached_tokens,
    )
