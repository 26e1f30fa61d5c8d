"""A serving cluster: Ray, the worker pools and the router, started and
stopped together.

``ServingCluster`` runs on an asyncio loop (``splitserve serve`` runs it on
the main thread); ``BackgroundCluster`` runs one on a thread of its own, for
tests and benchmarks that want a live server next to their own code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import ray
import yaml

from splitserve.cluster import router_parts as parts
from splitserve.cluster.autoscale import Autoscaler
from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.lora_admin import LoRAAdmin
from splitserve.cluster.planner import Planner
from splitserve.cluster.pools import START_TIMEOUT_S, WorkerPool
from splitserve.cluster.replicas import Ports, Replicas, reachable, share
from splitserve.cluster.role_switch import RoleLedger, switch_role
from splitserve.cluster.room import WorkerNeed, free_per_node
from splitserve.cluster.slo_autoscale import PlannerLoop
from splitserve.cluster.upgrade import PoolView, UpgradeReport, Way, plan_upgrade, rolling_upgrade
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.loader import load_hf_config, resolve_source
from splitserve.engine.model.parallel_fit import check_ep_compatible, check_tp_compatible
from splitserve.router.auth import ApiKeys
from splitserve.router.dispatch import Dispatcher
from splitserve.router.metrics import PoolSize, RouterMetrics
from splitserve.router.metrics_server import MetricsServer
from splitserve.router.openai.server import OpenAIServer
from splitserve.router.otel import OtelSink, otlp_exporter
from splitserve.router.registry import WorkerRegistry
from splitserve.router.roles import Role
from splitserve.router.server import RouterServer
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.routers import RouterInfo

log = logging.getLogger(__name__)


# Ray system settings for every local instance splitserve starts (`ray up` YAMLs pass
# the same to `ray start --head --system-config`). A call to an actor that died waits
# this long for the reason of its death before it fails; Ray's 1 s default was most of
# the pause a stream sees when its decode worker dies (1.7 s, 0.25 s with 100 ms). The
# reason only changes the error's message: the router treats every such error alike.
RAY_SYSTEM_CONFIG = {"timeout_ms_task_wait_for_death_info": 100}


def start_local_ray(num_cpus: int | None = None, **kwargs) -> None:
    """Start a new local Ray instance of this process's own (never one the machine
    already runs) with ``RAY_SYSTEM_CONFIG``; ``kwargs`` go to ``ray.init``.

    Ray's own startup is tried twice: right after another local instance stopped (a
    test module's, a bench's), a new head's raylet sometimes did not register with its
    GCS within Ray's 30 s ("The current node timed out during startup"); started again,
    it does."""
    kwargs.setdefault("include_dashboard", False)
    for attempt in (1, 2):
        system_config = dict(RAY_SYSTEM_CONFIG)  # a copy: Ray adds its own keys to the dict it is given
        try:
            ray.init(address="local", num_cpus=num_cpus, _system_config=system_config, **kwargs)
            return
        except Exception as e:
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            log.warning("Ray did not start (%s); starting it again", e)
            ray.shutdown()


def connect_ray(config: ClusterConfig) -> bool:
    """Attach to Ray (an address in the config, or one this process already
    joined) or start a local instance, never an existing cluster that was not
    asked for. Returns True if this call started it; raises ``RuntimeError``
    with a sentence when a local instance cannot start."""
    if ray.is_initialized():
        return False
    if config.ray.address:
        ray.init(address=config.ray.address, logging_level=logging.WARNING)
        return False
    needed = sum(p.replicas * p.num_cpus * p.ranks for p in config.pools().values())
    num_cpus = config.ray.num_cpus or max(os.cpu_count() or 1, int(needed + 0.999))
    # "local": a new instance of our own, whatever the machine has seen. Without it Ray
    # joins the cluster named in RAY_ADDRESS or in the session file a `ray start` left
    # behind (ray_current_cluster), even a dead one, and fails with its own message.
    try:
        start_local_ray(num_cpus, logging_level=logging.WARNING)
    except Exception as e:
        raise RuntimeError(
            f"could not start a local Ray instance ({type(e).__name__}: {e}); to use a running "
            "cluster instead, pass --address auto or its address"
        ) from e
    return True


def check_model_fits_pools(config: ClusterConfig, model: ModelConfig) -> None:
    """Refuse, before any worker starts, a ``tp_size`` the model's heads do not split over
    and an ``ep_size`` its experts do not."""
    for role, pool in config.pools().items():
        try:
            check_tp_compatible(model, pool.tp_size)
        except ValueError as e:
            raise ValueError(f"{role}.tp_size does not fit the model {config.model.name}: {e}") from None
        try:
            check_ep_compatible(model, pool.ep_size, pool.engine.kv_cache_dtype)
        except ValueError as e:
            raise ValueError(f"{role}.ep_size does not fit the model {config.model.name}: {e}") from None


UPGRADE_DRAIN_TIMEOUT_S = 120.0  # an old worker's requests finish within it (without autoscaling)


class ServingCluster:
    def __init__(self, config: ClusterConfig, progress: Callable[[str], None] = log.info):
        self.config = config
        self.progress = progress
        self.registry = WorkerRegistry()
        self.pools: dict[str, WorkerPool] = {}
        self.server: RouterServer | None = None
        self.http: OpenAIServer | None = None
        self.metrics: RouterMetrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.otel: OtelSink | None = None
        self.api_keys: ApiKeys | None = None
        self.autoscalers: dict[str, Autoscaler] = {}
        self.planner: PlannerLoop | None = None
        self.roles: RoleLedger | None = None  # elastic mode: role switches and time per role
        self.replicas: Replicas | None = None  # router.replicas > 1: the other routers on this node
        self._tasks: list[asyncio.Task] = []
        self._started_ray = False
        self._upgrading = asyncio.Lock()  # one rolling upgrade at a time

    @property
    def address(self) -> str:
        return self.server.address if self.server else ""

    @property
    def http_address(self) -> str:
        return f"{self.http.host}:{self.http.port}" if self.http else ""

    async def start(self) -> str:
        """Start everything; returns the router's ``host:port`` once it serves."""
        cfg = self.config
        if cfg.router.api_keys_file is not None:  # a bad keys file fails the start before Ray
            self.api_keys = ApiKeys(cfg.router.api_keys_file)
        self._started_ray = connect_ray(cfg)
        try:
            if not cfg.ray.address:  # one machine: convert a GGUF once here, not in every worker
                source = await asyncio.to_thread(resolve_source, cfg.model.name)
                check_model_fits_pools(cfg, ModelConfig.from_hf(load_hf_config(source)))
            for role, spec in cfg.pools().items():
                self.pools[role] = WorkerPool(role, cfg, self.registry)
                self.progress(f"starting {spec.replicas} {role} worker(s), loading {cfg.model.name} ...")
            ticker = asyncio.create_task(self._tick_progress())
            try:
                refs = await asyncio.gather(*(p.add(p.spec.replicas) for p in self.pools.values()))
            finally:
                ticker.cancel()
            for role, workers in zip(self.pools, refs):
                for engine in sorted({w.info.engine for w in workers}):
                    self.progress(f"{role} engine: {engine}")
            validator = min((w.info.validator for ws in refs for w in ws), key=lambda v: v.max_kv_tokens)
            if cfg.router.chat_template is not None:
                template = Path(cfg.router.chat_template).read_text()
                validator = dataclasses.replace(validator, chat_template=template)
            limits = share(cfg.limits, cfg.router.replicas)  # this router's part of them
            dispatcher = parts.dispatcher(cfg, self.registry, validator, limits)
            for pool in self.pools.values():  # scale-in moves a decode worker's requests off
                pool.move_off = dispatcher.moves.move_off
            self.metrics = parts.metrics(cfg, self.registry, dispatcher, self._pool_sizes)
            if cfg.mode == "elastic":
                self.roles = RoleLedger(self.registry)
                self.metrics.prom.register(self.roles)
            if cfg.router.otel_endpoint:
                self.otel = OtelSink(
                    otlp_exporter(cfg.router.otel_endpoint),
                    cfg.router.otel_service_name,
                    transfer_backend=cfg.transfer.backend,
                )
                dispatcher.sinks.append(self.otel)
            r = cfg.router
            self.server = RouterServer(
                dispatcher,
                cfg.mode,
                r.host,
                r.port,
                credentials=parts.grpc_credentials(cfg),
                api_keys=self.api_keys,
                routers=self.routers,
                upgrade=self.upgrade,
                relief=r.kv_relief.relief() if r.kv_relief is not None else None,
            )
            await self.server.start()
            if self.api_keys is not None:
                self._tasks.append(asyncio.create_task(self.api_keys.watch()))
            for role, pool in self.pools.items():
                self._tasks.append(asyncio.create_task(pool.keep()))  # replaces workers Ray gave up
                if pool.spec.autoscaling is not None and pool.spec.autoscaling.policy == "proportional":
                    scaler = Autoscaler(pool, pool.spec.autoscaling)
                    self.autoscalers[role] = scaler
                    self._tasks.append(asyncio.create_task(scaler.run()))
            if any(
                p.spec.autoscaling is not None and p.spec.autoscaling.policy == "slo"
                for p in self.pools.values()
            ):
                self.planner = PlannerLoop(  # elastic: a fixed set of workers, whose roles it splits
                    Planner(cfg.planner),
                    self.pools,
                    lambda: dispatcher.admitted,
                    self.metrics.prom,
                    switch=self.switch_role if cfg.mode == "elastic" else None,
                    admitted_prompt_tokens=lambda: dispatcher.admitted_prompt_tokens,
                )
                dispatcher.sinks.append(self.planner.window)
                self._tasks.append(asyncio.create_task(self.planner.run()))
                self.progress(
                    f"SLO planner on: TTFT {cfg.planner.ttft_ms:g} ms, TPOT {cfg.planner.tpot_ms:g} ms"
                )
            lora = None  # runtime LoRA changes: through the HTTP door
            if r.http_port is not None:
                lora = LoRAAdmin(
                    self._pool_config, self._reconfigure, self.registry, dispatcher, self._upgrading
                )
                if cfg.model.enable_lora:
                    self._tasks.append(asyncio.create_task(lora.keep()))
                self.http = parts.http_server(
                    cfg, dispatcher, self.metrics, self.api_keys, r.http_port, r.replicas > 1, lora
                )
                await self.http.start()
            if r.metrics_port is not None:
                self.metrics_server = MetricsServer(self.metrics, r.host, r.metrics_port)
                await self.metrics_server.start()
            if r.replicas > 1 or (r.node_resource is not None and cfg.ray.address):
                ports = Ports(self.server.port, self.http.port if self.http is not None else None)
                self.replicas = Replicas(cfg, self.registry, validator, ports, dispatcher, lora)
                await self.replicas.start()
                for info in await self.replicas.infos():
                    here = info.node_id == self.replicas.node_id
                    where = "on this node" if here else f"on node {info.node_id[:12]}"
                    self.progress(f"router {info.index} {where}: {info.address}")
                self._tasks.append(asyncio.create_task(self.replicas.keep()))
        except BaseException:
            await self.stop()
            raise
        scheme = "https" if r.tls_cert else "http"
        http = f", OpenAI-compatible HTTP on {scheme}://{self.http_address}/v1" if self.http else ""
        if self.metrics_server is not None:
            http += f", metrics on http://{r.host}:{self.metrics_server.port}/metrics"
        elif self.http is not None:
            http += " (metrics at /metrics)"
        self.progress(f"serving {cfg.model.public_name} ({cfg.mode}) on {self.address} (gRPC){http}")
        return self.address

    def _pool_config(self) -> ClusterConfig:
        """The config the pools start workers from now (an upgrade's, runtime LoRA loads)."""
        return next(iter(self.pools.values())).config

    def _reconfigure(self, config: ClusterConfig) -> None:
        for pool in self.pools.values():
            pool.reconfigure(config)

    async def routers(self) -> list[RouterInfo]:
        """Every router of the cluster: this one (index 0), then its replicas and node routers."""
        d = self.server.dispatcher
        me = RouterInfo(
            index=0,
            node_id=ray.get_runtime_context().get_node_id(),
            address=reachable(self.server.host, self.server.port),
            http_address=reachable(self.http.host, self.http.port) if self.http is not None else "",
            inflight=d.num_inflight,
            admitted=d.admitted,
            max_inflight=d.limits.max_inflight_requests,
        )
        return [me, *(await self.replicas.infos() if self.replicas is not None else [])]

    async def upgrade(self, config_yaml: str = "", model: str = "", pace: int = 1) -> UpgradeReport:
        """A rolling upgrade (``cluster.upgrade``) to the config ``config_yaml`` (YAML; empty:
        the running one) with its model replaced by ``model`` (if given). One at a time:
        ``InvalidRequest`` while another runs, or for a config that does not fit. The LoRA
        adapters served now (loaded at run time too) are kept unless the YAML names
        ``model.lora_modules``: those not named are served no more from its start, those
        named are served once it is done."""
        if self._upgrading.locked():
            raise InvalidRequest("an upgrade (or a LoRA adapter's load or unload) is running")
        try:
            config = self._pool_config()
            if config_yaml:
                config = ClusterConfig.model_validate(yaml.safe_load(config_yaml))
                if "lora_modules" not in config.model.model_fields_set:
                    kept = {"lora_modules": self._pool_config().model.lora_modules}
                    config = config.model_copy(update={"model": config.model.model_copy(update=kept)})
            if model:
                config = config.model_copy(update={"model": config.model.model_copy(update={"name": model})})
            if config.mode != self.config.mode:
                raise ValueError(f"an upgrade keeps the mode ({self.config.mode}), not {config.mode}")
        except (ValueError, yaml.YAMLError) as e:
            raise InvalidRequest(f"the upgrade's config: {e}") from None
        async with self._upgrading:
            if pace < 1:
                raise InvalidRequest(f"pace must be at least 1 worker at a time, not {pace}")
            way = await self._upgrade_way(config, pace)
            scaling = [p.spec.autoscaling for p in self.pools.values() if p.spec.autoscaling is not None]
            timeout = max((a.drain_timeout_s for a in scaling), default=UPGRADE_DRAIN_TIMEOUT_S)
            d, named = self.server.dispatcher, tuple(config.model.lora_modules)
            d.adapters = tuple(a for a in d.adapters if a in named)
            report = await rolling_upgrade(self.pools, config, pace, timeout, self.progress, way)
            d.adapters = named if config.model.enable_lora else ()
            return report

    async def _upgrade_way(self, config: ClusterConfig, pace: int) -> Way:
        """How an upgrade to ``config`` runs with the room Ray has now (``plan_upgrade``;
        ``PreconditionFailed`` when it cannot). Room is known on a Ray instance of its own
        (no ``ray.address``); a cluster attached by address may have an autoscaler."""
        new_pools = config.pools()
        views = [
            PoolView(
                role,
                [(w.worker_id, w.node.node_id if w.node else "") for w in pool.workers],
                WorkerNeed.of(role, pool.spec),
                WorkerNeed.of(role, new_pools[role]) if role in new_pools else WorkerNeed.of(role, pool.spec),
                may_be_empty=role == Role.PREFILL,
            )
            for role, pool in self.pools.items()
        ]
        free = await asyncio.to_thread(free_per_node)
        return plan_upgrade(views, pace, free, room_known=not self.config.ray.address)

    async def switch_role(self, worker_id: str, role: Role) -> float:
        """Elastic mode: worker ``worker_id`` takes ``role`` (``cluster.role_switch``): its
        old role's work drains (a decode worker's requests move off with their KV), then
        it serves the new one, its engine as it was. Returns the seconds it took. Raises
        ``InvalidRequest`` outside elastic mode, for an unknown worker or the last decode
        worker (the prefill role may have none: decode workers prefill), ``TimeoutError``
        (it stays in its old role) if its old role's work did not end in time."""
        if self.config.mode != "elastic":
            raise InvalidRequest("workers switch role only in elastic mode")
        source = next((p for p in self.pools.values() if p.has(worker_id)), None)
        if source is None:
            raise InvalidRequest(f"no worker {worker_id}")
        target = self.pools[Role(role)]
        decoding = [w.worker_id for w in self.registry.routable(Role.DECODE)]
        if Role(role) == Role.PREFILL and decoding == [worker_id]:
            raise InvalidRequest(f"{worker_id} is the last decode worker: a cluster cannot serve without one")
        old = self.registry.get(worker_id).client
        self.roles.observe()  # its time so far is its old role's
        timeout = (target.spec.autoscaling or source.spec.autoscaling).drain_timeout_s
        took = await switch_role(
            self.registry,
            worker_id,
            Role(role),
            target.client(source.actors(worker_id)[0]),
            self.server.dispatcher.moves.move_off,
            timeout,
        )
        target.adopt(source.release(worker_id))
        self.roles.switched(role)
        await old.close()  # a decode worker's token stream to this router
        self.progress(f"{worker_id} is a {role} worker now ({took:.2f} s)")
        return took

    def reload_api_keys(self) -> None:
        """Read ``router.api_keys_file`` again now (SIGHUP), if there is one."""
        if self.api_keys is not None:
            self.api_keys.reload()

    def _pool_sizes(self) -> list[PoolSize]:
        """Each pool's desired size (its autoscaler's or the planner's last wish, else its
        configured size) and how many of its workers were replaced."""
        sizes = []
        for role, pool in self.pools.items():
            desired = pool.spec.replicas
            if role in self.autoscalers:
                desired = self.autoscalers[role].desired
            elif self.planner is not None and self.planner.desired(role) is not None:
                desired = self.planner.desired(role)
            sizes.append(PoolSize(role, desired, pool.replaced, pool.engine_failures))
        return sizes

    async def _tick_progress(self, every_s: float = 10.0) -> None:
        start = time.monotonic()
        while True:
            await asyncio.sleep(every_s)
            self.progress(
                f"still loading the model ({time.monotonic() - start:.0f} s; a first start on a machine "
                "compiles the CPU kernels once)"
            )

    async def stop(self) -> None:
        """Drain the router, stop the workers, and Ray if this cluster started it."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.replicas is not None:
            await self.replicas.stop()
            self.replicas = None
        if self.http is not None:
            await self.http.stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self.server is not None:
            await self.server.stop(self.config.router.shutdown_grace_s)
        if self.otel is not None:
            await asyncio.to_thread(self.otel.shutdown)  # flushes what is queued
            self.otel = None
        await asyncio.gather(*(w.client.close() for w in self.registry.workers()), return_exceptions=True)
        for pool in self.pools.values():
            pool.shutdown()
        self.pools.clear()
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


class BackgroundCluster:
    """A ``ServingCluster`` on its own thread and event loop::

    with BackgroundCluster(config) as c:
        Client(c.address).generate(...)
    """

    def __init__(self, config: ClusterConfig, start_timeout_s: float = START_TIMEOUT_S):
        self.cluster = ServingCluster(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="splitserve-router", daemon=True)
        self._thread.start()
        try:
            self.address = self.run(self.cluster.start(), start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def run(self, coro, timeout: float | None = None):
        """Run a coroutine on the cluster's loop (e.g. one reading the dispatcher)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def http_address(self) -> str:
        return self.cluster.http_address

    @property
    def dispatcher(self) -> Dispatcher:
        return self.cluster.server.dispatcher

    @property
    def registry(self) -> WorkerRegistry:
        return self.cluster.registry

    def stop(self) -> None:
        if self._loop.is_running():
            self.run(self.cluster.stop(), 120)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> BackgroundCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
