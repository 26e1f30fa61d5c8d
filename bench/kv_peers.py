"""A KV source in a second process, driven over a pipe: the harness the KV
transfer tests and ``kv_transfer_bench`` share.

The child owns either a real prefill engine (``SourceSpec.engine``) or a bare
KV pool of a given layout filled with random bytes (``SourceSpec.layout``),
plus a ``KVSource`` of the chosen backend. It serves typed commands and calls
``source.poll()`` between them (releasing the engine blocks of every lease
that ends), as a prefill worker's loop does. The pipe stands in for the Ray
calls of the real control plane.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import stat
import statistics
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from splitserve.engine.engine import Engine
from splitserve.engine.kv_cache import allocate_zeros
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.integrity import layer_checksums
from splitserve.kv_transfer.layerwise import LayerExporter
from splitserve.wire.config import EngineConfig
from splitserve.wire.kv import DEFAULT_LEASE_S, CompatInfo, KVDescriptor, LeaseEnd, checksum_kind
from splitserve.wire.kv_layout import KVLayout
from splitserve.wire.sampling import SamplingParams


@dataclass(frozen=True)
class SourceSpec:
    backend: str
    worker_id: str = "prefill-0"
    engine: EngineConfig | None = None  # a real prefill engine, or
    layout: KVLayout | None = None  # a bare KV pool of this layout (random contents)
    device: str = "cpu"  # where the bare pool lives
    model: str = "random"  # compatibility identity of the bare pool
    lease_s: float = DEFAULT_LEASE_S


@dataclass(frozen=True)
class Prefill:
    """Prefill these prompts in one batch and export each one's KV (the requests'
    real sampling parameters: one that finishes at its first token is not exported).

    Each layer is hashed as prefill writes it (``LayerExporter``). With ``stream``
    the exports open before the forward pass and the child first answers
    ``Streaming`` (then the list of ``Exported``), so the parent can pull while
    the child computes."""

    prompts: list[list[int]]
    params: SamplingParams
    lease_s: float | None = None  # default: the source's
    stream: bool = False


@dataclass(frozen=True)
class Streaming:
    """The streamed descriptors of a ``Prefill(stream=True)``, sent before its forward pass."""

    descriptors: list[KVDescriptor]


@dataclass(frozen=True)
class Exported:
    descriptor: KVDescriptor
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    prefill_end: float = 0.0  # time.time() when the step that sampled the first token returned
    export_s: float = 0.0  # export after that step (publishing; hashing only without checksums)


@dataclass(frozen=True)
class ExportRandom:
    """Export ``num_tokens`` tokens' worth of blocks of the bare pool (ids ``first..``; a
    grouped layout's sliding groups' ids after those, ``KVLayout.transfer_ids``)."""

    num_tokens: int
    first_block: int = 0
    lease_s: float | None = None
    window_from: int = 0  # a layout with sliding windows: their layers' blocks from there on


@dataclass(frozen=True)
class ExportedRandom:
    descriptor: KVDescriptor
    export_s: float  # publishing the blocks, measured in the source process
    hash_s: float  # hashing them layer by layer first, as prefill does while it writes them


@dataclass(frozen=True)
class Corrupt:
    """Flip one byte of an exported transfer's last block (after its checksum was taken)."""

    transfer_id: str


@dataclass(frozen=True)
class Confirm:
    transfer_id: str


@dataclass(frozen=True)
class Status:
    pass


@dataclass(frozen=True)
class SourceStatus:
    pid: int
    num_exported: int
    num_free_blocks: int
    released: list[str]  # request ids whose leases ended, in order


@dataclass(frozen=True)
class SpawnChild:
    """Start a child process (``sleep``) that inherits this process's inheritable sockets,
    as a subprocess started without ``close_fds`` would (only sockets: the process's
    sentinel pipe must still close when it dies); the reply is its pid. It outlives a
    killed source and keeps that source's connections open (the caller kills it)."""

    seconds: int = 600


@dataclass(frozen=True)
class Stop:
    pass


def _inheritable_socket(fd: int) -> bool:
    """A socket without close-on-exec (gloo's are; Python's and TCPStore's are not)."""
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode) and os.get_inheritable(fd)
    except OSError:
        return False


