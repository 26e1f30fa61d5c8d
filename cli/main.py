"""The ``splitserve`` command line.

    splitserve serve [MODEL] [--config PATH] [--tensor-parallel-size N] [...]  (vLLM's flags; see --help)
    splitserve generate PROMPT [--server HOST:PORT] [--stream] [...]
    splitserve status [--server HOST:PORT]
    splitserve bench serve|compare [...]     (see --help)

stdout carries only generated text (and ``status`` output), so scripts can
capture it; logs and progress go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path

DEFAULT_SERVER = "127.0.0.1:50051"


def _err(msg: str) -> None:
    print(f"splitserve: {msg}", file=sys.stderr, flush=True)


# ---- serve -------------------------------------------------------------------------------
def _serve(args: argparse.Namespace) -> int:
    from splitserve.cluster.config import ClusterConfig, describe

    if args.help_config:
        print("\n".join(describe()))
        return 0
    try:
        config = serve_config(args, ClusterConfig.load(args.config))
    except ValueError as e:
        _err(str(e))
        return 2
    return asyncio.run(_serve_until_signal(config))


def serve_config(args: argparse.Namespace, config):
    """``config`` with the ``serve`` command's flags applied: a flag given overrides
    the config file, a flag left out leaves it. Raises ``ValueError``."""
    from splitserve.cluster.config import ClusterConfig

    data = config.model_dump()
    model = {
        "name": args.model,
        "served_name": args.served_model_name,
        "max_model_len": args.max_model_len,
        "dtype": args.dtype,
        "generation_config": None if args.generation_config is None else args.generation_config == "auto",
    }
    data["model"].update({k: v for k, v in model.items() if v is not None})
    lora = {
        "max_loras": args.max_loras,
        "max_cpu_loras": args.max_cpu_loras,
        "max_lora_rank": args.max_lora_rank,
    }
    if args.lora_modules:
        lora["lora_modules"] = lora_modules(args.lora_modules, data["model"])
    if args.enable_lora or args.lora_modules:
        lora["enable_lora"] = True
    data["model"].update({k: v for k, v in lora.items() if v is not None})
    if args.model is not None and args.served_model_name is None:
        data["model"]["served_name"] = args.model  # clients name the model as the user did
    router = {"host": args.host, "port": args.port, "http_port": args.http_port}
    router["replicas"] = args.router_replicas
    data["router"].update({k: v for k, v in router.items() if v is not None})
    if args.address:
        data["ray"]["address"] = args.address
    from splitserve.router.roles import Role

    for role in Role:
        if args.quantization is not None:
            data[role]["engine"]["quantization"] = args.quantization
        if args.kv_cache_memory_fraction is not None:
            data[role]["engine"]["kv_cache_memory_fraction"] = args.kv_cache_memory_fraction
        if args.kv_cache_dtype is not None:
            data[role]["engine"]["kv_cache_dtype"] = args.kv_cache_dtype
        if args.tensor_parallel_size is not None:
            data[role]["tp_size"] = args.tensor_parallel_size
        if args.expert_parallel_size is not None and role != Role.PREFILL:
            data[role]["ep_size"] = args.expert_parallel_size
    return ClusterConfig.model_validate(data)


def lora_modules(specs: list[str], model: dict) -> dict[str, str]:
    """``--lora-modules`` as {name: path}: each ``NAME=PATH``, or vLLM's JSON form (whose
    ``base_model_name``, if given, must be the served model's). ``ValueError`` otherwise."""
    out = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                item = json.loads(spec)
                name, path = item["name"], item["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {spec}: the JSON form needs a name and a path") from None
            base = item.get("base_model_name")
            if base and base not in (model.get("name"), model.get("served_name")):
                served = model.get("name")
                raise ValueError(f"--lora-modules: adapter {name!r} is for {base!r}, not {served!r}")
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {spec}: give NAME=PATH")
        out[name] = path
    return out


