"""A Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``), for
harnesses that kill whole nodes (``bench.chaos --nodes``): the head runs the router
and no worker; each worker node has room for one worker of each pool."""

from __future__ import annotations

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
        self.nodes = [cluster.add_node(**node_args) for _ in range(count)]
        cluster.wait_for_nodes()

    def ids(self) -> list[str]:
        return [n.node_id for n in self.nodes]

    def replace(self, node_id: str) -> None:
        node = next(n for n in self.nodes if n.node_id == node_id)
        self.nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.append(self.cluster.add_node(**self.node_args))


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

    head = {"num_cpus": 0, "_system_config": dict(RAY_SYSTEM_CONFIG)}  # a copy: Ray adds to it
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cpus = math.ceil(sum(p.num_cpus * p.ranks for p in config.pools().values()))  # Ray: whole CPUs
    ray_spec = config.ray.model_copy(update={"address": cluster.address})
    return LocalNodes(cluster, count, num_cpus=cpus), config.model_copy(update={"ray": ray_spec})
