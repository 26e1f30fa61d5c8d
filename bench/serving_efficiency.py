"""Serving-path efficiency: what the cluster around an engine costs.

One colocated worker given every core of the machine serves ``--requests``
requests sent at once through the asyncio gRPC SDK (random prompts of
``--input-len`` tokens, ``--output-len`` output tokens each, greedy,
``ignore_eos``). The same engine config, in this process and with no cluster
running, generates as many requests offline in one ``generate`` call, once
before the served run and once after it (fresh prompts each time); their mean
is the baseline, so the machine's drift over the minutes between them cancels
to first order. Prints the output tokens/s and the ratio (served / offline);
the serving path is "free" at 1.0.

Then the latency half: the same cluster takes ``--requests`` fresh prompts as a
Poisson stream at half the request rate it just sustained. Its TPOT p50
(client-side: (last token - first token) / (tokens - 1), as vLLM's) is set
against two references measured in this process on the same engine config:

- the engine's own decode step at that load's mean concurrency (Little's law:
  rate x mean end-to-end time), as (time for ``--output-len`` tokens - time for
  1) / (``--output-len`` - 1): what a request's TPOT would be if nothing else ran;
- the same arrival trace (the same prompts at the same offsets) replayed straight
  into the engine by a loop in this process, TPOT p50 from the times each step
  returned its tokens: the same load, prefills of newly arriving prompts included,
  without the serving path. Served / replayed is what the serving path costs.

    python -m splitserve.bench.serving_efficiency                      # SmolLM2, 48 x 256/128
    python -m splitserve.bench.serving_efficiency --requests 16 --output-len 64
    python -m splitserve.bench.serving_efficiency --worker-env GOMP_SPINCOUNT=2000
    python -m splitserve.bench.serving_efficiency --engine-process   # the engine in its own process
    python -m splitserve.bench.serving_efficiency --cpus 1   # the engine on 1 core, offline and served

``--cpus N`` gives the worker N CPUs (its engine N torch threads) and the offline
engine N threads. With fewer than the machine's cores, the router, the client and
Ray's processes run on the others, and the engine no longer waits for a core they
took (a GPU worker's device is not shared with them either); the engine thread's
share "waiting for a core" shows whether it did.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass

import ray
import torch

from splitserve.bench import harness
from splitserve.client import AsyncClient, Chunk
from splitserve.cluster.config import ClusterConfig
from splitserve.engine.engine import Engine
from splitserve.engine.model.loader import load_hf_config, resolve_source
from splitserve.loadgen.workloads import random_requests
from splitserve.wire.sampling import SamplingParams


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class HalfRate:
    rate: float  # requests/s offered
    tpot_p50_ms: float
    concurrency: float  # mean requests in flight (rate x mean e2e)


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the first request at which each of ``n`` Poisson arrivals is sent."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def tpot_p50_ms(token_times: list[list[float]]) -> float:
    """Median over requests of (last token - first token) / (tokens - 1), in ms."""
    tpots = sorted((ts[-1] - ts[0]) / (len(ts) - 1) for ts in token_times)
    return tpots[len(tpots) // 2] * 1000


def served(
    config: ClusterConfig,
    prompts: list[list[int]],
    fresh: list[list[int]],
    output_len: int,
    cpus: int,
    seed: int,
) -> tuple[float, HalfRate]:
    """Output tokens/s of the whole batch through router, Ray and the worker; then
    ``fresh`` as a Poisson stream at half the request rate that batch achieved."""
    with harness.served(config, cpus) as cluster:
        asyncio.run(_generate(cluster.address, prompts[:2], 8))  # warm-up
        pool = cluster.cluster.pools["colocated"]
        (worker,) = pool.workers
        actor = pool.actors(worker.worker_id)[0]
        before = ray.get(actor.engine_thread.remote())
        t0 = time.perf_counter()
        tokens = asyncio.run(_generate(cluster.address, prompts, output_len))
        elapsed = time.perf_counter() - t0
        window = ray.get(actor.engine_thread.remote()).minus(before)
        log(f"the worker's engine thread while serving: {window.describe()}")
        rate = len(prompts) / elapsed / 2
        half = asyncio.run(_poisson(cluster.address, fresh, output_len, rate, seed))
    if tokens != len(prompts) * output_len:
        raise RuntimeError(f"expected {len(prompts) * output_len} output tokens, got {tokens}")
    return tokens / elapsed, half


async def _poisson(
    address: str, prompts: list[list[int]], output_len: int, rate: float, seed: int
) -> HalfRate:
    client = AsyncClient(address, timeout=3600)

    async def one(prompt: list[int], offset: float) -> tuple[list[float], float]:
        """(each token's arrival time, e2e in s), as this client saw them."""
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        sent, seen = time.perf_counter(), []
        async for item in client.stream(prompt, temperature=0, max_tokens=output_len, ignore_eos=True):
            if isinstance(item, Chunk):
                seen.extend([time.perf_counter()] * len(item.token_ids))
        if len(seen) != output_len:
            raise RuntimeError(f"expected {output_len} output tokens, got {len(seen)}")
        return seen, time.perf_counter() - sent

    t0 = time.perf_counter()
    offsets = arrival_offsets(len(prompts), rate, seed)
    try:
        results = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets)))
    finally:
        await client.close()
    mean_e2e = sum(e for _, e in results) / len(results)
    return HalfRate(rate, tpot_p50_ms([ts for ts, _ in results]), rate * mean_e2e)