async def _serve_until_signal(config) -> int:
    from splitserve.cluster.app import ServingCluster

    start = time.perf_counter()
    cluster = ServingCluster(config, progress=_err)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, cluster.reload_api_keys)
    starting = asyncio.create_task(cluster.start())
    await asyncio.wait([starting, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        _err("interrupted while starting; shutting down")
        await asyncio.gather(starting, return_exceptions=True)
        return 130
    if starting.exception() is not None:
        _err(f"failed to start: {starting.exception()}")
        return 1
    _err(f"ready in {time.perf_counter() - start:.1f} s; Ctrl-C stops")
    await stop.wait()
    _err("shutting down (finishing running requests) ...")
    await cluster.stop()
    _err("stopped")
    return 0


# ---- generate ----------------------------------------------------------------------------
def _generate(args: argparse.Namespace) -> int:
    from splitserve.client import Client, SplitserveClientError
    from splitserve.client.types import Chunk

    server = args.server
    if args.wait:
        server = server or DEFAULT_SERVER
        if not _wait_for_server(server, args.wait):
            _err(f"no server became ready on {server} within {args.wait:.0f} s")
            return 1
    if server is None:
        with Client(DEFAULT_SERVER, retries=0) as probe:
            if probe.health(timeout=1.0):
                server = DEFAULT_SERVER
    if server is None:
        return _generate_in_process(args)
    messages = None if args.raw else [{"role": "user", "content": args.prompt}]
    prompt = args.prompt if args.raw else None
    options = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    try:
        with Client(server, api_key=args.api_key) as client:
            if args.stream:
                for item in client.stream(prompt, messages=messages, **options):
                    if isinstance(item, Chunk):
                        sys.stdout.write(item.text)
                        sys.stdout.flush()
            else:
                sys.stdout.write(client.generate(prompt, messages=messages, **options).text)
    except SplitserveClientError as e:
        _err(f"{server}: {e}")
        return 1
    sys.stdout.write("\n")
    return 0


def _wait_for_server(server: str, timeout_s: float) -> bool:
    from splitserve.client import Client

    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        # A fresh channel per probe: a channel that failed to connect backs off for seconds.
        with Client(server, retries=0) as probe:
            if probe.health(timeout=1.0):
                return True
        if time.monotonic() > deadline:
            return False
        if not said:
            _err(f"waiting for the server on {server} to be ready ...")
            said = True
        time.sleep(0.5)


def _generate_in_process(args: argparse.Namespace) -> int:
    from splitserve.engine.engine import Engine
    from splitserve.wire.config import EngineConfig
    from splitserve.wire.errors import SplitserveError
    from splitserve.wire.sampling import SamplingParams

    _err(f"no server on {DEFAULT_SERVER}; running the engine in-process")
    start = time.perf_counter()
    try:
        engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        if args.raw:
            engine.add_request(args.prompt, params)
        else:
            engine.add_request(messages=[{"role": "user", "content": args.prompt}], params=params)
    except SplitserveError as e:
        _err(str(e))
        return 2
    _err(f"model loaded in {time.perf_counter() - start:.1f} s")
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


# ---- status ------------------------------------------------------------------------------
def _add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key",
        default=None,
        help="the server's API key, if it wants one (default: the SPLITSERVE_API_KEY environment variable)",
    )


def _status(args: argparse.Namespace) -> int:
    from splitserve.client import Client, SplitserveClientError

    try:
        with Client(args.server, retries=0, timeout=5.0, api_key=args.api_key) as client:
            st = client.cluster_status(traces=args.traces)
    except SplitserveClientError as e:
        _err(f"{args.server}: {e}")
        return 1
    print(f"{st.model} ({st.mode}), {st.inflight_requests} request(s) in flight")
    _print_routers(st)
    head = ("worker", "role", "state", "alive", "running", "waiting", "queued tok", "KV used", "admission")
    head += ("restarts", "failed alone", "revision")
    print(
        f"{head[0]:<14} {head[1]:<10} {head[2]:<9} {head[3]:<6} {head[4]:>7} {head[5]:>7} {head[6]:>10} "
        f"{head[7]:>13} {head[8]:>9} {head[9]:>8} {head[10]:>12}  {head[11]:<17} node (type)"
    )
    for pool in st.pools:
        for w in pool.workers:
            kv = f"{w.kv_blocks_used}/{w.kv_blocks_total}"
            node = "waiting for a node" if w.waiting_for_node else f"{w.node_id[:12]} ({w.node_type or '-'})"
            failed = sum(w.sequence_errors.values())  # requests its engine failed alone
            print(
                f"{w.worker_id:<14} {w.role:<10} {w.state:<9} {'yes' if w.alive else 'NO':<6} {w.running:>7} "
                f"{w.waiting:>7} {w.queued_prompt_tokens:>10} {kv:>13} {w.waiting_for_blocks:>9} "
                f"{w.restarts:>8} {failed:>12}  {w.revision or '-':<17} {node}"
                + (f"  {w.error}" if w.error else "")
            )
    _print_adapters(st)
    _print_capacity(st)
    _print_expert_load(st)
    _print_prefix_reuse(st)
    _print_speculation(st)
    for g in st.given_up:
        print(f"given up {time.strftime('%H:%M:%S', time.localtime(g.at))}: {g.reason}")
    if st.placements:
        decided = ", ".join(f"{p.placement}/{p.reason} {p.count}" for p in st.placements)
        print(f"prefill placement: {decided}; handover estimate {st.handover_ms:.1f} ms")
    if st.transfer_failures:
        failed = ", ".join(f"{f.error} {f.count} ({f.action})" for f in st.transfer_failures)
        print(f"KV transfers failed: {failed}")
    for t in st.traces:
        _print_trace(t)
    return 0


class _WorkerChanges:
    """While a long call runs: the cluster's workers as they start, change state and stop,
    a line each (read from ``ClusterStatus`` every ``every_s``, on a thread of its own)."""

    def __init__(self, server: str, api_key: str | None, every_s: float = 1.0):
        import threading

        self._server, self._api_key, self._every_s = server, api_key, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="worker-changes")

    def __enter__(self) -> _WorkerChanges:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10 * self._every_s)

    def _watch(self) -> None:
        from splitserve.client import Client, SplitserveClientError

        seen: dict[str, str] | None = None
        with Client(self._server, retries=0, timeout=10, api_key=self._api_key) as client:
            while not self._stop.wait(self._every_s):
                try:
                    st = client.cluster_status()
                except SplitserveClientError:
                    continue
                now = {w.worker_id: w.state for p in st.pools for w in p.workers}
                if seen is not None:
                    for wid, state in now.items():
                        if seen.get(wid) != state:
                            print(f"  {time.strftime('%H:%M:%S')} {wid}: {state}", flush=True)
                    for wid in seen.keys() - now.keys():
                        print(f"  {time.strftime('%H:%M:%S')} {wid}: stopped", flush=True)
                seen = now


