"""A router on every node: a real three-node Ray cluster on localhost
(``ray.cluster_utils.Cluster``), every node offering ``splitserve_router`` (one
of them 2 units). ``splitserve serve`` (router 0) runs on the node this process
joined and starts node routers on each other node, one per unit
(``router.node_resource``), each on a port of its own (the config asks for any
free one). Then:

- ``ClusterStatus`` on router 0 lists every router, as many on each node as it
  offers (router 0 alone on its own), and requests sent to each router's port
  are served by that router with the engine's tokens;
- a follow-up sent to another router than its prompt's first request finds the
  decode worker holding the prefix (that router polled the workers' prefix logs
  itself) and reuses it;
- a node router killed under load: the streams it carried end with
  ``UNAVAILABLE`` or complete (none hangs), requests sent meanwhile through the
  SDK with every router's address all complete (a request refused before its
  first token is retried on another router), no KV stays held, and the router
  comes back on its port and serves;
- a node that leaves the cluster takes its routers with it, and the other
  routers' shares of the limits grow to match.
"""

from __future__ import annotations

import collections

import pytest
import ray
from ray.cluster_utils import Cluster

from splitserve.cli.main import main
from splitserve.client import Client
from splitserve.cluster.app import BackgroundCluster
from splitserve.engine.engine import Engine
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import (
    VOCAB,
    mixed_workload,
    own_ray,
    reference_tokens,
    stream_all,
    streams_through_a_fault,
    tiny_config,
    wait_kv_free,
    wait_until,
)

UNITS = (1, 2, 1)  # splitserve_router on the head and on each other node


@pytest.fixture(scope="module")
def three_nodes():
    """A head with the workers' CPUs and two nodes with none; all three offer routers."""
    own_ray()
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"splitserve_router": UNITS[0]}}
    )
    for units in UNITS[1:]:
        cluster.add_node(num_cpus=0, resources={"splitserve_router": units})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def config(three_nodes, checkpoint):
    return tiny_config(checkpoint, "colocated", ray={"address": three_nodes.address})


@pytest.fixture(scope="module")
def serving(config):
    with BackgroundCluster(config) as c:
        yield c


def _routers(serving):
    """``ClusterStatus`` of router 0: every router, itself first."""
    with Client(serving.address, timeout=60) as c:
        return c.cluster_status().routers


def _offered() -> dict[str, int]:
    """Routers each node should run: its units, but 1 on router 0's (this process's) node."""
    here = ray.get_runtime_context().get_node_id()
    units = {n["NodeID"]: int(n["Resources"].get("splitserve_router", 0)) for n in ray.nodes() if n["Alive"]}
    return units | {here: 1}


