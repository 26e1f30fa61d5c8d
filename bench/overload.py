"""Overload: an open-loop Poisson stream at 1x, then 10x, then 1x again of a
request rate the cluster sustains, through the asyncio SDK.

Each phase sends ``--requests`` x its multiple requests (random prompts of
``--input-len`` tokens, ``--output-len`` output tokens, ``ignore_eos``), each on
schedule whether or not earlier ones have finished. Per phase it reports, from
the clients' side: completed and rejected requests (``RESOURCE_EXHAUSTED``) and
any other outcome; the p50/p99 time a rejection took to arrive; TTFT and TPOT
(p50/p99) of the admitted requests; and the router process's resident memory
(this process: router and clients) at the phase's end.

What it must show (issue 15): admitted requests at 10x keep the TPOT they had
at 1x; rejections arrive fast; the router's memory stays bounded; the last 1x
phase looks like the first (nothing left behind). The ratios are printed
against the first phase, measured in the same run.

::

    python -m splitserve.bench.overload --rate 2                 # SmolLM2, 1 prefill + 1 decode
    python -m splitserve.bench.overload --rate 2 --max-inflight 24
    python -m splitserve.bench.overload --rate 2 --max-decode-batch 8
    python -m splitserve.bench.overload --rate 2 --decode-tpot-ms 20   # admission by TPOT
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass

from splitserve.bench import harness
from splitserve.bench.soak import rss_mib
from splitserve.client import AsyncClient, Chunk, Client, SplitserveClientError
from splitserve.cluster.app import BackgroundCluster
from splitserve.cluster.config import ClusterConfig
from splitserve.loadgen.workloads import arrival_times, random_requests


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Sent:
    """One request as its client saw it."""

    code: str  # "OK" or a gRPC code name
    message: str  # the server's sentence, for a failure
    tokens: int
    elapsed_s: float  # send -> end (for a rejection: how fast it came)
    ttft_s: float | None
    tpot_s: float | None  # (last token - first token) / (tokens - 1)


@dataclass(frozen=True)
class Phase:
    multiple: float
    rate: float
    sent: list[Sent]
    routerrss_mib: float

    def count(self, code: str) -> int:
        return sum(s.code == code for s in self.sent)

    def pct(self, values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100)[q - 1] * 1000 if len(values) > 1 else float("nan")

    def ttft_ms(self, q: int) -> float:
        return self.pct([s.ttft_s for s in self.sent if s.code == "OK"], q)

    def tpot_ms(self, q: int) -> float:
        return self.pct([s.tpot_s for s in self.sent if s.code == "OK" and s.tpot_s is not None], q)

    def rejection_ms(self, q: int) -> float:
        return self.pct([s.elapsed_s for s in self.sent if s.code == "RESOURCE_EXHAUSTED"], q)


async def _one(client: AsyncClient, at: float, prompt: list[int], output_len: int) -> Sent:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    start = time.perf_counter()
    times: list[float] = []
    try:
        async for item in client.stream(prompt, temperature=0, max_tokens=output_len, ignore_eos=True):
            if isinstance(item, Chunk):
                times.extend([time.perf_counter()] * len(item.token_ids))
    except SplitserveClientError as e:
        return Sent(e.code.name, e.details, len(times), time.perf_counter() - start, None, None)
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return Sent("OK", "", len(times), time.perf_counter() - start, times[0] - start, tpot)


async def _phase(
    address: str, prompts: list[list[int]], output_len: int, rate: float, seed: int
) -> list[Sent]:
    async with AsyncClient(address, retries=0) as client:  # a rejection is reported, not retried
        await client.list_models()
        t0 = time.perf_counter()
        offsets = arrival_times(len(prompts), rate, seed=seed)
        sends = [_one(client, t0 + at, p, output_len) for at, p in zip(offsets, prompts)]
        return await asyncio.gather(*sends)


def run_overload(
    cluster: BackgroundCluster,
    vocab: int,
    rate: float,
    requests: int,
    input_len: int,
    output_len: int,
    multiples: tuple[float, ...] = (1, 10, 1),
    seed: int = 0,
) -> list[Phase]:
    """The phases, in order, each at ``rate`` x its multiple (fresh prompts per phase)."""
    phases = []
    for k, m in enumerate(multiples):
        n = int(requests * m)
        reqs = random_requests(n, input_len, output_len, vocab_size=vocab, seed=seed + k)
        log(f"phase {k + 1}: {n} requests at {rate * m:g} req/s ({m:g}x) ...")
        prompts = [r.prompt_ids for r in reqs]
        sent = asyncio.run(_phase(cluster.address, prompts, output_len, rate * m, seed + k))
        phases.append(Phase(m, rate * m, sent, rss_mib(os.getpid()) or 0.0))
    return phases


def table(phases: list[Phase]) -> str:
    base = phases[0]
    head = (
        f"{'phase':<6} {'req/s':>6} {'sent':>5} {'done':>5} {'rejected':>8} {'other':>5} "
        f"{'reject p50/p99 ms':>18} {'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'TPOT p50 ÷ 1x':>13} "
        f"{'router MiB':>10}"
    )
    lines = [head]
    for p in phases:
        other = len(p.sent) - p.count("OK") - p.count("RESOURCE_EXHAUSTED")
        lines.append(
            f"{p.multiple:<6g} {p.rate:>6.2f} {len(p.sent):>5} {p.count('OK'):>5} "
            f"{p.count('RESOURCE_EXHAUSTED'):>8} {other:>5} "
            f"{p.rejection_ms(50):>8.1f}/{p.rejection_ms(99):<9.1f} "
            f"{p.ttft_ms(50):>7.0f}/{p.ttft_ms(99):<8.0f} {p.tpot_ms(50):>7.1f}/{p.tpot_ms(99):<8.1f} "
            f"{p.tpot_ms(50) / base.tpot_ms(50):>13.2f} {p.routerrss_mib:>10.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--config", help="a cluster config YAML (default: 1 prefill + 1 decode worker)")
    ap.add_argument("--rate", type=float, required=True, help="a rate (req/s) the cluster sustains: the 1x")
    ap.add_argument("--requests", type=int, default=60, help="requests of a 1x phase (10x: 10 times as many)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-inflight", type=int, default=None, help="limits.max_inflight_requests")
    ap.add_argument("--max-decode-batch", type=int, default=None, help="limits.max_decode_batch")
    ap.add_argument("--decode-tpot-ms", type=float, default=None, help="limits.decode_tpot_ms")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.config:
        config = ClusterConfig.load(args.config)
    else:
        config = ClusterConfig.model_validate(
            {"model": {"name": args.model}, "router": {"port": 0, "http_port": None}}
        )
    limits = {
        "max_inflight_requests": args.max_inflight,
        "max_decode_batch": args.max_decode_batch,
        "decode_tpot_ms": args.decode_tpot_ms,
    }
    limits = {k: v for k, v in limits.items() if v is not None}
    config = config.model_copy(update={"limits": config.limits.model_copy(update=limits)})
    with harness.served(config, num_cpus=None) as cluster:
        with Client(cluster.address, timeout=60) as c:
            vocab = c.list_models()[0].vocab_size
        phases = run_overload(
            cluster, vocab, args.rate, args.requests, args.input_len, args.output_len, seed=args.seed
        )
    print(
        f"model {config.model.name}, {config.mode}, {args.input_len}/{args.output_len} tokens, "
        f"max_inflight_requests {config.limits.max_inflight_requests}, "
        f"max_decode_batch {config.limits.max_decode_batch}, decode_tpot_ms {config.limits.decode_tpot_ms}"
    )
    print(table(phases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
