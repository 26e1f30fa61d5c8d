"""What one router says about itself: the primary (``splitserve serve``) asks each of
its replicas and node routers (``cluster.replicas``) and reports them all in
``ClusterStatus``. Plain data (a replica returns it over Ray)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterInfo:
    index: int  # 0: splitserve serve itself; 1 and up: its replicas, then its node routers
    node_id: str  # the Ray node it runs on
    address: str  # its gRPC host:port ("" until it listens)
    http_address: str  # its OpenAI HTTP host:port ("" without one)
    inflight: int  # requests it holds now
    admitted: int  # requests it admitted since it started
    max_inflight: int  # its share of limits.max_inflight_requests
    alive: bool = True  # False: it did not answer (the primary is replacing it)
