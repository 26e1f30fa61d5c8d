"""A Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``), for
harnesses that kill whole nodes (``bench.chaos --nodes``): the head runs the router
and no worker; each worker node has room for one worker of each pool."""

from __future__ import annotations

import copy
import logging
import math

from splitserve.cluster.app import RAY_SYSTEM_CONFIG
from splitserve.cluster.config import ClusterConfig


class LocalNodes:
    """The worker nodes of a Ray cluster on this machine (``ray.cluster_utils.Cluster``),
    for node kills: ``replace`` ends a node's raylet and every process on it (no
    graceful exit, as when a machine fails) and adds a fresh node of the same shape, as
    Ray's autoscaler would."""

    def __init__(self, cluster, count: int, **node_args):
        self.cluster, self.node_args = cluster, node_args
        self.nodes = [add_node(cluster, node_args) for _ in range(count)]
        cluster.wait_for_nodes()

    def ids(self) -> list[str]:
        return [n.node_id for n in self.nodes]

    def replace(self, node_id: str) -> None:
        node = next(n for n in self.nodes if n.node_id == node_id)
        self.nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.append(add_node(self.cluster, self.node_args))


# Ray gives a starting node 30 s (fixed in ray._private.node) to register with the GCS; a
# 2-core machine still ending the processes of the Ray instance before it can miss that
# (seen once in CI, for the head).
_START_TRIES = 3


def add_node(cluster, node_args: dict):
    """``cluster.add_node(**node_args)`` (the head when the cluster has none), started
    again, up to ``_START_TRIES`` times, where Ray gave up waiting for the node to
    register: the half-started node's processes are ended first. Ray adds to the
    arguments' dicts, so each try gets a copy."""
    for attempt in range(1, _START_TRIES + 1):
        try:
            return cluster.add_node(**copy.deepcopy(node_args))
        except Exception as e:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == _START_TRIES:
                raise
            _end_half_started(e)
            log = logging.getLogger(__name__)
            log.warning("a Ray node did not register in time (try %d); starting it again", attempt)
    raise AssertionError("unreachable")


def _end_half_started(error: BaseException) -> None:
    """End the processes of the node whose start raised ``error``: Ray's ``Node`` raises
    from its own ``__init__``, so the half-built node is that frame's ``self``."""
    from ray._private.node import Node

    tb = error.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            node.kill_all_processes(check_alive=False, allow_graceful=False)
            return
        tb = tb.tb_next


def actor_node(handle) -> str:
    """The id of the node ``handle``'s actor runs on now, from Ray's GCS ('' if none)."""
    from ray._private import state

    return state.actors(handle._actor_id.hex()).get("Address", {}).get("NodeID", "") or ""


def local_nodes(count: int, config: ClusterConfig) -> tuple[LocalNodes, ClusterConfig]:
    """A Ray cluster on this machine for ``config``, and ``config`` pointed at it: a head
    that runs no worker (the router's node), and ``count`` worker nodes, each with room
    for one worker of each pool (so that with one node lost, the others still hold every
    pool)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=False)
    add_node(cluster, {"num_cpus": 0, "_system_config": RAY_SYSTEM_CONFIG})  # the head
    cpus = math.ceil(sum(p.num_cpus * p.ranks for p in config.pools().values()))  # Ray: whole CPUs
    ray_spec = config.ray.model_copy(update={"address": cluster.address})
    return LocalNodes(cluster, count, num_cpus=cpus), config.model_copy(update={"ray": ray_spec})