def replayed(engine: Engine, prompts: list[list[int]], output_len: int, rate: float, seed: int) -> float:
    """TPOT p50 (ms) of ``prompts`` added to ``engine`` in this process at the same
    Poisson offsets as the served stream, stepping it in between (no serving path)."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    offsets = arrival_offsets(len(prompts), rate, seed)
    times: dict[str, list[float]] = {}
    t0, nxt = time.perf_counter(), 0
    while nxt < len(prompts) or engine.has_unfinished():
        now = time.perf_counter()
        while nxt < len(prompts) and t0 + offsets[nxt] <= now:
            times[engine.add_request(prompts[nxt], params)] = []
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(t0 + offsets[nxt] - now)
            continue
        outputs = engine.step()
        done = time.perf_counter()
        for out in outputs:
            times[out.request_id].extend([done] * len(out.new_token_ids))
    if any(len(ts) != output_len for ts in times.values()):
        raise RuntimeError(f"the replay did not generate {output_len} tokens for every request")
    return tpot_p50_ms(list(times.values()))


async def _generate(address: str, prompts: list[list[int]], output_len: int) -> int:
    client = AsyncClient(address, timeout=3600)
    try:
        outs = await asyncio.gather(
            *(client.generate(p, temperature=0, max_tokens=output_len, ignore_eos=True) for p in prompts)
        )
    finally:
        await client.close()
    return sum(len(o.token_ids) for o in outs)


def offline(engine: Engine, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens/s of ``prompts`` in one ``generate`` (fresh prompts: none cached)."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    done = engine.generate(prompts, params)
    return sum(len(c.token_ids) for c in done) / (time.perf_counter() - t0)


def decode_step_ms(engine: Engine, step_prompts: list[list[int]], output_len: int) -> float:
    """The decode step (ms) with ``len(step_prompts)`` sequences running."""

    def timed(n: int) -> float:
        t = time.perf_counter()
        engine.generate(step_prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    # The first call caches the prompts' blocks, so both timed calls prefill alike (cached).
    timed(1)
    return (timed(output_len) - timed(1)) / (output_len - 1) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--worker-env",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="environment of the served worker's process only (its pool's env), e.g. GOMP_SPINCOUNT=2000",
    )
    ap.add_argument(
        "--engine-process",
        action="store_true",
        help="the worker runs its engine in a process of its own (the pool's engine_process)",
    )
    ap.add_argument(
        "--cpus",
        type=int,
        default=None,
        help="CPUs of the served worker and torch threads of both engines (default: every core)",
    )
    harness.add_json_argument(ap)
    args = ap.parse_args(argv)
    if args.output_len < 2:
        ap.error("--output-len must be at least 2 (TPOT needs two tokens)")
    machine = os.cpu_count() or 1
    cpus = args.cpus or machine
    if not 1 <= cpus <= machine:
        ap.error(f"--cpus must be between 1 and this machine's {machine}")
    if any("=" not in pair for pair in args.worker_env):
        ap.error("--worker-env takes NAME=VALUE pairs")
    env = dict(pair.split("=", 1) for pair in args.worker_env)
    threads = torch.get_num_threads()
    torch.set_num_threads(cpus)  # the offline engine's, as the worker's (torch_threads: num_cpus)
    try:
        return run(args, cpus, machine, env)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace, cpus: int, machine: int, env: dict[str, str]) -> int:
    """The measurements and the report (``main`` has checked the arguments)."""
    config = ClusterConfig.model_validate(
        {
            "mode": "colocated",
            "model": {"name": args.model},
            "colocated": {"replicas": 1, "num_cpus": cpus, "env": env, "engine_process": args.engine_process},
            "router": {"port": 0, "http_port": None},
        }
    )
    engine_cfg = config.engine_config("colocated")
    vocab = load_hf_config(resolve_source(args.model)).vocab_size
    reqs = random_requests(args.requests, args.input_len, args.output_len, vocab_size=vocab, seed=args.seed)
    fresh = random_requests(
        args.requests, args.input_len, args.output_len, vocab_size=vocab, seed=args.seed + 1
    )
    prompts = [r.prompt_ids for r in reqs]
    later = random_requests(
        args.requests, args.input_len, args.output_len, vocab_size=vocab, seed=args.seed + 3
    )
    # Offline runs before and after the served one, on fresh prompts each, and their mean is
    # the baseline: a shared machine's speed drifts over the minutes between them.
    log("offline: the same engine config in this process ...")
    engine = Engine(engine_cfg)
    engine.generate(prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    before = offline(engine, prompts, args.output_len)
    log(f"served: one colocated worker with {cpus} CPUs ...")
    served_tps, half = served(
        config, prompts, [r.prompt_ids for r in fresh], args.output_len, machine, args.seed
    )
    log("offline again ...")
    after = offline(engine, [r.prompt_ids for r in later], args.output_len)
    offline_tps = (before + after) / 2
    batch = max(1, round(half.concurrency))
    step = random_requests(batch, args.input_len, args.output_len, vocab_size=vocab, seed=args.seed + 2)
    log(f"decode step at batch {batch} ...")
    step_ms = decode_step_ms(engine, [r.prompt_ids for r in step], args.output_len)
    log(f"replay: the half-rate stream straight into that engine ({half.rate:.2f} req/s) ...")
    replay_ms = replayed(engine, [r.prompt_ids for r in fresh], args.output_len, half.rate, args.seed)
    print(
        f"model {args.model}, {args.requests} requests x {args.input_len}/{args.output_len} tokens, "
        f"{cpus} of {machine} CPUs for the engine, max_num_seqs {engine_cfg.max_num_seqs}, "
        f"engine {'in a process of its own' if args.engine_process else 'on a thread of the worker'}"
    )
    print(harness.table(["path", "output tok/s"], [["offline", offline_tps], ["served", served_tps]]))
    harness.report(
        "served / offline",
        served_tps / offline_tps,
        args.json,
        model=args.model,
        offline_tps=offline_tps,
        served_tps=served_tps,
        tpot_p50_ms=half.tpot_p50_ms,
        step_ms=step_ms,
        replayed_tpot_p50_ms=replay_ms,
    )
    print(f"(offline: the mean of {before:.1f} before serving and {after:.1f} after)")
    print(
        f"at half that rate ({half.rate:.2f} req/s, Poisson; mean concurrency {half.concurrency:.1f}): "
        f"TPOT p50 {half.tpot_p50_ms:.1f} ms; the engine's decode step at batch {batch}: {step_ms:.1f} ms; "
        f"TPOT / step = {half.tpot_p50_ms / step_ms:.2f}x"
    )
    print(
        f"the same trace replayed into the engine in this process: TPOT p50 {replay_ms:.1f} ms; "
        f"served / replayed = {half.tpot_p50_ms / replay_ms:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
