"""What one Ray message costs the process that receives it: a Ray actor streams
``--items`` items (each a tuple of ``--batches`` one-token ``TokenBatch``es, as a
decode worker's step) at ``--rate`` per second to an asyncio consumer in this
process, then answers as many awaited calls; the consumer's CPU time (every thread,
``time.process_time``) per item, less what an idle driver uses over the same time.
The reason decode workers send their tokens over gRPC (``wire/token_stream.py``).

    python -m splitserve.bench.ray_item_cost [--items 750] [--rate 75] [--batches 32]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import ray

from splitserve.bench import harness
from splitserve.wire.decode import TokenBatch


def _item(batches: int) -> tuple[TokenBatch, ...]:
    now = time.time()
    return tuple(
        TokenBatch(f"r{j}", [1000], " x", [], [now], None, 0, started_at=now) for j in range(batches)
    )


class Producer:
    async def stream(self, n: int, batches: int, gap_s: float):
        for _ in range(n):
            await asyncio.sleep(gap_s)
            yield _item(batches)

    async def take(self, batches: int, gap_s: float):
        await asyncio.sleep(gap_s)
        return _item(batches)


async def measure(items: int, rate: float, batches: int) -> dict[str, float]:
    actor = ray.remote(num_cpus=0)(Producer).remote()
    gap = 1 / rate
    await actor.take.remote(1, 0)  # started
    out = {}
    t0, w0 = time.process_time(), time.monotonic()
    async for ref in actor.stream.options(num_returns="streaming").remote(items, batches, gap):
        await ref
    out["stream"], wall = time.process_time() - t0, time.monotonic() - w0
    t0 = time.process_time()
    for _ in range(items):
        await actor.take.remote(batches, gap)
    out["call"] = time.process_time() - t0
    t0 = time.process_time()
    await asyncio.sleep(wall)
    out["idle"] = time.process_time() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=750)
    ap.add_argument("--rate", type=float, default=75.0, help="items per second")
    ap.add_argument("--batches", type=int, default=32, help="TokenBatches per item")
    args = ap.parse_args(argv)
    with harness.local_ray():
        cpu = asyncio.run(measure(args.items, args.rate, args.batches))
    idle = cpu["idle"]
    print(
        f"{args.items} items of {args.batches} batches at {args.rate:g}/s; an idle driver: {idle:.3f} s CPU"
    )
    for how in ("stream", "call"):
        per = (cpu[how] - idle) / args.items
        each = 1e6 * per / args.batches
        print(f"Ray {how:6}: {1e6 * per:7.0f} us CPU per item received, {each:6.1f} us per batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