class SourceServer:
    """The source side's state: an engine or a bare pool, a ``KVSource``, and the
    request ids whose leases ended (their engine blocks already released).

    As in a prefill worker, a poller thread calls ``source.poll()`` every
    millisecond under ``lock`` (a NIXL source progresses only when polled, also
    while the engine computes), and lease ends reach the engine on the command
    thread, in ``poll``."""

    def __init__(self, spec: SourceSpec):
        self.engine = None
        if spec.engine is not None:
            self.engine = Engine(spec.engine)
            cache, compat = self.engine.kv_cache.tensor, self.engine.kv_compat()
        else:
            lay = spec.layout
            cache = allocate_zeros(lay.cache_shape, getattr(torch, lay.dtype), spec.device)
            cache.view(torch.uint8).random_()  # arbitrary bytes: only moved and hashed
            compat = CompatInfo(model=spec.model, layout=lay, checksum=checksum_kind(cache.device.type))
        self.source = get_backend(spec.backend).source(spec.worker_id, cache, compat, spec.lease_s)
        self.lock = threading.Lock()
        self.released: list[str] = []
        self._ended: queue.SimpleQueue[LeaseEnd] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="kv-poll", daemon=True)
        self._poller.start()

    def handshake(self):
        return self.source.handshake()

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                ended = self.source.poll()
            for end in ended:
                self._ended.put(end)
            time.sleep(0.001)

    def poll(self) -> None:
        """Release the engine blocks of every lease that ended (command thread)."""
        while not self._ended.empty():
            end = self._ended.get()
            self.released.append(end.request_id)
            if self.engine is not None:
                self.engine.release(end.request_id)

    def close(self) -> None:
        self._stop.set()
        self._poller.join(5)
        with self.lock:
            self.source.close()

    def handle(self, cmd, early=None):
        """Run ``cmd``; ``early`` (if given) is called with a ``Streaming`` before it ends."""
        self.poll()
        if isinstance(cmd, Prefill):
            return self._prefill(cmd, early)
        with self.lock:
            return self._handle(cmd)

    def _handle(self, cmd):
        source = self.source
        if isinstance(cmd, ExportRandom):
            lay = source.compat.layout
            n, first = -(-cmd.num_tokens // lay.block_size), cmd.first_block
            m = n - cmd.window_from  # each sliding group's blocks, in a grouped layout
            windows = [
                list(range(first + n + g * m, first + n + (g + 1) * m)) for g in range(lay.window_groups)
            ]
            blocks = lay.transfer_ids(list(range(first, first + n)), windows, cmd.window_from)
            t0 = time.perf_counter()
            checksums = layer_checksums(source.cache, blocks, source.compat.layout, cmd.window_from)
            t1 = time.perf_counter()
            desc = source.export(
                f"rand-{cmd.first_block}-{n}-{time.time_ns()}",
                blocks,
                cmd.num_tokens,
                cmd.lease_s,
                layer_checksums=checksums,
                window_from=cmd.window_from,
            )
            return ExportedRandom(desc, time.perf_counter() - t1, t1 - t0)
        if isinstance(cmd, Corrupt):
            desc = source._exports[cmd.transfer_id].descriptor
            source.cache[0, 0, desc.block_ids[-1]].view(-1).view(torch.uint8)[7] ^= 0x40
            return True
        if isinstance(cmd, Confirm):
            source.confirm(cmd.transfer_id)
            return True
        if isinstance(cmd, SpawnChild):
            fds = [fd for fd in map(int, os.listdir("/proc/self/fd")) if _inheritable_socket(fd)]
            return subprocess.Popen(["sleep", str(cmd.seconds)], pass_fds=fds).pid
        if isinstance(cmd, Status):
            free = self.engine.block_manager.num_free_blocks if self.engine is not None else -1
            return SourceStatus(os.getpid(), source.num_exported, free, list(self.released))
        raise ValueError(f"unknown command {cmd!r}")

    def _prefill(self, cmd: Prefill, early) -> list[Exported]:
        engine = self.engine

        def announce(descriptors: list[KVDescriptor]) -> None:
            if early is not None:
                early(Streaming(descriptors))

        exporter = LayerExporter(
            self.source, stream=cmd.stream, lease_s=cmd.lease_s, lock=self.lock, on_stream=announce
        )
        engine.layer_observer = exporter
        try:
            ids = [engine.add_request(p, cmd.params, prefill_only=True) for p in cmd.prompts]
            ends = {}
            while engine.has_unfinished():
                self.poll()  # blocks of ended leases back to the engine, as a worker's tick does
                for out in engine.step():
                    if out.finished:
                        ends[out.request_id] = time.time()
                        if out.request_id not in engine.requests:  # finished at its first token
                            exporter.discard(out.request_id)
        finally:
            engine.layer_observer = None
        out = []
        for rid in ids:
            if rid not in engine.requests:
                continue
            pre = engine.prefilled(rid)
            t0 = time.perf_counter()
            desc = exporter.export(rid, pre.block_ids, pre.num_kv_tokens)
            export_s = time.perf_counter() - t0
            out.append(Exported(desc, pre.prompt_token_ids, pre.output_token_ids, ends[rid], export_s))
        return out


def source_main(spec: SourceSpec, conn) -> None:
    """Entry point of the source process: serve commands until ``Stop``."""
    server = SourceServer(spec)
    conn.send(server.handshake())
    while True:
        server.poll()
        if not conn.poll(0.0005):
            continue
        cmd = conn.recv()
        if isinstance(cmd, Stop):
            server.close()
            conn.send("stopped")
            return
        try:
            conn.send(server.handle(cmd, conn.send))
        except Exception as e:  # report, keep serving
            conn.send(RuntimeError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class SourceProcess:
    """Parent-side handle: start the child, wait for its handshake, send commands."""

    def __init__(self, spec: SourceSpec, start_timeout: float = 120.0):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=source_main, args=(spec, child), daemon=True)
        self.proc.start()
        if not self._conn.poll(start_timeout):
            self.proc.kill()
            raise TimeoutError("the source process did not start")
        self.handshake = self._conn.recv()

    def call(self, cmd, timeout: float = 300.0):
        self.send(cmd)
        return self.receive(timeout)

    def send(self, cmd) -> None:
        """Send ``cmd`` without waiting (``receive`` takes its replies, in order)."""
        self._conn.send(cmd)

    def receive(self, timeout: float = 300.0):
        if not self._conn.poll(timeout):
            raise TimeoutError("the source process did not answer")
        reply = self._conn.recv()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def stop(self, timeout: float = 30.0) -> int:
        """Stop the child and return its exit code (0 when it closed cleanly)."""
        if self.proc.is_alive():
            try:
                self.call(Stop(), timeout)
            except (TimeoutError, EOFError, BrokenPipeError, OSError):
                self.proc.kill()
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join(timeout)
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(30)


class SourceActor:
    """The same as ``SourceProcess`` with the source in a Ray actor (needs ``ray.init``
    first): the ray backend's descriptors hold ObjectRefs, which only travel through Ray."""

    def __init__(self, spec: SourceSpec, start_timeout: float = 120.0):
        import ray

        self._ray = ray
        self.actor = ray.remote(num_cpus=0)(SourceServer).remote(spec)
        self.handshake = ray.get(self.actor.handshake.remote(), timeout=start_timeout)

    def call(self, cmd, timeout: float = 300.0):
        return self._ray.get(self.actor.handle.remote(cmd), timeout=timeout)

    def stop(self, timeout: float = 30.0) -> int:
        self._ray.kill(self.actor)
        return 0

    def kill(self, timeout: float = 30.0) -> None:
        """Kill the actor and return once Ray reports it dead (``ray.kill`` is asynchronous)."""
        self._ray.kill(self.actor, no_restart=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self._ray.get(self.actor.handshake.remote(), timeout=timeout)
            except self._ray.exceptions.RayActorError:
                return
            time.sleep(0.05)
        raise TimeoutError("the source actor did not die")


def start_source(spec: SourceSpec) -> SourceProcess | SourceActor:
    """A source in another process: a Ray actor for the ray backend, else a spawned child."""
    return SourceActor(spec) if spec.backend == "ray" else SourceProcess(spec)


def timed_pulls(layout: KVLayout, num_tokens: int, repeats: int, backend: str, window_from: int = 0):
    """(bytes a pull moved, median seconds of ``repeats`` pulls) of ``num_tokens`` tokens'
    blocks of a bare pool of ``layout`` in a source process (``ExportRandom``, sliding
    layers from ``window_from``) into this process, each verified; the first pull, which
    also sets up the connection, is not counted. The source stops after."""
    src = start_source(SourceSpec(backend, layout=layout))
    try:
        cache = torch.zeros(layout.cache_shape, dtype=getattr(torch, layout.dtype))
        sink = get_backend(backend).sink("bench-decode", cache, CompatInfo(model="random", layout=layout))
        sink.connect(src.handshake)
        times, moved = [], 0
        for _ in range(repeats + 1):
            desc = src.call(ExportRandom(num_tokens=num_tokens, window_from=window_from)).descriptor
            t0 = time.perf_counter()
            sink.pull(desc, list(range(len(desc.block_ids))), timeout=300.0)
            times.append(time.perf_counter() - t0)
            moved = sink.last_stats.num_bytes
        sink.close()
    finally:
        src.stop()
    return moved, statistics.median(times[1:])
