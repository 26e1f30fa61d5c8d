"""The decode worker's outbox: a step's batches of every request in one item,
several steps of one request merged in order when the reader is slower."""

from __future__ import annotations

import asyncio

from splitserve.decode_worker.outbox import Outbox
from splitserve.wire.decode import TokenBatch
from splitserve.wire.errors import DeadlineExceeded
from splitserve.wire.sampling import FinishReason


def batch(rid: str, ids: list[int], t: float, finish=None, **kw) -> TokenBatch:
    return TokenBatch(
        rid, ids, "".join(f"<{i}>" for i in ids), [-0.5] * len(ids), [t] * len(ids), finish, 0, **kw
    )


def test_one_take_holds_every_request_with_its_steps_merged_in_order():
    async def run():
        box = Outbox("o")
        box.put(batch("a", [], 0.0, transfer_s=0.25))
        box.put(batch("a", [1], 1.0))
        box.put(batch("b", [7], 1.0))
        box.put(batch("a", [2, 3], 2.0, FinishReason.LENGTH))
        return await box.take()

    a, b = asyncio.run(run())
    assert (a.request_id, b.request_id) == ("a", "b")
    assert a.token_ids == [1, 2, 3] and a.text == "<1><2><3>" and a.token_times == [1.0, 2.0, 2.0]
    assert a.logprobs == [-0.5] * 3 and a.transfer_s == 0.25 and a.finish_reason is FinishReason.LENGTH
    assert b.token_ids == [7] and b.finish_reason is None


def test_take_waits_for_a_put_and_a_dropped_request_is_not_sent():
    async def run():
        box = Outbox("o")
        taking = asyncio.ensure_future(box.take())
        await asyncio.sleep(0)
        assert not taking.done()
        box.put(batch("gone", [1], 1.0))
        box.drop("gone")
        error = DeadlineExceeded("late")
        box.put(batch("late", [4], 1.0))
        box.put(batch("late", [], 2.0, error=error))
        return await taking, error

    (late,), error = asyncio.run(run())
    assert late.token_ids == [4] and late.error is error and late.finish_reason is None