def test_each_node_runs_its_routers_and_each_serves_its_port(serving, config):
    routers = _routers(serving)
    offered = _offered()
    assert [r.index for r in routers] == list(range(sum(offered.values())))
    assert collections.Counter(r.node_id for r in routers) == offered
    assert all(r.alive for r in routers)
    assert len({r.address for r in routers}) == len(routers)
    # each router admits its part of the limit (rounded up)
    share = -(-config.limits.max_inflight_requests // len(routers))
    assert {r.max_inflight_requests for r in routers} == {share}
    prompts, params = mixed_workload(6, seed=61)
    reference = reference_tokens(Engine(config.engine_config("colocated")), prompts, params)
    for r in routers:
        results = stream_all(r.address, prompts, params)
        assert [out.token_ids for out, _ in results] == reference
    admitted = {r.index: r.admitted for r in _routers(serving)}
    assert all(n >= len(prompts) for n in admitted.values()), admitted


def test_status_lists_every_router(serving, capsys):
    assert main(["status", "--server", serving.address]) == 0
    out = capsys.readouterr().out
    for r in _routers(serving):
        assert f"router {r.index}: {r.address}" in out and f"on node {r.node_id[:12]}" in out


def test_a_follow_up_on_another_router_finds_the_prefix(serving):
    """Three prompts (so that a router blind to prefixes would pick the holder of all
    three by chance one time in eight, of two idle workers)."""
    r0, r1 = _routers(serving)[:2]
    for prompt in random_prompts([96] * 3, VOCAB, seed=62):
        with Client(r0.address, timeout=120) as c:
            holder = c.generate(prompt, temperature=0, max_tokens=4, ignore_eos=True).final.decode_worker

        def known_on_r1() -> bool:  # router 1 polls the workers' prefix logs itself
            with Client(r1.address, timeout=60) as c:
                status = c.cluster_status()
            assert status.answered_by == 1
            blocks = {w.worker_id: w.prefix_blocks for p in status.pools for w in p.workers}
            return blocks.get(holder, 0) >= 96 // 16  # noqa: B023 (called at once)

        wait_until(known_on_r1, "router 1 never learned the prefix")
        with Client(r1.address, timeout=120) as c:
            follow = c.generate(prompt + [7, 8, 9], temperature=0, max_tokens=4, ignore_eos=True).final
        assert follow.decode_worker == holder
        assert follow.cached_prompt_tokens >= 64


def test_a_node_router_killed_under_load_is_replaced_and_loses_nothing(serving, config):
    routers = _routers(serving)
    victim = routers[1]
    prompts = random_prompts([40] * 6, VOCAB, seed=63)
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    engine = Engine(config.engine_config("colocated"))
    reference = reference_tokens(engine, prompts, [params] * len(prompts))
    finish = streams_through_a_fault(victim.address, prompts, 300)  # on the victim's port
    slots = serving.cluster.replicas.slots
    (slot,) = [s for s in slots if s.index == victim.index]
    old = slot.actor
    ray.kill(old)
    # new requests meanwhile, through the SDK with every router's address
    fresh = random_prompts([24] * 6, VOCAB, seed=64)
    fresh_params = [SamplingParams(max_tokens=8, ignore_eos=True)] * len(fresh)
    results = stream_all([r.address for r in routers], fresh, fresh_params)
    assert [out.token_ids for out, _ in results] == reference_tokens(engine, fresh, fresh_params)
    outcomes = finish(180)
    for (code, tokens), expected in zip(outcomes, reference, strict=True):
        assert code in ("OK", "UNAVAILABLE"), code
        assert tokens == (expected if code == "OK" else expected[: len(tokens)])
    assert any(code == "UNAVAILABLE" for code, _ in outcomes), "no stream was on the killed router"
    with Client(serving.address, timeout=60) as c:
        assert not any(wait_kv_free(c, timeout=60).values()), "KV stayed held"
    wait_until(
        lambda: slot.actor not in (None, old) and all(r.alive for r in _routers(serving)),
        "the killed router was not replaced",
        120,
    )
    back = _routers(serving)[1]
    assert (back.address, back.node_id) == (victim.address, victim.node_id)
    with Client(back.address, timeout=120) as c:
        out = c.generate(fresh[0], temperature=0, max_tokens=8, ignore_eos=True)
    assert out.token_ids == results[0][0].token_ids


def test_a_node_that_leaves_takes_its_routers_and_the_shares_grow(serving, three_nodes, config):
    routers = _routers(serving)
    gone = routers[-1].node_id
    (node,) = [n for n in three_nodes.worker_nodes if n.node_id == gone]
    three_nodes.remove_node(node)
    kept = [r.index for r in routers if r.node_id != gone]
    share = -(-config.limits.max_inflight_requests // len(kept))

    def dropped() -> bool:
        left = _routers(serving)
        return [r.index for r in left] == kept and all(r.max_inflight_requests == share for r in left)

    wait_until(dropped, "the leaving node's routers were not dropped, or the shares did not grow", 180)
    with Client([r.address for r in routers if r.node_id != gone], timeout=120) as c:
        assert c.generate([5, 6, 7, 8], temperature=0, max_tokens=4, ignore_eos=True).final is not None
