"""The chaos harness (``splitserve.bench.chaos``) at CI size: a cluster of two
TP=2 prefill groups and two decode workers under continuous concurrent load
while prefill workers, decode workers and TP ranks are killed; every completed
output must equal the monolithic engine's greedy tokens, no call may hang, and
no KV may stay held. The same on three Ray nodes on localhost, killing whole
nodes (each followed by a fresh node, as Ray's autoscaler would add). The large
runs (100+ kills) are the same harness by hand:
``python -m splitserve.bench.chaos --kills 100 [--nodes 3]``."""

from __future__ import annotations

import os

import ray

from splitserve.bench.chaos import ChaosSpec, chaos_config, mixed_prompts, run_chaos
from splitserve.bench.local_nodes import local_nodes
from splitserve.cluster.app import BackgroundCluster
from splitserve.engine import Engine
from tests.integration.cluster_util import VOCAB, live_cluster

KILLS = int(os.environ.get("SPLITSERVE_CHAOS_KILLS", "9"))
NODE_KILLS = int(os.environ.get("SPLITSERVE_CHAOS_NODE_KILLS", "3"))


def test_kills_under_load_lose_no_request_and_corrupt_no_output(checkpoint):
    config = chaos_config(checkpoint, prefill=2, decode=2, tp=2)
    prompts, params = mixed_prompts(24, VOCAB, seed=1, max_len=200)
    reference = [c.token_ids for c in Engine(config.engine_config("decode")).generate(prompts, params)]
    with live_cluster(config) as cluster:
        report = run_chaos(cluster, prompts, params, reference, ChaosSpec(kills=KILLS, gap_s=1.5, clients=6))
    print(report.summary())
    assert len(report.kills) == KILLS
    assert {k.kind for k in report.kills} == {"prefill", "decode", "tp_rank"}
    assert report.problems() == []
    # the prefill groups never restart (a TP group cannot): each killed one was replaced
    assert report.replaced["prefill"] == sum(k.kind != "decode" for k in report.kills)
    assert len(report.outcomes) > 2 * KILLS


def test_node_kills_under_load_lose_no_request_and_corrupt_no_output(checkpoint):
    nodes, config = local_nodes(3, chaos_config(checkpoint, prefill=2, decode=2, tp=2))
    prompts, params = mixed_prompts(24, VOCAB, seed=2, max_len=200)
    reference = [c.token_ids for c in Engine(config.engine_config("decode")).generate(prompts, params)]
    spec = ChaosSpec(kills=NODE_KILLS, gap_s=1.5, clients=6, kinds=("node",))
    ray.init(address=nodes.cluster.address, log_to_driver=False)
    try:
        with BackgroundCluster(config) as cluster:
            report = run_chaos(cluster, prompts, params, reference, spec, nodes=nodes)
    finally:
        ray.shutdown()
        nodes.cluster.shutdown()
    print(report.summary())
    assert [k.kind for k in report.kills] == ["node"] * NODE_KILLS
    assert report.problems() == []
    assert len({k.node for k in report.kills}) == NODE_KILLS  # a fresh node each time
    # every TP group on a killed node was replaced (Ray restarts no TP group)
    assert report.replaced["prefill"] == sum(w.startswith("prefill") for k in report.kills for w in k.workers)
    assert len(report.outcomes) > 2 * NODE_KILLS
