"""The decode worker as a request's way in sees it (``handover.DecodeSide``): engine
commands (``wire.engine_commands``) run on the engine's thread, the admission queue,
the worker's KV puller, and calls left running. Made by the worker with each part it lends, so a handover or a
migration reaches nothing of the worker's beyond them."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from splitserve.decode_worker.admission import AdmissionQueue
from splitserve.kv_transfer.puller import KVPuller
from splitserve.wire.decode import DecodePeer, DecodeTask, DecodeWorkerSpec
from splitserve.wire.engine_commands import (
    Activate,
    EngineCommand,
    HoldPrefix,
    ImportRequest,
    InjectFault,
    VerifyImport,
)
from splitserve.wire.errors import LoRASlotsBusy, Overloaded
from splitserve.wire.faults import ArmedFaults
from splitserve.wire.kv import Confirmation, KVHandoff
from splitserve.wire.prefill import PrefillPeer

Submit = Callable[[EngineCommand], Awaitable[Any]]  # runs a command on the engine's thread


class WorkerSide:
    def __init__(
        self,
        spec: DecodeWorkerSpec,
        submit: Submit,
        admission: AdmissionQueue,
        puller: KVPuller,
        free: Callable[[str], object],
        background: Callable[[Coroutine], None],
    ):
        """``free``: frees a request's blocks in the engine, not awaited (and wakes the
        admission queue once they are free); ``background``: runs a call to a source
        without awaiting it."""
        self.spec = spec
        self._submit = submit
        self._admission = admission
        self._puller = puller
        self._free = free
        self._background = background
        self.faults = ArmedFaults(spec.worker_id, ("pull", "sink"))  # a harness's (``wire.faults``)

    async def hold_prefix(self, task: DecodeTask) -> int:
        rid, prompt, params = task.request_id, task.prompt_token_ids, task.params
        return await self._submit(HoldPrefix(rid, prompt, params))

    async def admit(self, task: DecodeTask, deadline: float | None, lease_s: float) -> list[int]:
        rid, prompt, params = task.request_id, task.prompt_token_ids, task.params
        outputs = task.moved.output_token_ids if task.moved is not None else []  # a moved request's

        async def allocate() -> list[int] | None:
            try:
                return await self._submit(ImportRequest(rid, prompt, outputs, params))
            except LoRASlotsBusy:  # the admission queue lets others go first
                raise
            except Overloaded:
                return None

        return await self._admission.admit(rid, allocate, deadline, lease_s)

    async def link(self, source: PrefillPeer | DecodePeer, handoff: KVHandoff) -> None:
        await self._puller.link(source, handoff)

    async def pull(
        self, handoff: KVHandoff, blocks: list[int], timeout: float
    ) -> tuple[list[Confirmation], float]:
        """The puller's pull. A harness's ``PULL_AFTER_LEASE`` makes it start only once the
        source's lease ended (a wait the request's cancel or deadline still ends)."""
        desc = handoff.descriptors[0]
        if self.faults.take(desc.request_id, "pull") is not None:  # starts once its lease ended
            await asyncio.sleep(max(d.lease_expiry for d in handoff.descriptors) - time.time() + 0.1)
        return await self._puller.pull(handoff, blocks, timeout)

    async def verify(self, request_id: str, output_token_ids: list[int]) -> None:
        """Check the request's KV by meaning, for the spec's share of requests
        (``verify_meaning``); a mismatch raises ``MeaningMismatch`` (a transfer error: the
        request is recomputed). A fault a harness armed for it is injected first."""
        fault = self.faults.take(request_id, "sink")
        if fault is not None:
            with self.faults.injecting(request_id, fault):
                await self._submit(InjectFault(request_id, fault))
        if random.random() < self.spec.verify_meaning:
            await self._submit(VerifyImport(request_id, output_token_ids))

    async def activate(self, request_id: str, output_token_ids: list[int], adapter_digest: str) -> None:
        await self._submit(Activate(request_id, output_token_ids, adapter_digest))

    def free(self, request_id: str) -> None:
        self._free(request_id)

    def background(self, call: Coroutine) -> None:
        self._background(call)
