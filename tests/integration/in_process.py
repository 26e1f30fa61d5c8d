"""The router's dispatcher over real workers in this process (no Ray): for tests that put
a prefill and a decode worker behind the real dispatcher."""

from __future__ import annotations

from splitserve.decode_worker.in_process import InProcessDecodeClient
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.router.dispatch import Dispatcher
from splitserve.router.events import FinalEvent, GenerateInput, TokenEvent
from splitserve.router.policy import PolicySpec
from splitserve.router.registry import WorkerRegistry
from splitserve.router.roles import Role
from splitserve.wire.decode import DecodeTask
from splitserve.wire.sampling import FinishReason, SamplingParams


async def handing_over(prefill: PrefillWorker, decode: DecodeWorker, model: str) -> Dispatcher:
    """A dispatcher that sends every request to ``prefill`` and hands it over to
    ``decode`` (no prompt is prefilled on the decode worker by choice)."""
    block_size = decode.spec.engine.block_size
    registry = WorkerRegistry()
    registry.add(prefill.worker_id, Role.PREFILL, prefill, block_size)
    registry.add(decode.worker_id, Role.DECODE, InProcessDecodeClient(decode), block_size)
    for wid in (prefill.worker_id, decode.worker_id):
        await registry.activate(wid)
    policy = PolicySpec(conditional_disaggregation=False)
    return Dispatcher(registry, decode.engine.validator, model, policy=policy)


async def run(
    d: Dispatcher, rid: str, prompt: list[int], params: SamplingParams
) -> tuple[list[int], str, FinishReason | None]:
    """One request through ``d``: the tokens and text its client got, and how it ended."""
    tokens, text, reason = [], "", None
    async for event in d.generate(GenerateInput(params, prompt=prompt, request_id=rid)):
        if isinstance(event, TokenEvent):
            tokens, text = tokens + event.token_ids, text + event.text
        elif isinstance(event, FinalEvent):
            reason = event.finish_reason
    return tokens, text, reason


def blocks_held(worker: PrefillWorker | DecodeWorker) -> int:
    """The KV blocks ``worker``'s engine holds now (asked on its engine thread)."""
    return worker.loop.call(lambda e: e.block_manager.num_used_blocks).result(30)


async def generated(client: InProcessDecodeClient, rid: str, prompt: list[int], params: SamplingParams):
    """``rid``'s (token ids, text, finish reason) as ``client`` streams them from its worker."""
    tokens, text, reason = [], "", None
    async for batch in client.generate(DecodeTask(rid, prompt, params)):
        tokens += batch.token_ids
        text += batch.text
        reason = batch.finish_reason or reason
    return tokens, text, reason
