"""The request path of one disaggregated request: its calls and its TTFT at idle.

    python -m splitserve.bench.request_path [--model smollm2] [--backend nixl] [--requests 20]

One prefill and one decode worker; requests one at a time (idle), all of them
prefilled on the prefill worker (the decider off). Prints:

- the Ray calls one streamed request costs, after warm-up (the pair linked, the
  decode worker's token stream open), counted by the worker clients
  (``cluster.worker_client.REMOTE_CALLS``) in the router's process (router ->
  worker, less the poller's ``stats``) and in the decode worker's (decode ->
  prefill);
- TTFT at idle, as the SDK sees it (send -> first token chunk), median and p90,
  beside the median of the router's own ``ttft_ms``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from splitserve.bench import harness
from splitserve.client import Chunk, Client, Final
from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.worker_client import remote_calls
from splitserve.kv_transfer import CLUSTER_BACKENDS

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="nixl", choices=CLUSTER_BACKENDS)
    ap.add_argument("--requests", type=int, default=20)
    args = ap.parse_args(argv)
    config = ClusterConfig.model_validate(
        {
            "mode": "disaggregated",
            "model": {"name": args.model},
            "policy": {"conditional_disaggregation": False},
            "prefill": {"num_cpus": 1},
            "decode": {"num_cpus": 1},
            "transfer": {"backend": args.backend},
            "router": {"port": 0, "http_port": None},
        }
    )
    with harness.served(config) as cluster, Client(cluster.address, timeout=120) as client:
        ids = client.tokenize(PROMPT)
        (dw,) = cluster.registry.workers("decode")
        for _ in range(3):
            list(client.stream(ids, temperature=0, max_tokens=8, ignore_eos=True))
        remote_calls(reset=True)
        remote_calls(dw.client.actor, reset=True)
        list(client.stream(ids, temperature=0, max_tokens=8, ignore_eos=True))
        router = {m: n for m, n in remote_calls().items() if m != "stats"}
        decode = remote_calls(dw.client.actor)
        ttfts, router_ttfts = [], []
        for _ in range(args.requests):
            t0 = time.perf_counter()
            first = None
            for item in client.stream(ids, temperature=0, max_tokens=4, ignore_eos=True):
                if isinstance(item, Chunk) and first is None:
                    first = time.perf_counter() - t0
                if isinstance(item, Final):
                    router_ttfts.append(item.ttft_ms / 1000)
            ttfts.append(first)
    ms = 1000
    print(f"model {args.model}, backend {args.backend}, prompt {len(ids)} tokens")
    print(f"calls per request: router -> worker {sum(router.values())} {router}")
    print(f"                   decode -> prefill {sum(decode.values())} {decode}")
    print(
        f"TTFT at idle ({args.requests} requests): SDK median {statistics.median(ttfts) * ms:.1f} ms, "
        f"p90 {sorted(ttfts)[int(0.9 * len(ttfts))] * ms:.1f} ms; router median "
        f"{statistics.median(router_ttfts) * ms:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
