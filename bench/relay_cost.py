"""The router's own Python per relayed token, with no gRPC and no worker: the servicer's
``Generate`` over a ``Dispatcher`` whose one colocated worker is an in-process source of
one-token batches (a loop turn each, as batches arrive from a worker's stream), against
the same source's batches turned into the same messages directly, in the same run.

    python -m splitserve.bench.relay_cost [--streams 32] [--tokens 256] [--rounds 7]

Each round runs ``--streams`` concurrent requests of ``--tokens`` tokens both ways,
alternating, and reads ``time.process_time()`` around each; prints the median CPU per
token of each path, their difference (what the servicer, dispatcher and lifecycle add
per token) and the ratio. This is the part of ``bench/front_door``'s router-over-floor
excess that is the router's own Python; the rest there is reading the worker's token
stream and what a busier process pays in the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from collections.abc import AsyncIterator

from splitserve.proto import splitserve_pb2 as pb
from splitserve.router.dispatch import Dispatcher
from splitserve.router.registry import WorkerRegistry
from splitserve.router.service import SplitserveService
from splitserve.wire.decode import DecodeStats, DecodeTask, DecodeWorkerInfo, TokenBatch
from splitserve.wire.outputs import EngineStats
from splitserve.wire.sampling import FinishReason
from splitserve.wire.validation import RequestValidator

PROMPT = list(range(200, 216))
VALIDATOR = RequestValidator(
    "relay", vocab_size=1000, max_model_len=4096, max_kv_tokens=1 << 20, tokenizer=None
)


async def batches(request_id: str, n: int) -> AsyncIterator[TokenBatch]:
    """``n`` one-token batches of ``request_id``, a loop turn before each."""
    for i in range(n):
        await asyncio.sleep(0)
        t = time.time()
        finish = FinishReason.LENGTH if i == n - 1 else None
        yield TokenBatch(request_id, [100 + i], " x", [], [t], finish, 0, started_at=t)


class Source:
    """A colocated worker as the router sees it (``WorkerClient``), streaming ``batches``."""

    worker_id = "relay-0"

    async def info(self) -> DecodeWorkerInfo:
        return DecodeWorkerInfo(self.worker_id, VALIDATOR, colocated=True, revision="")

    async def stats(self, prefix_since=None) -> DecodeStats:
        return DecodeStats(self.worker_id, EngineStats(0, 0, 0, 1 << 16, 1 << 16), 0, 0)

    async def abort(self, request_id: str) -> bool:
        return True

    async def close(self) -> None:
        pass

    def generate(self, task: DecodeTask) -> AsyncIterator[TokenBatch]:
        return batches(task.request_id, task.params.max_tokens)


class Context:
    """What ``Generate`` asks of a gRPC context."""

    def time_remaining(self) -> None:
        return None

    async def abort(self, code, details: str) -> None:
        raise RuntimeError(details)


async def routed(service: SplitserveService, request_id: str, tokens: int) -> int:
    request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=PROMPT))
    request.sampling.max_tokens, request.sampling.ignore_eos = tokens, True
    n = 0
    async for message in service.Generate(request, Context()):
        n += len(message.token.token_ids)
    return n


async def direct(request_id: str, tokens: int) -> int:
    """The floor: the same batches as the same messages, nothing between."""
    n = 0
    async for b in batches(request_id, tokens):
        message = pb.GenerateResponse(request_id=request_id)
        message.token.token_ids.extend(b.token_ids)
        message.token.text = b.text
        message.token.times_ms.extend(b.token_times)
        n += len(message.token.token_ids)
    return n


async def measure(args) -> tuple[list[float], list[float]]:
    registry = WorkerRegistry()
    registry.add(Source.worker_id, "colocated", Source(), 16)
    await registry.activate(Source.worker_id)
    service = SplitserveService(Dispatcher(registry, VALIDATOR, "relay", colocated=True), "colocated")
    ids = itertools.count()

    async def us_per_token(one) -> float:
        c0 = time.process_time()
        counts = await asyncio.gather(*(one(f"r{next(ids)}", args.tokens) for _ in range(args.streams)))
        spent = time.process_time() - c0
        if counts != [args.tokens] * args.streams:
            raise RuntimeError(
                f"expected {args.tokens} tokens on each of {args.streams} streams, got {counts}"
            )
        return 1e6 * spent / sum(counts)

    floor, router = [], []
    for r in range(args.rounds + 1):  # the first round warms up
        f = await us_per_token(direct)
        g = await us_per_token(lambda rid, n: routed(service, rid, n))
        if r:
            floor.append(f)
            router.append(g)
    return floor, router


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    floor, router = asyncio.run(measure(args))
    f, g = statistics.median(floor), statistics.median(router)
    print(f"{args.streams} streams x {args.tokens} tokens, {args.rounds} rounds (median CPU per token)")
    print(f"direct (source -> message)   {f:7.1f} us")
    print(f"through Generate             {g:7.1f} us")
    print(f"the router's Python per token {g - f:6.1f} us ({g / f:.2f}x the direct path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
