"""``splitserve bench serve``: an open-loop load generator against a running
server, through the SDK, reporting the field's metrics (``loadgen.metrics``).

    splitserve bench serve --server 127.0.0.1:50051 --dataset random \\
        --input-len 256 --output-len 128 --num-prompts 200 --request-rate 4 \\
        --goodput tpot:100 --result-json out.json --plot-dir plots/

Open loop: send times are fixed before the run (``loadgen.workloads.arrival_times``)
and a slow server does not slow the arrivals (unless ``--max-concurrency``
caps requests in flight, which makes it a closed loop of that size).
``--request-rate`` takes several values for a sweep; each rate gets its own
result (and its own prompts, seeded ``seed + i``, so that no rate finds the
previous one's prompts in the prefix cache), and the plots put them side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.client import AsyncClient, Chunk, Final, ResourceExhausted, SplitserveClientError
from splitserve.loadgen import workloads
from splitserve.loadgen.metrics import RequestRecord, compute_metrics
from splitserve.loadgen.timeline import sample_roles, timeline


@dataclass
class RunResult:
    rate: float
    metrics: dict
    records: list[RequestRecord]


async def run_load(
    address: str,
    requests: list[workloads.BenchRequest],
    arrivals: list[float],
    max_concurrency: int | None = None,
    timeout_s: float = 600.0,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` at ``arrivals`` (s from start); returns the records and
    the run's duration (first send to last arrival)."""
    from tqdm import tqdm

    bar = tqdm(total=len(requests), disable=not progress, file=sys.stderr, unit="req")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    async with AsyncClient(address, retries=0, timeout=timeout_s) as client:
        start = time.perf_counter()

        async def one(req: workloads.BenchRequest, at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with limit:
                rec, _ = await send_one(client, req.prompt_ids, req.output_len)
            bar.update(1)
            return rec

        records = await asyncio.gather(*(one(r, t) for r, t in zip(requests, arrivals)))
    bar.close()
    ends = [r.chunk_times[-1] for r in records if r.chunk_times] or [time.perf_counter()]
    return list(records), max(ends) - start


async def run_conversations(
    address: str,
    conversations: list[workloads.Conversation],
    arrivals: list[float],
    timeout_s: float = 600.0,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Start each conversation at its arrival (s from start) and run its turns one after
    another, each re-sending the history with the answers the server gave, after its
    think time. A failed turn ends its conversation (the rest are not sent, and not
    recorded). Returns a record per turn sent, and the run's duration."""
    from tqdm import tqdm

    total = sum(len(c.user_ids) for c in conversations)
    bar = tqdm(total=total, disable=not progress, file=sys.stderr, unit="turn")
    async with AsyncClient(address, retries=0, timeout=timeout_s) as client:
        start = time.perf_counter()

        async def chat(conv: workloads.Conversation, at: float) -> list[RequestRecord]:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            records, answers = [], []
            for turn in range(len(conv.user_ids)):
                if turn:
                    await asyncio.sleep(conv.think_s[turn])
                rec, answer = await send_one(client, conv.prompt(turn, answers), conv.output_len)
                records.append(rec)
                bar.update(1)
                if not rec.success:
                    break
                answers.append(answer)
            return records

        runs = await asyncio.gather(*(chat(c, t) for c, t in zip(conversations, arrivals)))
    bar.close()
    records = [r for run in runs for r in run]
    ends = [r.chunk_times[-1] for r in records if r.chunk_times] or [time.perf_counter()]
    return records, max(ends) - start


async def send_one(
    client: AsyncClient, prompt_ids: list[int], output_len: int
) -> tuple[RequestRecord, list[int]]:
    """One greedy streamed request: what the load generator saw, and the tokens it got."""
    rec, tokens = RequestRecord(len(prompt_ids), time.perf_counter()), []
    try:
        stream = client.stream(prompt_ids, temperature=0, max_tokens=output_len, ignore_eos=True)
        async for item in stream:
            if isinstance(item, Chunk) and item.token_ids:
                rec.chunk_times.append(time.perf_counter())
                rec.chunk_tokens.append(len(item.token_ids))
                tokens += item.token_ids
            elif isinstance(item, Final) and item.prefill_worker and item.decode_worker:
                rec.handover = item.transfer_ms / 1000
        rec.success = bool(rec.chunk_times)
    except ResourceExhausted as e:
        rec.rejected, rec.error = True, e.details
    except SplitserveClientError as e:
        rec.error = str(e)
    return rec, tokens


def build_requests(
    args: argparse.Namespace, vocab_size: int, max_model_len: int
) -> list[workloads.BenchRequest]:
    n, seed = args.num_prompts, args.seed
    if args.dataset == "random":
        reqs = workloads.random_requests(
            n, args.input_len, args.output_len, vocab_size, seed, args.range_ratio
        )
    elif args.dataset == "sharegpt":
        reqs = workloads.sharegpt_like(n, vocab_size, seed, max_input=max_model_len // 2)
    elif args.dataset == "shared-prefix":
        reqs = workloads.shared_prefix(
            n,
            args.prefix_len,
            args.input_len,
            args.output_len,
            vocab_size,
            seed,
            num_prefixes=args.num_prefixes,
        )
    elif args.dataset == "mixed":
        reqs = workloads.mixed(
            n, vocab_size, seed, args.long_fraction, args.long_len, args.input_len, args.output_len
        )
    elif args.dataset == "shifting":
        reqs = workloads.shifting(n, vocab_size, seed, args.input_len, args.long_len, args.output_len)
    elif args.dataset == "trace":
        if not args.trace:
            raise ValueError("--dataset trace needs --trace FILE")
        reqs = workloads.trace(args.trace, vocab_size, seed)
    else:
        raise ValueError(f"unknown dataset {args.dataset!r}")
    too_long = [r for r in reqs if len(r.prompt_ids) + r.output_len > max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} request(s) exceed the model's context of {max_model_len} tokens")
    return reqs


def build_conversations(
    args: argparse.Namespace, vocab_size: int, max_model_len: int
) -> list[workloads.Conversation]:
    """``--dataset multi-turn``: ``--num-prompts`` conversations of ``--num-turns``."""
    convs = workloads.multi_turn(
        args.num_prompts,
        args.num_turns,
        args.prefix_len,
        args.input_len,
        args.output_len,
        vocab_size,
        args.seed,
        num_prefixes=args.num_prefixes,
        think_s=args.think_time,
    )
    longest = max(len(c.system_ids) + sum(len(u) for u in c.user_ids) + c.output_len * c.turns for c in convs)
    if longest > max_model_len:
        raise ValueError(
            f"a conversation's last turn would reach {longest} tokens, past the model's context of "
            f"{max_model_len}: fewer turns or shorter messages"
        )
    return convs


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms)."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[name] = float(value)
    return slos


async def _send(
    args: argparse.Namespace, rate: float, address: str, limits: tuple[int, int]
) -> tuple[list[RequestRecord], float]:
    """One rate's load (``args.seed`` already this rate's): its records and duration."""
    if args.dataset == "multi-turn":
        conversations = build_conversations(args, *limits)
        arrivals = workloads.arrival_times(len(conversations), rate, args.burstiness, args.seed)
        print(f"rate {rate:g} conversations/s: {len(conversations)} x {args.num_turns}", file=sys.stderr)
        return await run_conversations(address, conversations, arrivals, progress=True)
    requests = build_requests(args, *limits)
    if args.dataset == "trace":
        arrivals = [r.arrival_s for r in requests]
    else:
        arrivals = workloads.arrival_times(len(requests), rate, args.burstiness, args.seed)
    print(f"rate {rate:g} req/s: {len(requests)} requests", file=sys.stderr)
    return await run_load(address, requests, arrivals, args.max_concurrency, progress=True)


async def run_rates(args: argparse.Namespace, address: str) -> list[RunResult]:
    async with AsyncClient(address, retries=2, timeout=30) as probe:
        (model,) = await probe.list_models()
    limits = (model.vocab_size, model.max_model_len)
    slos = parse_goodput(args.goodput)
    results = []
    for i, rate in enumerate(args.request_rate):
        # Fresh prompts per rate (seed + i): a rerun of the same prompts would hit the prefix cache.
        seeded = argparse.Namespace(**{**vars(args), "seed": args.seed + i})
        before = await server_counters(address)
        sampler = asyncio.create_task(sample_roles(address))
        try:
            records, duration = await _send(seeded, rate, address, limits)
        finally:
            sampler.cancel()
        roles = await sampler
        metrics = compute_metrics(records, duration, slos)
        metrics["over_time"] = timeline(records, roles)
        await asyncio.sleep(1.0)  # the router polls its workers' counters twice a second
        after = await server_counters(address)
        metrics |= {key: after[key] - before.get(key, 0) for key in after}
        metrics |= {
            "request_rate": rate,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
        }
        results.append(RunResult(rate, metrics, records))
    return results


SERVER_COUNTERS = {
    "prefilled_local": "prompts prefilled on their decode worker",
    "prefilled_remote": "prompts prefilled on a prefill worker",
    "reused_device_tokens": "prompt tokens taken from a KV cache",
    "reused_host_tokens": "prompt tokens reloaded from a host tier",
    "pulled_tokens": "prompt tokens copied from another worker",
    "decode_lent_tokens": "of those, from a decode worker's KV",
    "held_tokens": "handed-over prompt tokens a decode worker held already",
    "moved_tokens": "handed-over prompt tokens whose KV moved",
}


async def server_counters(address: str) -> dict[str, float]:
    """The server's own counters now (``SERVER_COUNTERS``, summed over workers), from its
    status; a run's figures are the difference over the run."""
    async with AsyncClient(address, retries=2, timeout=30) as client:
        st = await client.cluster_status()
    placed = collections.Counter()
    for p in st.placements:  # one count per (placement, reason)
        placed[p.placement] += p.count
    reuse = [w.prefix_reuse for pool in st.pools for w in pool.workers]
    decode_reuse = [w.prefix_reuse for pool in st.pools if pool.role == "decode" for w in pool.workers]
    return {
        "prefilled_local": placed["local"],
        "prefilled_remote": placed["remote"],
        "reused_device_tokens": sum(r.device_tokens for r in reuse),
        "reused_host_tokens": sum(r.host_tokens for r in reuse),
        "pulled_tokens": sum(r.pulled_tokens for r in reuse),
        "decode_lent_tokens": sum(r.lent_tokens for r in decode_reuse),
        "held_tokens": sum(r.import_held_tokens for r in reuse),
        "moved_tokens": sum(r.import_moved_tokens for r in reuse),
    }


def print_summary(label: str, m: dict) -> None:
    print(f"==== {label}: rate {m['request_rate']:g} req/s ====")
    print(
        f"completed {m['completed']}/{m['num_prompts']} (failed {m['failed']}, rejected {m['rejected']}) "
        f"in {m['duration']:.1f} s; {m['request_throughput']:.2f} req/s, {m['output_throughput']:.1f} tok/s"
    )
    for name in ("ttft", "tpot", "itl", "e2el", "handover"):
        if f"mean_{name}_ms" not in m:
            continue
        print(
            f"  {name.upper():<5} mean {m[f'mean_{name}_ms']:8.1f}  median {m[f'median_{name}_ms']:8.1f}  "
            f"p90 {m[f'p90_{name}_ms']:8.1f}  p99 {m[f'p99_{name}_ms']:8.1f} ms"
        )
    if "request_goodput" in m:
        print(f"  goodput {m['request_goodput']:.2f} req/s, SLO attainment {m['slo_attainment']:.1%}")
    server = [f"{what} {m[key]:,.0f}" for key, what in SERVER_COUNTERS.items() if m.get(key)]
    if server:
        print("  server: " + "; ".join(server))
    roles = m.get("over_time", {}).get("roles", [])
    if len(roles) > 1:
        print("  roles (prefill:decode from t s): " + ", ".join(f"{p}:{d} from {t:g}" for t, p, d in roles))


def write_json(path: str, payload: object) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset",
        default="random",
        choices=["random", "sharegpt", "shared-prefix", "mixed", "shifting", "trace", "multi-turn"],
        help="multi-turn: --num-prompts conversations arriving at --request-rate per second",
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument(
        "--input-len",
        type=int,
        default=256,
        help="random/mixed/shifting (short ones)/shared-prefix suffix/multi-turn user message",
    )
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: widen lengths by this fraction")
    p.add_argument(
        "--prefix-len",
        type=int,
        default=512,
        help="shared-prefix: the common prefix; multi-turn: system prompt",
    )
    p.add_argument(
        "--num-prefixes", type=int, default=1, help="shared-prefix, multi-turn: how many distinct prefixes"
    )
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument(
        "--think-time",
        type=float,
        default=1.0,
        help="multi-turn: mean pause (s) before a turn after the first",
    )
    p.add_argument("--long-len", type=int, default=2048, help="mixed, shifting: length of the long prompts")
    p.add_argument("--long-fraction", type=float, default=0.1, help="mixed: fraction of long prompts")
    p.add_argument("--trace", default=None, help="trace: JSONL of timestamp, input_len, output_len")
    p.add_argument(
        "--request-rate", type=float, nargs="+", default=[float("inf")], help="req/s; several = sweep"
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1.0 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument(
        "--goodput", nargs="*", default=[], metavar="METRIC:MS", help="SLOs, e.g. tpot:100 ttft:2000"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None, help="write the metrics (vLLM's keys) here")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here (needs matplotlib)")


def main(args: argparse.Namespace) -> int:
    from splitserve.loadgen import plots

    results = asyncio.run(run_rates(args, args.server))
    for r in results:
        print_summary(args.server, r.metrics)
    if args.result_json:
        write_json(args.result_json, [r.metrics for r in results])
    if args.plot_dir:
        plots.write_all(args.plot_dir, {"server": results}, parse_goodput(args.goodput))
    return 0
