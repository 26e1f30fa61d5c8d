"""The chaos harness (``splitserve.bench.chaos``) at CI size: a cluster of two
TP=2 prefill groups and two decode workers under continuous concurrent load
while prefill workers, decode workers and TP ranks are killed; every completed
output must equal the monolithic engine's greedy tokens, at least 99 % must
complete (the rest fail with UNAVAILABLE or DEADLINE_EXCEEDED and a sentence, or
INTERNAL for a request whose router trace places it on each of two workers when a
kill took that worker down), no call may hang, and no KV may stay held. The same
on three Ray nodes on localhost, killing whole nodes (each followed by a fresh node,
as Ray's autoscaler would add). The large runs (100+ kills) are the same harness by
hand:
``python -m splitserve.bench.chaos --kills 100 [--nodes 3]``."""

from __future__ import annotations

import os

import ray

from splitserve.bench.chaos import ChaosSpec, chaos_config, mixed_prompts, run_chaos
from splitserve.bench.local_nodes import local_nodes
from splitserve.cluster.app import BackgroundCluster
from splitserve.cluster.pools import actor_state
from splitserve.engine.engine import Engine
from splitserve.router.registry import NodePlacement
from tests.integration.cluster_util import VOCAB, live_cluster, own_ray, wait_until

# 3 in CI (each kind once: the kinds come in turn; 6 until the suite neared 20 minutes; node
# kills 2, 3 until session 24); more
# by hand: SPLITSERVE_CHAOS_KILLS, or python -m splitserve.bench.chaos --kills 100
KILLS = int(os.environ.get("SPLITSERVE_CHAOS_KILLS", "3"))
NODE_KILLS = int(os.environ.get("SPLITSERVE_CHAOS_NODE_KILLS", "2"))


def test_kills_under_load_complete_99_percent_and_corrupt_no_output(checkpoint):
    config = chaos_config(checkpoint, prefill=2, decode=2, tp=2)
    prompts, params = mixed_prompts(24, VOCAB, seed=1, max_len=200)
    reference = [c.token_ids for c in Engine(config.engine_config("decode")).generate(prompts, params)]
    with live_cluster(config) as cluster:
        report = run_chaos(cluster, prompts, params, reference, ChaosSpec(kills=KILLS, gap_s=1.5, clients=6))
    print(report.summary())
    assert report.problems() == []
    assert len(report.kills) == KILLS
    assert {k.kind for k in report.kills} == {"prefill", "decode", "tp_rank"}
    assert all(o.request_id in report.traces for o in report.outcomes if o.code == "OK")  # the harness's sink
    # the prefill groups never restart (a TP group cannot): each killed one was replaced
    assert report.replaced["prefill"] == sum(k.kind != "decode" for k in report.kills)
    assert len(report.outcomes) > 2 * KILLS


def test_node_kills_under_load_complete_99_percent_and_corrupt_no_output(checkpoint):
    own_ray()  # several nodes of its own
    nodes, config = local_nodes(3, chaos_config(checkpoint, prefill=2, decode=2, tp=2))
    prompts, params = mixed_prompts(24, VOCAB, seed=2, max_len=200)
    reference = [c.token_ids for c in Engine(config.engine_config("decode")).generate(prompts, params)]
    spec = ChaosSpec(kills=NODE_KILLS, gap_s=1.5, clients=6, kinds=("node",))
    ray.init(address=nodes.cluster.address, log_to_driver=False)
    try:
        with BackgroundCluster(config) as cluster:
            report = run_chaos(cluster, prompts, params, reference, spec, nodes=nodes)
            print(report.summary())
            # a decode worker on a killed node was restarted by Ray on another node, and
            # the registry (status, metrics) says where it is now
            moved = {w for k in report.kills for w in k.workers if w.startswith("decode")}
            moved &= set(cluster.run(_registered(cluster), timeout=60))  # not replaced meanwhile
            wait_until(
                lambda: _nodes(cluster, moved) == _nodes_in_ray(cluster, moved),
                "the registry did not follow the decode workers Ray restarted on other nodes",
            )
    finally:
        ray.shutdown()
        nodes.cluster.shutdown()
    assert report.problems() == []
    assert [k.kind for k in report.kills] == ["node"] * NODE_KILLS
    assert len({k.node for k in report.kills}) == NODE_KILLS  # a fresh node each time
    # every TP group on a killed node was replaced (Ray restarts no TP group)
    assert report.replaced["prefill"] == sum(w.startswith("prefill") for k in report.kills for w in k.workers)
    assert len(report.outcomes) > 2 * NODE_KILLS
    assert moved, "no kill took a decode worker down: nothing was restarted elsewhere"


async def _registered(cluster: BackgroundCluster) -> list[str]:
    return [w.worker_id for w in cluster.registry.workers("decode")]


def _nodes(cluster: BackgroundCluster, worker_ids: set[str]) -> dict[str, str]:
    """Where the router's registry says each worker runs."""

    async def read() -> dict[str, str]:
        return {w: (cluster.registry.get(w).node or NodePlacement("", "")).node_id for w in worker_ids}

    return cluster.run(read(), timeout=60)


def _nodes_in_ray(cluster: BackgroundCluster, worker_ids: set[str]) -> dict[str, str]:
    """Where Ray's GCS says each worker's actor runs."""
    pool = cluster.cluster.pools["decode"]
    return {w: actor_state(pool.actors(w)[0]).node_id for w in worker_ids}
