"""The chaos harness's view of a hung request: ``await_chain`` follows a suspended
task down to the frame it waits in, through an async generator, whether it is driven
by ``async for`` (an ``async_generator_asend``) or by ``anext(stream, None)`` behind
another coroutine (as the router's ``Dispatcher._stream`` reads a worker's batches);
``task.get_stack()`` shows only the outermost frame."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.bench.chaos import _mentions, await_chain


async def _third(reached: asyncio.Event, request_id: str) -> None:
    reached.set()
    await asyncio.get_running_loop().create_future()  # never done


async def _second(reached: asyncio.Event) -> None:
    await _third(reached, "rq-7")


async def _first(reached: asyncio.Event) -> None:
    await _second(reached)


async def _batches(reached: asyncio.Event):
    held = asyncio.get_running_loop().create_future()  # held, not awaited (as a stream in _stream)
    await _first(reached)
    yield held


async def _by_async_for(reached: asyncio.Event) -> None:
    async for _ in _batches(reached):
        pass


async def _wait(awaitable):
    return await awaitable


async def _by_anext(reached: asyncio.Event) -> None:
    await _wait(anext(_batches(reached), None))


async def _chain_of(outer) -> tuple[list, list]:
    """(the frames of ``await_chain``, those of ``get_stack``) of a task running ``outer``,
    suspended at the innermost coroutine."""
    reached = asyncio.Event()
    task = asyncio.create_task(outer(reached))
    try:
        await asyncio.wait_for(reached.wait(), 10)
        return await_chain(task), task.get_stack()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize(
    ("outer", "names"),
    [
        (_by_async_for, ["_by_async_for", "_batches", "_first", "_second", "_third"]),
        (_by_anext, ["_by_anext", "_wait", "_batches", "_first", "_second", "_third"]),
    ],
)
def test_the_chain_names_every_frame_down_to_the_innermost(outer, names):
    chain, stack = asyncio.run(_chain_of(outer))
    assert [f.f_code.co_name for f in chain] == names
    assert chain[-1].f_lineno == _third.__code__.co_firstlineno + 2  # where it waits
    assert [f.f_code.co_name for f in stack] == names[:1]  # what get_stack shows
    # only the innermost frame names the request: found through the chain, not the stack
    assert [_mentions(f, "rq-7") for f in chain] == [False] * (len(names) - 1) + [True]
