"""``transfer.on_failure`` on a live cluster whose every KV handover fails for real
(a lease of a microsecond: the prefill worker's export is gone before any decode
worker can pull it). Under ``recompute`` every request still completes, with the
monolithic engine's greedy tokens, prefilled again on the decode worker; under
``fail`` the client gets UNAVAILABLE with a sentence. Status and ``/metrics``
count both, and no KV is left held. Real Ray actors, NIXL, the tiny model."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.client import Client, Unavailable
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import VOCAB, live_cluster, stream_all, tiny_config, wait_kv_free


@pytest.fixture(scope="module")
def cluster(checkpoint):
    with live_cluster(tiny_config(checkpoint, transfer={"lease_s": 1e-6})) as c:
        yield c


def failures(cluster) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=60) as r:
        text = r.read().decode()
    return {
        (s.labels["error"], s.labels["action"]): s.value
        for f in text_string_to_metric_families(text)
        if f.name == "splitserve:kv_transfer_failures"
        for s in f.samples
        if s.name.endswith("_total")
    }


def test_failed_transfers_are_recomputed_or_fail_as_configured(cluster, checkpoint):
    prompts = random_prompts([5, 40, 90, 150], VOCAB, seed=21)
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts)
    engine = Engine(EngineConfig(model=checkpoint, dtype="float32", kv_cache_memory_mib=16))
    want = [c.token_ids for c in engine.generate(prompts, params)]

    got = stream_all(cluster.address, prompts, params)
    assert [c.token_ids for c, _ in got] == want
    assert all(c.final.prefill_worker == "prefill-0" for c, _ in got)  # the first token came from there
    with Client(cluster.address, timeout=60) as client:
        st = client.cluster_status(traces=len(prompts))
        recomputed = {(f.error, f.action): f.count for f in st.transfer_failures}
        assert sum(recomputed.values()) == len(prompts)
        assert all(action == "recompute" for _, action in recomputed)
        for t in st.traces:
            assert "kv_recompute" in [m.name for m in t.marks]
        assert failures(cluster) == recomputed

        cluster.dispatcher.on_transfer_failure = "fail"
        try:
            with pytest.raises(Unavailable) as failed:
                client.generate(prompts[0], temperature=0, max_tokens=4)
        finally:
            cluster.dispatcher.on_transfer_failure = "recompute"
        assert "lease" in failed.value.details.lower()
        st = client.cluster_status()
        assert sum(f.count for f in st.transfer_failures if f.action == "fail") == 1
        assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}