def _upgrade(args: argparse.Namespace) -> int:
    from splitserve.client import Client, SplitserveClientError

    if args.config is None and args.model is None:
        _err("upgrade to what? give --config FILE, --model MODEL, or both")
        return 2
    config = Path(args.config).read_text() if args.config else ""
    try:
        with Client(args.server, retries=0, timeout=args.timeout, api_key=args.api_key) as client:
            with _WorkerChanges(args.server, args.api_key):
                r = client.upgrade(config, args.model or "", args.pace)
    except SplitserveClientError as e:
        _err(f"{args.server}: {e}")
        return 1
    print(f"upgraded: {len(r.started)} worker(s) started ({', '.join(r.started)}), {len(r.removed)} stopped")
    print(f"revision now: {', '.join(r.revisions)}")
    return 0


def _drain(args: argparse.Namespace) -> int:
    from splitserve.client import Client, SplitserveClientError

    try:
        with Client(args.server, retries=0, timeout=args.timeout + 30.0, api_key=args.api_key) as client:
            r = client.drain(args.worker, args.by, args.timeout)
    except SplitserveClientError as e:
        _err(f"{args.server}: {e}")
        return 1
    print(f"{args.worker} drained: {r.moved} request(s) moved off, {r.left} left to finish there")
    return 0


def _print_routers(st) -> None:
    """Every router (asked of router 0), or the one that answered."""
    if len(st.routers) > 1 or st.answered_by:
        print(f"answered by router {st.answered_by}")
    if len(st.routers) > 1:
        for r in st.routers:
            alive = "" if r.alive else "  NOT ANSWERING (being replaced)"
            http = f", HTTP {r.http_address}" if r.http_address else ""
            print(
                f"router {r.index}: {r.address}{http} on node {r.node_id[:12]}: {r.inflight_requests} in "
                f"flight (its share {r.max_inflight_requests}), {r.admitted} admitted{alive}"
            )


def _print_capacity(st) -> None:
    """Each pool's KV cache, context and concurrency (one line per distinct figure)."""
    for pool in st.pools:
        seen = {
            (w.kv_cache_tokens, w.kv_bytes_per_token, w.max_model_len, w.max_concurrency, w.expert_ranks)
            for w in pool.workers
            if w.max_model_len
        }
        for tokens, per_token, length, concurrency, ranks in sorted(seen):
            # an expert-parallel worker's ranks each cache their own sequences
            where = f"per rank x {ranks} ranks (EP)" if ranks > 1 else "per worker"
            print(
                f"{pool.role}: KV cache {tokens:,} tokens {where} ({per_token:,} bytes per token per "
                f"rank); max context {length:,} tokens; {concurrency:.2f}x concurrency at that length"
            )


