"""The overload harness (``splitserve.bench.overload``) at CI size: an open-loop
stream at 1x, then 10x, then 1x again of a rate the cluster sustains, with a
small in-flight limit. Past the limit requests are refused with
RESOURCE_EXHAUSTED and a sentence (nothing else fails), every admitted request
streams all its tokens, and once the load drops the cluster serves as before:
nothing refused, nothing in flight, no KV held. The figures (TPOT of admitted
requests at 10x against 1x, p99 of the rejection time) are the benchmark's:
``python -m splitserve.bench.overload --rate R``."""

from __future__ import annotations

from splitserve.bench.chaos import kv_held
from splitserve.bench.overload import run_overload
from tests.integration.cluster_util import VOCAB, live_cluster, tiny_config

OUTPUT = 24


def test_ten_times_the_load_is_refused_fast_and_the_rest_served(checkpoint):
    config = tiny_config(checkpoint, limits={"max_inflight_requests": 6})
    with live_cluster(config) as cluster:
        phases = run_overload(cluster, VOCAB, rate=4, requests=16, input_len=64, output_len=OUTPUT)
        assert cluster.run(_inflight(cluster)) == 0
        assert not any(kv_held(cluster.address).values())
    calm, storm, after = phases
    assert [len(p.sent) for p in phases] == [16, 160, 16]
    assert storm.count("RESOURCE_EXHAUSTED") > 0
    assert storm.count("OK") + storm.count("RESOURCE_EXHAUSTED") == len(storm.sent)
    assert all("retry later" in s.message for s in storm.sent if s.code != "OK")
    for p in phases:
        assert all(s.tokens == OUTPUT for s in p.sent if s.code == "OK")
    # before and after the storm, the same load is served whole
    assert calm.count("OK") == len(calm.sent) and after.count("OK") == len(after.sent)


async def _inflight(cluster) -> int:
    return cluster.dispatcher.num_inflight
