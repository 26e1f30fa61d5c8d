"""Room on the Ray cluster for new workers, judged before an operation starts them.

A worker is a placement group of ``ranks`` equal bundles packed on one node
(``STRICT_PACK``: a TP group's ranks meet on one machine), each bundle its
pool's ``{CPU, GPU, custom resources}`` (``bundle``, the one place that says
what a worker asks Ray for). ``fits`` places workers on the nodes' free
resources first-fit, largest first: a plain rule that can only say "no" where
Ray could not place them either, since Ray places bundles on what is free, as
here. ``free_per_node`` reads what Ray has free now on each alive node.

Whether Ray could make room (its autoscaler adding a node) is not known here;
the caller decides whether to trust a "no" (``cluster.upgrade``).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.cluster.config import PoolSpec

Resources = dict[str, float]

_EPS = 1e-9  # Ray keeps fractional resources in 1/10000 units


def bundle(spec: PoolSpec) -> Resources:
    """One rank's bundle of a worker of ``spec``'s pool."""
    return {"CPU": spec.num_cpus} | ({"GPU": spec.num_gpus} if spec.num_gpus else {}) | dict(spec.resources)


@dataclass(frozen=True)
class WorkerNeed:
    """What one worker asks Ray for: ``ranks`` x ``bundle``, on one node."""

    role: str
    ranks: int
    bundle: tuple[tuple[str, float], ...]  # sorted (resource, amount) pairs

    @classmethod
    def of(cls, role: str, spec: PoolSpec) -> WorkerNeed:
        return cls(str(role), spec.ranks, tuple(sorted(bundle(spec).items())))

    def total(self) -> Resources:
        return {k: v * self.ranks for k, v in self.bundle}

    def __str__(self) -> str:
        inner = ", ".join(f"{k}: {v:g}" for k, v in self.bundle)
        return f"{self.ranks} x {{{inner}}}"


def fits(needs: list[WorkerNeed], free: dict[str, Resources]) -> bool:
    """Whether every worker of ``needs`` can be placed, each whole on one node, on the
    ``free`` resources of the nodes (node id -> resources), largest worker first."""
    left = {node: dict(res) for node, res in free.items()}
    for need in sorted(needs, key=lambda n: -sum(n.total().values())):
        want = need.total()
        node = next((n for n, res in left.items() if _covers(res, want)), None)
        if node is None:
            return False
        for k, v in want.items():
            left[node][k] = left[node].get(k, 0.0) - v
    return True


def with_freed(free: dict[str, Resources], freed: list[tuple[str, WorkerNeed]]) -> dict[str, Resources]:
    """``free`` after the workers in ``freed`` ((node id, their need)) have gone."""
    out = {node: dict(res) for node, res in free.items()}
    for node, need in freed:
        res = out.setdefault(node, {})
        for k, v in need.total().items():
            res[k] = res.get(k, 0.0) + v
    return out


def describe_free(free: dict[str, Resources], keys: set[str]) -> str:
    """The nodes' free ``keys``, in words: "node 1a2b3c: CPU 0"."""
    if not free:
        return "no alive node"
    parts = []
    for node, res in free.items():
        amounts = ", ".join(f"{k} {res.get(k, 0.0):g}" for k in sorted(keys))
        parts.append(f"node {node[:8]}: {amounts}")
    return "; ".join(parts)


def free_per_node() -> dict[str, Resources]:
    """What Ray has free now on each alive node (its GCS's account)."""
    import ray
    from ray._private import state

    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    per_node = state.state.available_resources_per_node()
    return {node: dict(res) for node, res in per_node.items() if node in alive}


def _covers(have: Resources, want: Resources) -> bool:
    return all(have.get(k, 0.0) + _EPS >= v for k, v in want.items())
