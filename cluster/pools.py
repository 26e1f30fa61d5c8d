"""Pools of worker actors: one per role, each worker in its own placement group
(a TP group's bundles packed on one node), restarted by Ray when it dies.

A restarted worker keeps its actor handle, so the router's ``WorkerRef`` stays
valid; its KV source comes back with a new incarnation, which decode workers
pick up from the next handshake they are sent (``KVSink.connect`` replaces
the stale link). ``remove`` drains a worker before killing it: it takes no
new requests and is killed once its in-flight ones end (or a timeout passes),
so scaling down drops nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from splitserve.cluster.config import ClusterConfig, PoolSpec
from splitserve.decode_worker import DecodeWorker, DecodeWorkerSpec
from splitserve.engine import EngineConfig
from splitserve.prefill_worker import PrefillWorker, PrefillWorkerSpec
from splitserve.router.balancer import WorkerRef
from splitserve.router.errors import unwrap

log = logging.getLogger(__name__)

MAX_RESTARTS = 3  # a worker that keeps dying (e.g. its model cannot load) stops being restarted


def engine_config(config: ClusterConfig, pool: PoolSpec) -> EngineConfig:
    m, e = config.model, pool.engine
    return EngineConfig(
        model=m.name,
        random_weights=m.random_weights,
        dtype=m.dtype,
        device=pool.device,
        block_size=e.block_size,
        kv_cache_memory_mib=e.kv_cache_memory_mib,
        max_num_batched_tokens=e.max_num_batched_tokens,
        max_num_seqs=e.max_num_seqs,
        max_model_len=m.max_model_len,
        enable_prefix_caching=e.enable_prefix_caching,
        attention_backend=e.attention_backend,
        seed=m.seed,
    )


@dataclass
class _Member:
    ref: WorkerRef
    pg: PlacementGroup


class WorkerPool:
    def __init__(self, role: str, config: ClusterConfig):
        self.role = role
        self.config = config
        self.spec: PoolSpec = config.pools()[role]
        self.members: list[_Member] = []
        self._next_index = 0

    @property
    def workers(self) -> list[WorkerRef]:
        return [m.ref for m in self.members]

    def _worker_spec(self, worker_id: str) -> PrefillWorkerSpec | DecodeWorkerSpec:
        eng = engine_config(self.config, self.spec)
        threads = self.spec.torch_threads or max(1, int(self.spec.num_cpus))
        t = self.config.transfer
        ids = self.spec.cpu_ids
        cpus = (ids[int(worker_id.rsplit("-", 1)[1]) % len(ids)],) if ids else None
        if self.role == "prefill":
            return PrefillWorkerSpec(worker_id, eng, t.backend, t.lease_s, threads, cpus)
        backend = t.backend if self.role == "decode" else None
        return DecodeWorkerSpec(worker_id, eng, backend, t.timeout_s, threads, cpus)

    async def add(self, n: int, timeout_s: float = 900.0) -> list[WorkerRef]:
        """Start ``n`` workers and wait until each has loaded its model."""
        started = [self._launch() for _ in range(n)]
        deadline = time.monotonic() + timeout_s
        try:
            for m in started:
                await self._wait_ready(m, deadline)
        except BaseException:
            for m in started:
                self._kill(m)
            raise
        self.members.extend(started)
        return [m.ref for m in started]

    async def remove(self, ref: WorkerRef, drain_timeout_s: float = 60.0) -> None:
        """Drain ``ref`` (no new requests; in-flight ones finish), then kill it."""
        member = next(m for m in self.members if m.ref is ref)
        ref.draining = True
        deadline = time.monotonic() + drain_timeout_s
        while ref.active > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.members.remove(member)
        self._kill(member)

    def shutdown(self) -> None:
        for m in self.members:
            self._kill(m)
        self.members.clear()

    # ---- internals ------------------------------------------------------------
    def _launch(self) -> _Member:
        s = self.spec
        worker_id = f"{self.role}-{self._next_index}"
        self._next_index += 1
        bundle = {"CPU": s.num_cpus} | ({"GPU": s.num_gpus} if s.num_gpus else {})
        pg = placement_group([bundle] * s.tp_size, strategy="STRICT_PACK", name=f"splitserve-{worker_id}")
        cls = PrefillWorker if self.role == "prefill" else DecodeWorker
        actor = (
            ray.remote(cls)
            .options(
                num_cpus=s.num_cpus,
                num_gpus=s.num_gpus,
                max_restarts=MAX_RESTARTS,
                max_concurrency=4096,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            )
            .remote(self._worker_spec(worker_id))
        )
        block = s.engine.block_size
        return _Member(WorkerRef(worker_id, self.role, actor, block_size=block), pg)

    async def _wait_ready(self, m: _Member, deadline: float) -> None:
        s = self.spec
        try:
            await asyncio.wait_for(m.pg.ready(), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            raise RuntimeError(
                f"Ray cannot place {m.ref.worker_id}: it needs {s.tp_size} x "
                f"{{CPU: {s.num_cpus}, GPU: {s.num_gpus}}} on one node"
            ) from None
        try:
            await asyncio.wait_for(m.ref.handle.info.remote(), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            raise RuntimeError(f"{m.ref.worker_id} did not load its model in time") from None
        except ray.exceptions.RayError as e:
            raise RuntimeError(f"{m.ref.worker_id} failed to start: {unwrap(e)}") from None
        log.info("%s is ready", m.ref.worker_id)

    def _kill(self, m: _Member) -> None:
        m.ref.alive = False
        try:
            ray.kill(m.ref.handle, no_restart=True)
        except Exception:  # already gone
            pass
        try:
            remove_placement_group(m.pg)
        except Exception:
            pass
