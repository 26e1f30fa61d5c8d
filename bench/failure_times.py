"""How long the failure table's rows take, as a client sees them.

On one disaggregated cluster (1 prefill worker, 2 decode workers, the model of
``--model``), one row at a time, ``--n`` requests each:

- deadline: requests with ``timeout_ms`` = ``--deadline-ms`` that cannot finish
  in time; how long after their deadline ``DEADLINE_EXCEEDED`` arrives;
- cancel: streams the client closes after 5 tokens; how long until no worker
  holds any KV (the status service, polled every 20 ms);
- decode worker lost: streams of 400 tokens; the process of the decode worker
  serving most of them is killed (SIGKILL); the longest pause between two tokens
  each resumed stream saw (the resume: another decode worker prefills prompt +
  tokens sent, then goes on), against the median gap between tokens before the kill.

::

    python -m splitserve.bench.failure_times                 # SmolLM2
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time

import ray

from splitserve.bench import harness
from splitserve.bench.chaos import kv_held
from splitserve.client import Chunk, Client, DeadlineExceeded
from splitserve.cluster.app import BackgroundCluster
from splitserve.cluster.config import ClusterConfig
from splitserve.loadgen.workloads import random_requests


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    return [r.prompt_ids for r in random_requests(n, 64, 1, vocab_size=vocab, seed=seed)]


def deadline_overshoot(address: str, prompts, deadline_ms: int) -> list[float]:
    """Seconds past the deadline at which each request's DEADLINE_EXCEEDED arrived."""
    out = []
    with Client(address, retries=0) as c:
        for p in prompts:
            start = time.monotonic()
            try:
                c.generate(p, temperature=0, max_tokens=4000, ignore_eos=True, timeout_ms=deadline_ms)
            except DeadlineExceeded:
                out.append(time.monotonic() - start - deadline_ms / 1000)
    return out


def cancel_to_free(address: str, prompts) -> list[float]:
    """Seconds from a client's cancel (after 5 tokens) until no worker holds KV."""
    out = []
    with Client(address) as c:
        for p in prompts:
            stream = c.stream(p, temperature=0, max_tokens=2000, ignore_eos=True)
            got = 0
            for item in stream:
                got += len(item.token_ids) if isinstance(item, Chunk) else 0
                if got >= 5:
                    break
            start = time.monotonic()
            stream.close()
            while any(kv_held(address).values()):
                time.sleep(0.02)
            out.append(time.monotonic() - start)
    return out


def crash(actor) -> None:
    """Kill ``actor``'s process with SIGKILL, as a crash would (this machine's actors only).
    Ray sees a crash sooner than its own ``ray.kill`` (0.25 s against about 1 s here)."""
    os.kill(ray.get(actor.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)


def resume_pause(cluster: BackgroundCluster, prompts) -> tuple[list[float], float, str]:
    """Stream every prompt (400 tokens), kill the decode worker holding most of them once
    each has 5 tokens; returns each resumed stream's longest gap between tokens, the
    median gap before the kill, and the victim."""
    times: list[list[float]] = [[] for _ in prompts]

    def one(i: int) -> None:
        with Client(cluster.address, timeout=600) as c:
            for item in c.stream(
                prompts[i], temperature=0, max_tokens=400, ignore_eos=True, request_id=f"resume-{i}"
            ):
                if isinstance(item, Chunk):
                    times[i].extend([time.monotonic()] * len(item.token_ids))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    while min(len(t) for t in times) < 5:
        time.sleep(0.01)

    async def busiest():
        w = max(cluster.registry.routable("decode"), key=lambda w: w.active)
        return w.worker_id, cluster.cluster.pools["decode"].actors(w.worker_id)[0], set(w.decoding)

    victim, actor, on_victim = cluster.run(busiest(), timeout=60)
    killed_at = time.monotonic()
    before = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b < killed_at]
    crash(actor)
    for t in threads:
        t.join()
    pauses = [
        max(b - a for a, b in zip(ts, ts[1:]) if b > killed_at)
        for i, ts in enumerate(times)
        if f"resume-{i}" in on_victim
    ]
    return pauses, statistics.median(before), victim


def _row(name: str, values: list[float], extra: str = "") -> str:
    if not values:
        return f"{name:<36} (none)"
    ms = sorted(v * 1000 for v in values)
    return f"{name:<36} n={len(ms):<3} p50 {statistics.median(ms):8.1f} ms  max {ms[-1]:8.1f} ms  {extra}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--deadline-ms", type=int, default=500)
    args = ap.parse_args(argv)
    config = ClusterConfig.model_validate(
        {
            "model": {"name": args.model},
            "prefill": {"replicas": 1, "num_cpus": 0.5},
            "decode": {"replicas": 2, "num_cpus": 0.5},
            "router": {"port": 0, "http_port": None},
        }
    )
    with harness.served(config, num_cpus=None) as cluster:
        with Client(cluster.address, timeout=60) as c:
            vocab = c.list_models()[0].vocab_size
        log("deadline ...")
        overshoot = deadline_overshoot(cluster.address, _prompts(args.n, vocab, 1), args.deadline_ms)
        log("cancel ...")
        freed = cancel_to_free(cluster.address, _prompts(args.n, vocab, 2))
        log("decode worker lost ...")
        pauses, gap, victim = resume_pause(cluster, _prompts(args.n, vocab, 3))
    print(f"model {args.model}: 1 prefill + 2 decode workers")
    print(_row(f"deadline ({args.deadline_ms} ms) -> client", overshoot, "after the deadline"))
    print(_row("cancel -> no KV held anywhere", freed))
    print(_row(f"{victim} killed -> longest pause", pauses, f"(median gap before: {gap * 1000:.1f} ms)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
