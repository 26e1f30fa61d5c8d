"""The parts of one router, built from the config the same way in ``splitserve serve``
(``cluster.app``) and in each router replica (``cluster.replicas``): its dispatcher,
its metrics, its HTTP server and its gRPC credentials."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc

from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.lora_admin import LoRAAdmin
from splitserve.router.auth import ApiKeys
from splitserve.router.dispatch import Dispatcher
from splitserve.router.metrics import PoolSize, RouterMetrics
from splitserve.router.openai.server import OpenAIServer, server_ssl_context
from splitserve.router.policy import LimitsSpec, PolicySpec
from splitserve.router.registry import WorkerRegistry
from splitserve.wire.validation import RequestValidator


def dispatcher(
    config: ClusterConfig, registry: WorkerRegistry, validator: RequestValidator, limits: LimitsSpec
) -> Dispatcher:
    """A dispatcher over ``registry`` admitting within ``limits`` (this router's share)."""
    return Dispatcher(
        registry,
        validator,
        config.model.public_name,
        colocated=config.mode == "colocated",
        limits=limits,
        policy=routing_policy(config),
        traces_kept=config.router.traces_kept,
        on_transfer_failure=config.transfer.on_failure,
        adapters=tuple(config.model.lora_modules),
    )


def routing_policy(config: ClusterConfig) -> PolicySpec:
    """The config's routing policy, its stall budget held to the TPOT target this router
    knows (``PolicySpec.stall_tpot_ms``: the config's own, else the SLO planner's, else
    admission's) where one is set."""
    policy = config.policy
    if policy.stall_tpot_ms is None:
        known = [t for t in (config.planner and config.planner.tpot_ms, config.limits.decode_tpot_ms) if t]
        if known:
            policy = policy.model_copy(update={"stall_tpot_ms": known[0]})
    return policy


def metrics(
    config: ClusterConfig,
    registry: WorkerRegistry,
    d: Dispatcher,
    pool_sizes: Callable[[], list[PoolSize]],
    replica: int = 0,
    workers: bool = True,
) -> RouterMetrics:
    """The router's ``/metrics``, fed by ``d`` (added to its sinks); every series labelled
    ``replica``, the workers' and pools' only where ``workers`` (the primary's)."""
    out = RouterMetrics(
        config.model.public_name,
        registry,
        pool_sizes,
        lambda: d.num_inflight,
        lambda: {(p.value, why.value): n for (p, why), n in d.decider.counts.items()},
        lambda: dict(d.transfer_failures),
        d.batch_caps,
        replica=replica,
        workers=workers,
        moves=lambda: dict(d.moves.moved),
    )
    d.sinks.append(out)
    return out


def http_server(
    config: ClusterConfig,
    d: Dispatcher,
    m: RouterMetrics,
    api_keys: ApiKeys | None,
    port: int,
    reuse_port: bool,
    lora: LoRAAdmin | None = None,
) -> OpenAIServer:
    """The OpenAI-compatible HTTP server on ``port`` (shared with other routers on this
    machine where ``reuse_port``); ``lora``: the primary's (runtime LoRA loads)."""
    r = config.router
    return OpenAIServer(
        d,
        r.host,
        port,
        m,
        api_keys,
        server_ssl_context(r.tls_cert, r.tls_key) if r.tls_cert else None,
        ignore_unknown_fields=r.openai.ignore_unknown_fields,
        tool_parser=r.openai.tool_call_parser,
        reasoning_parser=r.openai.reasoning_parser,
        reuse_port=reuse_port,
        lora=lora,
    )


def grpc_credentials(config: ClusterConfig) -> grpc.ServerCredentials | None:
    """The gRPC port's TLS credentials from ``router.tls_cert``/``tls_key`` (None: plaintext)."""
    r = config.router
    if r.tls_cert is None:
        return None
    pair = (Path(r.tls_key).read_bytes(), Path(r.tls_cert).read_bytes())
    return grpc.ssl_server_credentials([pair])
