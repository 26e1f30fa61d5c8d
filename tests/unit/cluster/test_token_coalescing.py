"""The router's reader of a decode worker's tokens: batches of one request that queued
while the router was busy reach it as one (one message, not one per token), in order,
and a failure queued behind them comes after their tokens."""

from __future__ import annotations

import asyncio

from splitserve.cluster.worker_client import _ready
from splitserve.wire.decode import TokenBatch
from splitserve.wire.errors import WorkerLost
from splitserve.wire.sampling import FinishReason


def _batch(ids: list[int], finish=None) -> TokenBatch:
    text = "".join(f"<{i}>" for i in ids)
    return TokenBatch("r", ids, text, [-0.1] * len(ids), [1.0] * len(ids), finish, 0)


def test_batches_queued_behind_one_come_as_one_in_order():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for ids in ([2], [3, 4]):
            queue.put_nowait(_batch(ids))
        queue.put_nowait(_batch([5], FinishReason.LENGTH))
        return _ready(_batch([1]), queue), queue.empty()

    (merged, failed), empty = asyncio.run(run())
    assert merged.token_ids == [1, 2, 3, 4, 5] and merged.text == "<1><2><3><4><5>"
    assert merged.finish_reason is FinishReason.LENGTH and failed is None and empty


def test_a_failure_queued_behind_batches_comes_apart_after_them():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(_batch([2]))
        queue.put_nowait(WorkerLost("the stream broke"))
        return _ready(_batch([1]), queue)

    merged, failed = asyncio.run(run())
    assert merged.token_ids == [1, 2] and isinstance(failed, WorkerLost)


def test_nothing_queued_leaves_the_batch_as_it_is():
    async def run():
        first = _batch([1])
        return first, _ready(first, asyncio.Queue())

    first, (same, failed) = asyncio.run(run())
    assert same is first and failed is None
