"""Shared factories for the router's tests without Ray: worker records with given
load, and fake worker clients (``WorkerClient``) that script what a prefill or
decode worker answers (each of the weights' ``revision`` it is given). The fakes
stand in for workers only in tests of the router's own logic (registry, balancer,
dispatcher, autoscaling policy)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from splitserve.router.registry import Membership, WorkerRecord
from splitserve.wire.decode import DecodeStats, DecodeTask, DecodeWorkerInfo, Prefilled, TokenBatch
from splitserve.wire.errors import (
    InvalidRequest,
    KVTransferError,
    PrefillLost,
    PrefillUnreachable,
    WorkerLost,
)
from splitserve.wire.kv import PROTOCOL_VERSION, CompatInfo, Confirmation, Handshake, KVDescriptor, KVHandoff
from splitserve.wire.kv_layout import KVLayout
from splitserve.wire.outputs import EngineStats
from splitserve.wire.prefill import (
    KVStreaming,
    PrefillAccepted,
    PrefillEvent,
    PrefillResult,
    PrefillStats,
    PrefillTask,
    PrefillWorkerInfo,
)
from splitserve.wire.sampling import FinishReason
from splitserve.wire.validation import RequestValidator

VALIDATOR = RequestValidator(
    "tiny", vocab_size=1000, max_model_len=4096, max_kv_tokens=100_000, tokenizer=None
)
COMPAT = CompatInfo("tiny", KVLayout(2, 64, 16, 1, 8, "float32"))


def engine_stats(
    free_blocks: int = 1000,
    num_blocks: int = 1000,
    running: int = 0,
    prefill_rate: float = 0.0,
    decode_step: tuple[float, float] = (0.0, 0.0),
) -> EngineStats:
    batch, step_s = decode_step
    return EngineStats(
        running,
        0,
        0,
        num_blocks,
        free_blocks,
        prefill_tokens_per_s=prefill_rate,
        decode_batch=batch,
        decode_step_s=step_s,
    )


def record(
    wid: str,
    role: str = "prefill",
    *,
    queued: int = 0,
    active: int = 0,
    free_blocks: int = 0,
    num_blocks: int = 0,
    running: int = 0,
    block_size: int = 16,
    prefill_rate: float = 0.0,
    decode_step: tuple[float, float] = (0.0, 0.0),
) -> WorkerRecord:
    """An ACTIVE record with this load (as the registry would hold it); ``decode_step``
    is its reported (mean batch, mean decode step seconds)."""
    w = WorkerRecord(wid, role, client=None, block_size=block_size, state=Membership.ACTIVE)
    stats = engine_stats(free_blocks, num_blocks, running, prefill_rate, decode_step)
    w.stats = DecodeStats(wid, stats, 0, 0)
    if queued:
        w.prefilling["queued"] = queued
    for i in range(active):
        w.decoding[f"active-{i}"] = 0
    return w


def next_token(context: list[int]) -> int:
    """The deterministic 'model' every fake shares: the next token after ``context``."""
    return (sum(context) * 31 + len(context) * 7) % 1000


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    """The greedy output of ``n`` tokens after ``prompt``."""
    context = list(prompt)
    for _ in range(n):
        context.append(next_token(context))
    return context[len(prompt) :]


class FakePrefill:
    """A prefill worker: samples the first token of ``expected_tokens`` and exports a
    handoff; ``fail`` (a callable of the task) may raise instead. Its ``prefill_stream``
    says it took the request first (``PrefillAccepted``), unless ``takes`` is False (a
    worker already dead: ``fail`` then raises before anything comes). With ``streams``,
    it hands the handoff over next, ``delay_s`` before the result (and ``fail`` is
    called between them: a worker lost while its KV streams)."""

    def __init__(
        self,
        worker_id: str,
        fail: Callable[[PrefillTask], None] | None = None,
        delay_s: float = 0.0,
        streams: bool = False,
        revision: str = "",
        takes: bool = True,
    ):
        self.worker_id = worker_id
        self.fail = fail
        self.takes = takes
        self.delay_s = delay_s
        self.streams = streams
        self.revision = revision
        self.incarnation = uuid.uuid4().hex
        self.calls: list[PrefillTask] = []
        self.aborted: list[str] = []
        self.confirmed: list[Confirmation] = []
        self.info_calls = 0

    def restart(self) -> None:
        self.incarnation = uuid.uuid4().hex

    def handshake(self) -> Handshake:
        compat = dataclasses.replace(COMPAT, revision=self.revision)
        return Handshake(PROTOCOL_VERSION, "fake", self.worker_id, self.incarnation, compat)

    async def info(self) -> PrefillWorkerInfo:
        self.info_calls += 1
        return PrefillWorkerInfo(
            self.worker_id, VALIDATOR, (self.handshake(),), streams_kv=self.streams, revision=self.revision
        )

    async def stats(self, prefix_since=None) -> PrefillStats:
        return PrefillStats(self.worker_id, engine_stats(), (), 0, 0, 0)

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True

    async def close(self) -> None:
        pass

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        self.calls.append(task)
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            self.fail(task)
        return self._result(task, self._handoff(task))

    async def prefill_stream(self, task: PrefillTask) -> AsyncIterator[PrefillEvent]:
        if self.takes:
            yield PrefillAccepted(task.request_id)
        if not self.streams:
            yield await self.prefill(task)
            return
        self.calls.append(task)
        handoff = self._handoff(task)
        yield KVStreaming(task.request_id, handoff)
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            self.fail(task)
        yield self._result(task, handoff)

    def _handoff(self, task: PrefillTask) -> KVHandoff:
        desc = KVDescriptor(
            f"{task.request_id}:t",
            task.request_id,
            "fake",
            self.worker_id,
            self.incarnation,
            COMPAT.hash,
            (0,),
            len(task.prompt_token_ids),
            0,
            (),
            lease_expiry=1e12,
        )
        return KVHandoff(self.worker_id, (desc,))

    def _result(self, task: PrefillTask, handoff: KVHandoff) -> PrefillResult:
        first = expected_tokens(task.prompt_token_ids, 1)
        finish = FinishReason.LENGTH if task.params.max_tokens == 1 else None
        handoff = None if finish is not None else handoff
        return PrefillResult(
            task.request_id, self.worker_id, first, "", [0.0], 0.0, finish, 0, handoff, revision=self.revision
        )

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None:
        self.confirmed.extend(confirmations)


class FakeDecode:
    """A decode worker: with a task's ``source``, it prefills there (``PrefillLost`` if
    the source is lost before any KV came, ``PeerLost`` after), passes the first token on
    (with ``prefilled``), links to the source once per incarnation (``source.info``),
    "pulls" (``pull_fails`` may raise a ``KVTransferError`` instead), confirms to the
    source, and continues ``expected_tokens`` in batches of ``batch`` tokens; an export
    not confirmed is released on the source. Without a source it prefills itself.
    ``lose_after`` tokens into a request it raises ``WorkerLost`` (once per request);
    ``fail`` may raise at the start. It holds a request's id from its start to its end or
    ``abort`` (``held``; a start whose answer is lost may add it there itself) and refuses
    a start of an id it holds, as a real one does. Its stats report the ``decode_steps`` (batch,
    step s) in turn, then the last one again."""

    def __init__(
        self,
        worker_id: str,
        batch: int = 2,
        lose_after: int | None = None,
        fail: Callable[[DecodeTask], None] | None = None,
        step_s: float = 0.0,
        decode_steps: Sequence[tuple[float, float]] = (),
        pull_fails: Callable[[KVHandoff], None] | None = None,
        revision: str = "",
    ):
        self.worker_id = worker_id
        self.revision = revision
        self.batch = batch
        self.lose_after = lose_after
        self.fail = fail
        self.step_s = step_s
        self.decode_steps = list(decode_steps)
        self.pull_fails = pull_fails
        self.linked: dict[str, tuple[str, ...]] = {}
        self.connect_calls = 0
        self.calls: list[DecodeTask] = []
        self.aborted: list[str] = []
        self.held: set[str] = set()

    def restart(self) -> None:
        self.linked.clear()

    async def info(self) -> DecodeWorkerInfo:
        return DecodeWorkerInfo(self.worker_id, VALIDATOR, colocated=False, revision=self.revision)

    async def stats(self, prefix_since=None) -> DecodeStats:
        steps = self.decode_steps
        step = steps.pop(0) if len(steps) > 1 else (steps[0] if steps else (0.0, 0.0))
        return DecodeStats(self.worker_id, engine_stats(decode_step=step), 0, 0)

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        self.held.discard(request_id)
        return True

    async def close(self) -> None:
        pass

    async def generate(self, task: DecodeTask) -> AsyncIterator[TokenBatch]:
        self.calls.append(task)
        if task.request_id in self.held:
            raise InvalidRequest(f"request id {task.request_id!r} is already in use")
        if self.fail is not None:
            self.fail(task)
        sent = list(task.output_token_ids)
        finished = False
        self.held.add(task.request_id)
        try:
            if task.source is not None:
                first = None
                try:
                    async for batch in self._take_over(task):
                        first = first or batch
                        finished = batch.finish_reason is not None
                        yield batch
                except (PrefillLost, KVTransferError):
                    finished = True  # the worker ended it (an error batch): nothing to abort
                    raise
                if first is None or first.finish_reason is not None:
                    finished = True
                    return
                sent = list(first.token_ids)
            # Continue the context (a resumed task's prompt already holds the tokens sent).
            context = list(task.prompt_token_ids) + sent
            left = task.params.max_tokens - len(sent)
            sent_here = 0
            while left > 0:
                await asyncio.sleep(self.step_s)
                if self.lose_after is not None and sent_here >= self.lose_after:
                    raise WorkerLost(f"{self.worker_id} died")
                ids = []
                for _ in range(min(self.batch, left)):
                    ids.append(next_token(context))
                    context.append(ids[-1])
                left -= len(ids)
                sent_here += len(ids)
                finish = FinishReason.LENGTH if left == 0 else None
                finished = finish is not None
                yield TokenBatch(task.request_id, ids, "", [0.0] * len(ids), [0.0] * len(ids), finish, 0)
        finally:
            self.held.discard(task.request_id)
            if not finished:  # as the real client: leaving early aborts the request here
                self.aborted.append(task.request_id)

    async def _take_over(self, task: DecodeTask) -> AsyncIterator[TokenBatch]:
        """The first-token batch, then (unless it ended there) the pull's batch."""
        from splitserve.wire.errors import PeerLost

        source, rid = task.source, task.request_id
        confirmed = False
        events = source.prefill_stream(PrefillTask(rid, task.prompt_token_ids, task.params, task.timeout_s))
        try:
            accepted = False
            try:
                first = await anext(events)
                if isinstance(first, PrefillAccepted):
                    accepted = True
                    first = await anext(events)
            except WorkerLost as e:
                raise (PrefillLost if accepted else PrefillUnreachable)(str(e)) from None
            handoff = first.handoff
            result = first
            if isinstance(first, KVStreaming):
                try:
                    result = await anext(events)
                except WorkerLost as e:
                    raise PeerLost(str(e)) from None
            n = len(result.output_token_ids)
            streamed = isinstance(first, KVStreaming)
            exported = None if handoff is None else 0.0
            prefilled = Prefilled(result.worker_id, 0.0, exported, streamed, 64, revision=result.revision)
            yield TokenBatch(
                rid,
                result.output_token_ids,
                "",
                [0.0] * n,
                [0.0] * n,
                result.finish_reason,
                0,
                prefilled=prefilled,
            )
            if result.finish_reason is not None:
                confirmed = handoff is None
                return
            if self.linked.get(handoff.source_worker) != handoff.incarnations:
                try:
                    info = await source.info()
                except WorkerLost as e:
                    raise PeerLost(str(e)) from None
                if tuple(h.incarnation for h in info.handshakes) != handoff.incarnations:
                    raise PeerLost("the source restarted since it exported")
                self.connect_calls += 1
                self.linked[handoff.source_worker] = handoff.incarnations
            if self.pull_fails is not None:
                self.pull_fails(handoff)
            await source.confirm(
                (Confirmation(handoff.descriptors[0].transfer_id, handoff.source_worker, False),)
            )
            confirmed = True
            yield TokenBatch(rid, [], "", [], [], None, 0, transfer_s=0.001, started_at=0.0)
        finally:
            await events.aclose()
            if not confirmed:
                await source.abort(rid)
