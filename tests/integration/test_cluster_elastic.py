"""An elastic cluster (``mode: elastic``) on real Ray actors: three elastic workers of
the tiny model (one prefill, two decode at first), NIXL, the router's gRPC door.
While a client streams from a decode worker, that worker switches to prefill (its
request moves to the other decode worker with its KV: its trace shows the pull, no
transfer failed); then the first prefill worker switches to decode. The stream's
tokens equal the monolithic engine's greedy tokens;
requests after the switches are prefilled by the worker that was a decode worker;
``/metrics`` counts one switch into each role and time spent in each; nothing stays
held. The planner's own switching (``PlannerLoop._split``) is tested without Ray, in
``tests/unit/cluster/test_slo_autoscale.py``."""

from __future__ import annotations

import pytest

from splitserve.client import Client, Final
from splitserve.engine.engine import Engine
from splitserve.router.roles import Role
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import (
    VOCAB,
    assert_move_pulled,
    live_cluster,
    scrape,
    tiny_config,
    total,
    trace_of,
    transfer_failures,
    wait_kv_free,
)

SLO = {"policy": "slo", "min_replicas": 1, "max_replicas": 3}
POOL = {
    "num_cpus": 0.5,
    "engine": {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256},
}
MAX_TOKENS = 400  # long enough to be mid-stream when its worker switches role


@pytest.fixture(scope="module")
def cluster(checkpoint):
    config = tiny_config(
        checkpoint,
        mode="elastic",
        prefill={**POOL, "replicas": 1, "autoscaling": {**SLO, "min_replicas": 0}},
        decode={**POOL, "replicas": 2, "autoscaling": SLO},
        planner={"ttft_ms": 1000, "tpot_ms": 100, "interval_s": 3600},  # switched by hand here
    )
    with live_cluster(config) as c:
        yield c


def test_elastic_workers_switch_role_under_a_stream_and_lose_nothing(cluster, checkpoint):
    prompts = random_prompts([60, 40, 50, 70], VOCAB, seed=41)
    engine = Engine(EngineConfig(model=checkpoint, dtype="float32", kv_cache_memory_mib=16))
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] + [SamplingParams(max_tokens=8)] * 3
    want = [c.token_ids for c in engine.generate(prompts, params)]
    tokens, final, switched = [], None, None
    with Client(cluster.address, timeout=120) as client:
        failures = transfer_failures(client)
        options = dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0, request_id="switching")
        for item in client.stream(prompts[0], **options):
            if isinstance(item, Final):
                final = item
                continue
            tokens += item.token_ids
            if switched is None and len(tokens) >= 10:
                st = client.cluster_status()
                (switched,) = [w.worker_id for p in st.pools for w in p.workers if w.running]
                cluster.run(cluster.cluster.switch_role(switched, Role.PREFILL), timeout=120)
        (first_prefill,) = [
            w.worker_id for w in cluster.registry.workers(Role.PREFILL) if w.worker_id != switched
        ]
        cluster.run(cluster.cluster.switch_role(first_prefill, Role.DECODE), timeout=120)
        later = [client.generate(prompts[i], max_tokens=8, temperature=0.0) for i in (1, 2, 3)]
        st = client.cluster_status(traces=4)
        wait_kv_free(client)
        assert transfer_failures(client) == failures  # no pull failed, the move's included
    assert tokens == want[0]  # nothing repeated, skipped or changed by the switch
    assert final.decode_worker not in ("", switched)
    assert_move_pulled(trace_of(st.traces, "switching"), to=final.decode_worker)  # with its KV
    assert [c.token_ids for c in later] == want[1:]
    roles = {w.worker_id: w.role for w in cluster.registry.workers()}
    assert roles[switched] == Role.PREFILL and roles[first_prefill] == Role.DECODE
    later_traces = [t for t in st.traces if t.request_id != "switching"]
    assert {t.prefill_worker for t in later_traces} == {switched}  # the only prefill worker now
    metrics = scrape(cluster)
    assert total(metrics, "splitserve:role_switches_total", role="prefill") == 1
    assert total(metrics, "splitserve:role_switches_total", role="decode") == 1
    assert total(metrics, "splitserve:role_seconds_total", role="prefill") > 0
    assert total(metrics, "splitserve:role_seconds_total", role="decode") > 0


def test_with_every_worker_decoding_the_decode_workers_prefill_and_the_last_one_stays(cluster, checkpoint):
    """The prefill role emptied (an elastic cluster's pooled split): the cluster stays
    SERVING, each request is prefilled on the decode worker that decodes it, with the
    monolithic engine's greedy tokens; the last decode worker is refused the prefill role
    with a sentence; a worker that takes the prefill role back prefills again."""
    prompts = random_prompts([30, 45, 60], VOCAB, seed=43)
    engine = Engine(EngineConfig(model=checkpoint, dtype="float32", kv_cache_memory_mib=16))
    want = [c.token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=8))]
    for w in cluster.registry.workers(Role.PREFILL):
        cluster.run(cluster.cluster.switch_role(w.worker_id, Role.DECODE), timeout=120)
    decode = [w.worker_id for w in cluster.registry.routable(Role.DECODE)]
    assert len(decode) == 3 and not cluster.registry.workers(Role.PREFILL)
    with Client(cluster.address, timeout=120) as client:
        assert client.health()
        got = [client.generate(p, max_tokens=8, temperature=0.0) for p in prompts]
        st = client.cluster_status(traces=3)
        assert [c.token_ids for c in got] == want
        assert {t.prefill_worker for t in st.traces} == {""}  # each prefilled where it decodes
        for wid in decode[1:]:
            cluster.run(cluster.cluster.switch_role(wid, Role.PREFILL), timeout=120)
        with pytest.raises(InvalidRequest, match="last decode worker"):
            cluster.run(cluster.cluster.switch_role(decode[0], Role.PREFILL), timeout=120)
        back = client.generate(prompts[2], max_tokens=8, temperature=0.0)
        st = client.cluster_status(traces=1)
        wait_kv_free(client)
    assert back.token_ids == want[2]
    assert st.traces[-1].prefill_worker in decode[1:]
