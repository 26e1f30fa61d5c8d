"""What the router adds per token: delivery lag through router + gRPC against
taking the decode worker's tokens directly (the router's own
``RayDecodeWorker``, in this process: its token stream), in the same run.

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

A third path sets the floor: the same SDK in the same child process streaming
from a bare ``grpc.aio`` server in this process (the router's process), which
sends one-token ``Generate`` messages at the decode path's pace with nothing
behind them. Its lag is what one streamed gRPC message costs between these two
processes on this machine, so routed - direct - bare is the router's own work.

Both clocks are this machine's, so the lags compare. Prints medians, p90s and
the routed - direct difference (the router's added latency per token).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Iterator

import grpc

from splitserve.bench import harness
from splitserve.client import Chunk, Client
from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.worker_client import RayDecodeWorker
from splitserve.proto import splitserve_pb2 as pb
from splitserve.proto import splitserve_pb2_grpc as pb_grpc
from splitserve.wire.decode import DecodeTask
from splitserve.wire.sampling import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def direct(
    worker: RayDecodeWorker, prompt_ids: list[int], params: SamplingParams, rid: str
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
    for item in client.stream(
        prompt_ids, temperature=0, max_tokens=params.max_tokens, ignore_eos=True, request_id=rid
    ):
        now = time.time()
        if isinstance(item, Chunk):
            got.extend((now, ms) for ms in item.times_ms)
    return sent, got, time.time() - sent


def client_process(address: str, conn) -> None:
    """The SDK's side, in a child process: one streamed request per message received,
    to the address the message names (the router's, or the bare server's); at the
    end, the round trips of 20 unary calls to the router (``Tokenize``)."""
    with Client(address, timeout=120) as client:
        others: dict[str, Client] = {}
        while (msg := conn.recv()) is not None:
            target, *request = msg
            if target != address and target not in others:
                others[target] = Client(target, timeout=120)
            conn.send(routed(others.get(target, client), *request))
        for other in others.values():
            other.close()
        rtts = []
        for _ in range(20):
            t0 = time.perf_counter()
            client.tokenize("Hello")
            rtts.append(time.perf_counter() - t0)
        conn.send(rtts)


class BareStream(pb_grpc.SplitserveServicer):
    """``Generate`` with nothing behind it: ``max_tokens`` one-token messages ``gap_s``
    apart, each stamped as the router stamps its tokens (ms since it accepted the
    request), then a ``Final``. Acceptance times land in ``accepted``, by request id."""

    def __init__(self, gap_s: float):
        self.gap_s = gap_s
        self.accepted: dict[str, float] = {}

    async def Generate(self, request, context):
        accepted = self.accepted[request.request_id] = time.time()
        for i in range(request.sampling.max_tokens):
            await asyncio.sleep(self.gap_s)
            ms = (time.time() - accepted) * 1000
            yield pb.GenerateResponse(token=pb.Token(token_ids=[i], text="x", times_ms=[ms]))
        yield pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_LENGTH))


@contextlib.contextmanager
def bare_server(servicer: BareStream) -> Iterator[str]:
    """Serve ``servicer`` on a loop of its own in a thread of this process, as the
    router runs; yields its address."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bare-grpc", daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        pb_grpc.add_SplitserveServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


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
    with harness.served(config) as cluster, Client(cluster.address, timeout=120) as client:
        worker = RayDecodeWorker(cluster.registry.workers("colocated")[0].client.actor)
        accepted = record_acceptance(cluster.dispatcher)
        # One loop for every direct request: the worker's inbox lives on it.
        loop = asyncio.new_event_loop()
        prompt_ids = client.tokenize(messages=[{"role": "user", "content": PROMPT}])
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        _, warm_e2e = loop.run_until_complete(direct(worker, prompt_ids, params, "warmup"))
        bare = BareStream(gap_s=warm_e2e / args.tokens)  # the decode path's pace
        conn, child_conn = multiprocessing.Pipe()
        child = multiprocessing.get_context("spawn").Process(
            target=client_process, args=(cluster.address, child_conn), daemon=True
        )
        child.start()
        child_conn.close()  # a child that dies then ends our recv() with EOFError, not a hang

        def in_child(target: str, rid: str, accepted: dict[str, float]) -> tuple[list[float], float, float]:
            """(per-token lags, seconds end to end, the request's trip to the server)."""
            conn.send((target, prompt_ids, params, rid))
            sent, got, e2e = conn.recv()
            start = accepted.pop(rid)
            return [now - (start + ms / 1000) for now, ms in got], e2e, start - sent

        lags = {"direct": [], "routed": [], "bare": []}
        e2es = {"direct": [], "routed": [], "bare": []}
        trips = []
        with bare_server(bare) as bare_address:
            in_child(cluster.address, "routed-warmup", accepted)
            in_child(bare_address, "bare-warmup", bare.accepted)
            for i in range(args.requests):
                lag, e2e = loop.run_until_complete(direct(worker, prompt_ids, params, f"direct-{i}"))
                lags["direct"] += lag
                e2es["direct"].append(e2e)
                lag, e2e, trip = in_child(cluster.address, f"routed-{i}", accepted)
                trips.append(trip)
                lags["routed"] += lag
                e2es["routed"].append(e2e)
                lag, e2e, _ = in_child(bare_address, f"bare-{i}", bare.accepted)
                lags["bare"] += lag
                e2es["bare"].append(e2e)
            conn.send(None)  # the child closes its clients before the bare server stops
            rtts = conn.recv()
            child.join(30)
        loop.run_until_complete(worker.close())
    ms = 1000
    print(f"model {args.model}, {args.requests} requests x {args.tokens} tokens per path, one at a time")
    print(f"{'path':<8} {'lag p50 ms':>10} {'lag p90 ms':>10} {'e2e median ms':>14}")
    for name in ("direct", "routed", "bare"):
        p50, p90 = pct(lags[name], 0.5) * ms, pct(lags[name], 0.9) * ms
        print(f"{name:<8} {p50:>10.2f} {p90:>10.2f} {statistics.median(e2es[name]) * ms:>14.1f}")
    added = (pct(lags["routed"], 0.5) - pct(lags["direct"], 0.5)) * ms
    floor = pct(lags["bare"], 0.5) * ms
    e2e_ratio = statistics.median(e2es["routed"]) / statistics.median(e2es["direct"])
    print(f"router adds {added:.2f} ms per token (median lag); routed/direct e2e = {e2e_ratio:.3f}x")
    print(
        f"of which one streamed gRPC message between these processes (bare) is {floor:.2f} ms: "
        f"the router's own work {added - floor:.2f} ms"
    )
    print(
        f"once per request: its trip to the router (SDK send -> router accept) {pct(trips, 0.5) * ms:.2f} ms "
        f"p50; a unary call's round trip {pct(rtts, 0.5) * ms:.2f} ms p50"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