def _print_expert_load(st) -> None:
    """Each MoE worker's expert load over its last window: per rank, and the hottest expert."""
    from splitserve.wire.outputs import rank_loads

    for pool in st.pools:
        for w in pool.workers:
            if not w.expert_tokens:
                continue
            tokens = list(w.expert_tokens)
            per = len(tokens) // max(1, w.expert_ranks)
            ranks = ", ".join(
                f"rank {r} {n:,} (experts {r * per}-{(r + 1) * per - 1})"
                for r, n in enumerate(rank_loads(tokens, w.expert_ranks))
            )
            hot = max(range(len(tokens)), key=tokens.__getitem__)
            print(
                f"{w.worker_id}: expert load over the last {w.expert_window_s:.0f} s, "
                f"tokens routed: {ranks}; "
                f"hottest expert {hot} ({tokens[hot]:,})"
            )


def _print_speculation(st) -> None:
    """Per worker that speculates: its proposer, acceptance rate and mean accepted length."""
    for pool in st.pools:
        for w in pool.workers:
            s = w.speculation
            if not s.method:
                continue
            rate = s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0
            length = 1 + s.accepted_tokens / s.drafts if s.drafts else 0.0
            print(
                f"{w.worker_id}: speculative decoding ({s.method}): "
                f"{s.accepted_tokens:,} of {s.draft_tokens:,} "
                f"proposed tokens kept ({rate:.0%}), {length:.2f} tokens per checked step"
            )


def _print_prefix_reuse(st) -> None:
    """Per worker that reused any prompt KV: tokens by where they came from, the share of
    the prompt tokens it was handed over that it held, and its host tier."""
    for pool in st.pools:
        for w in pool.workers:
            r = w.prefix_reuse
            handed = r.import_held_tokens + r.import_moved_tokens
            pulls = r.pulls + r.pull_failures
            shown = (r.device_tokens, r.host_tokens, handed, r.host_capacity_blocks, pulls, r.lent_tokens)
            if not any(shown):
                continue
            line = (
                f"{w.worker_id}: prefix tokens reused: cache {r.device_tokens:,}, host tier {r.host_tokens:,}"
            )
            if handed:
                line += f"; handed-over prompt tokens held {r.import_held_tokens:,} of {handed:,}"
            if pulls or r.lent_tokens:
                line += (
                    f"; pulled {r.pulled_tokens:,} tokens from other prefill workers in {r.pulls:,} of "
                    f"{pulls:,} pulls, lent {r.lent_tokens:,}"
                )
            if r.host_capacity_blocks:
                line += (
                    f"; host tier {r.host_held_blocks:,}/{r.host_capacity_blocks:,} blocks, "
                    f"saved {r.host_saved_blocks:,}, reloaded {r.host_reloaded_blocks:,}, "
                    f"dropped {r.host_dropped_blocks:,}, corrupt {r.host_corrupt_blocks:,}"
                )
            print(line)


def _print_adapters(st) -> None:
    """Each worker's LoRA adapters (name and a digest of its weights), where it serves any."""
    for pool in st.pools:
        for w in pool.workers:
            if w.lora_adapters:
                served = ", ".join(f"{n} ({d})" for n, d in sorted(w.lora_adapters.items()))
                print(f"LoRA adapters on {w.worker_id}: {served}")


def _print_trace(t) -> None:
    """One request trace: a header line, then its phases with their workers."""
    total = sum(s.duration_ms for s in t.spans)
    cached = f", {t.cached_prompt_tokens} cached" if t.cached_prompt_tokens else ""
    kv = f", KV {t.kv_bytes / 2**20:.1f} MiB pulled in {t.kv_pull_ms:.1f} ms" if t.kv_bytes else ""
    if t.prefix_pulled_tokens:
        kv += f", {t.prefix_pulled_tokens} prefix tokens copied from {t.prefix_pulled_from}"
    revisions = dict.fromkeys(r for r in (t.prefill_revision, t.decode_revision) if r)  # in order, once
    if revisions:
        kv += f", revision {' then '.join(revisions)}"
    print(
        f"\n{t.request_id}  {t.outcome}  {total:.1f} ms  "
        f"{t.prompt_tokens} prompt tokens{cached} -> {t.output_tokens} output tokens{kv}"
    )
    for s in t.spans:
        start = time.strftime("%H:%M:%S", time.localtime(s.start)) + f".{int(s.start * 1000) % 1000:03d}"
        print(f"  {start}  {s.name:<12} {s.duration_ms:>9.1f} ms  {s.worker or 'router'}")
    for m in t.marks:  # what went wrong on the way, in its own words
        if m.detail:
            print(f"  {m.name}: {m.detail}")


