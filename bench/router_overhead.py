"""What the router adds per token: delivery lag through router + gRPC against
taking the decode worker's tokens directly over Ray (the router's own
``RayWorker``, in this process), in the same run.

    python -m splitserve.bench.router_overhead [--model smollm2] [--requests 20] [--tokens 64]

One colocated worker (so both paths run the same prefill and decode on the
same actor); requests run one at a time, alternating direct and routed, so
machine noise hits both alike.

- direct lag per token = time the driver got the token - time the worker sampled it
- routed lag per token = time the SDK got the token - (time the router accepted
  the request + the token's ``times_ms``, which the router measures from then).
  The acceptance time is recorded here, where the router runs, by wrapping its
  dispatcher's ``generate``; the request's own trip to the router (SDK send ->
  router accept) is reported apart, since it is paid once per request, not per
  token. The SDK runs in a child process, as a real client would.

Both clocks are this machine's, so the lags compare. Prints medians, p90s and
the routed - direct difference (the router's added latency per token).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time

import ray

from splitserve.client import Chunk, Client
from splitserve.cluster.app import BackgroundCluster
from splitserve.cluster.config import ClusterConfig
from splitserve.decode_worker import DecodeTask
from splitserve.engine import SamplingParams
from splitserve.router.workers import RayWorker

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def direct(
    worker: RayWorker, prompt_ids: list[int], params: SamplingParams, rid: str
) -> tuple[list[float], float]:
    lags, start = [], time.time()
    async for batch in worker.generate(DecodeTask(rid, prompt_ids, params)):
        now = time.time()
        lags.extend(now - t for t in batch.token_times)
    return lags, time.time() - start


def routed(
    client: Client, prompt_ids: list[int], params: SamplingParams, rid: str
) -> tuple[float, list[tuple[float, float]], float]:
    """(time sent, [(time received, the token's times_ms)], seconds end to end)."""
    got, sent = [], time.time()
    for item in client.stream(prompt_ids, max_tokens=params.max_tokens, ignore_eos=True, request_id=rid):
        now = time.time()
        if isinstance(item, Chunk):
            got.extend((now, ms) for ms in item.times_ms)
    return sent, got, time.time() - sent


def client_process(address: str, conn) -> None:
    """The SDK's side, in a child process: one routed request per message received;
    at the end, the round trips of 20 unary calls (``Tokenize``)."""
    with Client(address, timeout=120) as client:
        while (msg := conn.recv()) is not None:
            conn.send(routed(client, *msg))
        rtts = []
        for _ in range(20):
            t0 = time.perf_counter()
            client.tokenize("Hello")
            rtts.append(time.perf_counter() - t0)
        conn.send(rtts)


def record_acceptance(dispatcher) -> dict[str, float]:
    """Wrap ``dispatcher.generate`` so that each request's acceptance time (this
    machine's clock) lands in the returned dict, by request id."""
    accepted: dict[str, float] = {}
    generate = dispatcher.generate

    def recording(inp):
        accepted[inp.request_id] = time.time()
        return generate(inp)

    dispatcher.generate = recording
    return accepted


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=20, help="requests per path")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    args = ap.parse_args(argv)
    config = ClusterConfig.model_validate(
        {
            "mode": "colocated",
            "model": {"name": args.model},
            "colocated": {"replicas": 1, "num_cpus": 1},
            "router": {"port": 0},
        }
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with BackgroundCluster(config) as cluster, Client(cluster.address, timeout=120) as client:
            worker = RayWorker(cluster.registry.workers("colocated")[0].client.actor)
            accepted = record_acceptance(cluster.dispatcher)
            # One loop for every direct request: the worker's inbox lives on it.
            loop = asyncio.new_event_loop()
            prompt_ids = client.tokenize(messages=[{"role": "user", "content": PROMPT}])
            params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
            loop.run_until_complete(direct(worker, prompt_ids, params, "warmup"))
            conn, child_conn = multiprocessing.Pipe()
            child = multiprocessing.get_context("spawn").Process(
                target=client_process, args=(cluster.address, child_conn), daemon=True
            )
            child.start()
            child_conn.close()  # a child that dies then ends our recv() with EOFError, not a hang

            def routed_in_child(rid: str) -> tuple[list[float], float, float]:
                """(per-token lags, seconds end to end, the request's trip to the router)."""
                conn.send((prompt_ids, params, rid))
                sent, got, e2e = conn.recv()
                start = accepted.pop(rid)
                return [now - (start + ms / 1000) for now, ms in got], e2e, start - sent

            routed_in_child("routed-warmup")
            trips = []
            d_lags, r_lags, d_e2e, r_e2e = [], [], [], []
            for i in range(args.requests):
                lags, e2e = loop.run_until_complete(direct(worker, prompt_ids, params, f"direct-{i}"))
                d_lags += lags
                d_e2e.append(e2e)
                lags, e2e, trip = routed_in_child(f"routed-{i}")
                trips.append(trip)
                r_lags += lags
                r_e2e.append(e2e)
            loop.run_until_complete(worker.close())
            conn.send(None)
            rtts = conn.recv()
            child.join(30)
    finally:
        ray.shutdown()
    ms = 1000
    print(f"model {args.model}, {args.requests} requests x {args.tokens} tokens per path, one at a time")
    print(f"{'path':<8} {'lag p50 ms':>10} {'lag p90 ms':>10} {'e2e median ms':>14}")
    for name, lags, e2e in (("direct", d_lags, d_e2e), ("routed", r_lags, r_e2e)):
        p50, p90, e2e_ms = pct(lags, 0.5) * ms, pct(lags, 0.9) * ms, statistics.median(e2e) * ms
        print(f"{name:<8} {p50:>10.2f} {p90:>10.2f} {e2e_ms:>14.1f}")
    added = (pct(r_lags, 0.5) - pct(d_lags, 0.5)) * ms
    e2e_ratio = statistics.median(r_e2e) / statistics.median(d_e2e)
    print(f"router adds {added:.2f} ms per token (median lag); routed/direct e2e = {e2e_ratio:.3f}x")
    print(
        f"once per request: its trip to the router (SDK send -> router accept) {pct(trips, 0.5) * ms:.2f} ms "
        f"p50; a unary call's round trip {pct(rtts, 0.5) * ms:.2f} ms p50"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