# ---- bench -------------------------------------------------------------------------------
def _add_bench_arguments(serve: argparse.ArgumentParser, compare: argparse.ArgumentParser) -> None:
    from splitserve.cluster.config import CONFIG_DIR
    from splitserve.loadgen import compare as compare_mod
    from splitserve.loadgen import serve as serve_bench

    serve_bench.add_arguments(serve)
    serve.set_defaults(func=lambda a: _run_bench(serve_bench.main, a))
    compare_mod.add_arguments(compare, CONFIG_DIR)
    compare.set_defaults(func=lambda a: _run_bench(compare_mod.main, a))


def _run_bench(fn, args: argparse.Namespace) -> int:
    from splitserve.client import SplitserveClientError

    try:
        return fn(args)
    except (ValueError, RuntimeError, SplitserveClientError) as e:
        _err(str(e))
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
    _add_generate_parser(sub)
    bench = sub.add_parser("bench", help="serving benchmarks (the field's metrics)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bs = bench_sub.add_parser("serve", help="open-loop load against a running server")
    bs.add_argument("--server", default=DEFAULT_SERVER, help=f"HOST:PORT (default {DEFAULT_SERVER})")
    bc = bench_sub.add_parser("compare", help="the same load against disaggregated and colocated clusters")
    _add_bench_arguments(bs, bc)

    st = sub.add_parser("status", help="pools, workers, queues and KV occupancy of a running server")
    st.add_argument("--server", default=DEFAULT_SERVER, help=f"HOST:PORT (default {DEFAULT_SERVER})")
    st.add_argument("--traces", type=int, default=0, metavar="N", help="also the last N requests' traces")
    _add_api_key_argument(st)
    st.set_defaults(func=_status)

    dr = sub.add_parser(
        "drain",
        help="stop routing to a decode worker and move its running requests to the others",
        description="Stop routing to WORKER (a decode or colocated worker) and move its running requests "
        "to the other workers of its revision, with their KV where it can export it (live migration: "
        "each stream goes on without a token repeated or skipped). It stays, draining, until removed.",
    )
    dr.add_argument("worker", help="the worker id (splitserve status lists them)")
    dr.add_argument("--by", choices=["kv", "recompute"], default="kv", help="how the requests move")
    dr.add_argument("--timeout", type=float, default=60.0, help="seconds to keep moving requests off it")
    dr.add_argument("--server", default=DEFAULT_SERVER, help=f"HOST:PORT (default {DEFAULT_SERVER})")
    _add_api_key_argument(dr)
    dr.set_defaults(func=_drain)

    up = sub.add_parser(
        "upgrade",
        help="replace every worker, a few at a time under load, by one of a new config or model",
        description="A rolling upgrade: per pool, start PACE workers built from the new config (or the "
        "running one with --model), let them serve, drain PACE old ones (their requests move to "
        "workers of their revision, or finish) and stop them, until none is left; workers of two "
        "revisions never exchange KV. Without room for new workers beside the old ones, each old one "
        "goes before its replacement starts (in place); where that would leave the only decode "
        "worker's role empty, it refuses at once, saying what it needs. Workers are printed as they "
        "start and stop. A failure rolls back.",
    )
    up.add_argument("--config", default=None, help="the new cluster config (YAML); default: the running one")
    up.add_argument("--model", default=None, help="the new model (directory, .gguf or name)")
    up.add_argument("--pace", type=int, default=1, help="workers replaced at a time, per pool")
    up.add_argument("--timeout", type=float, default=3600.0, help="seconds the whole upgrade may take")
    up.add_argument("--server", default=DEFAULT_SERVER, help=f"HOST:PORT (default {DEFAULT_SERVER})")
    _add_api_key_argument(up)
    up.set_defaults(func=_upgrade)

    from splitserve.cli import plan as plan_cli

    plan = sub.add_parser("plan", help="capacity planning offline (the cluster simulator)")
    plan_sub = plan.add_subparsers(dest="plan_command", required=True)
    sim = plan_sub.add_parser("simulate", help="a bursty trace under each autoscaling policy, simulated")
    plan_cli.add_arguments(sim)
    sim.set_defaults(func=lambda a: _run_bench(plan_cli.main, a))
    prof = plan_sub.add_parser("profile", help="measure a cluster's workers, for the simulator (--profile)")
    plan_cli.add_profile_arguments(prof)
    prof.set_defaults(func=lambda a: _run_bench(plan_cli.main_profile, a))
    return parser


def _add_serve_parser(sub) -> None:
    srv = sub.add_parser(
        "serve",
        help="start the cluster (Ray, workers, gRPC router) and serve until Ctrl-C",
        description="Start the cluster and serve until Ctrl-C. The config file describes the pools; "
        "the flags (vLLM's names) override it.",
    )
    srv.add_argument(
        "model",
        nargs="?",
        default=None,
        help="an HF directory, a .gguf file or smollm2 (default: the config's)",
    )
    srv.add_argument("--config", default=None, help="a cluster_configs/*.yaml (default: local.yaml)")
    srv.add_argument(
        "--address", default=None, help="attach to this Ray cluster ('auto') instead of starting one"
    )
    srv.add_argument("--host", default=None, help="address the gRPC and HTTP servers listen on")
    srv.add_argument("--port", type=int, default=None, help="gRPC port (overrides the config)")
    srv.add_argument(
        "--http-port", type=int, default=None, help="OpenAI-compatible HTTP port (overrides the config)"
    )
    srv.add_argument(
        "--router-replicas",
        type=int,
        default=None,
        help="router processes on the same ports (router.replicas; the kernel spreads connections)",
    )
    srv.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="TP ranks per worker, in every pool (the config may set each pool's own tp_size)",
    )
    srv.add_argument(
        "--expert-parallel-size",
        "-ep",
        type=int,
        default=None,
        help="MoE models: expert-parallel ranks per decode (or colocated) worker, attention data-parallel "
        "(prefill stays TP; docs/models.md)",
    )
    srv.add_argument(
        "--max-model-len", type=int, default=None, help="context length cap (default: the model's)"
    )
    srv.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None)
    srv.add_argument(
        "--quantization",
        "-q",
        choices=["none", "fp8", "int8"],
        default=None,
        help="every pool's linear layers (the config may set each pool's own)",
    )
    srv.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=None,
        help="on a GPU: the share of the memory free after the weights that the KV cache takes "
        "(default 0.9; what vLLM's --gpu-memory-utilization sets), in every pool",
    )
    srv.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default=None,
        help="the KV cache's dtype in every pool: auto (the model's) or fp8 (e4m3 with scales; "
        "half the bytes of bf16)",
    )
    srv.add_argument(
        "--served-model-name", default=None, help="the model's name in requests (default: MODEL as given)"
    )
    srv.add_argument(
        "--generation-config",
        choices=["auto", "vllm"],
        default=None,
        help="auto: the model's generation_config.json sets defaults of unset sampling fields; "
        "vllm: ignore it",
    )
    srv.add_argument(
        "--enable-lora", action="store_true", default=None, help="serve LoRA adapters (vLLM's flag)"
    )
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) a request names as its model; each NAME=PATH, or vLLM's "
        'JSON form {"name": ..., "path": ..., "base_model_name": ...}',
    )
    srv.add_argument("--max-loras", type=int, default=None, help="adapters in one batch (device slots)")
    srv.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept in host memory (default: --max-loras)"
    )
    srv.add_argument("--max-lora-rank", type=int, default=None, help="the highest adapter rank taken")
    srv.add_argument("--help-config", action="store_true", help="list every config field and exit")
    srv.set_defaults(func=_serve)


def _add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt", help="the user's message (or raw text with --raw)")
    gen.add_argument(
        "--server",
        default=None,
        help=f"HOST:PORT of a server (default: {DEFAULT_SERVER} if up, else in-process)",
    )
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    gen.add_argument(
        "--wait",
        type=float,
        default=0,
        metavar="SECONDS",
        help="wait up to this long for the server to be ready",
    )
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument(
        "--model", default="smollm2", help="in-process only: smollm2, a .gguf file or an HF directory"
    )
    gen.add_argument("--dtype", default="auto", help="in-process only: auto, float32, bfloat16 or float16")
    _add_api_key_argument(gen)
    gen.set_defaults(func=_generate)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
