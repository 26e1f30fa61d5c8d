"""Live migration on a live cluster: real Ray actors (one prefill and two decode
workers of the tiny model), NIXL, the router's gRPC door. ``splitserve drain``
on the decode worker a request streams from moves it to the other with its KV
(``RayDecodeWorker.move_out``, the new worker pulling from the old one through
``RayDecodePeer``): the client's tokens equal the monolithic engine's greedy
tokens, none repeated or skipped, the trace says it moved, and no KV stays held."""

from __future__ import annotations

import pytest

from splitserve.cli.main import main
from splitserve.client import Client, Final
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import VOCAB, live_cluster, tiny_config, wait_kv_free

POOL = {"num_cpus": 0.5, "engine": {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}}
MAX_TOKENS = 600  # long enough to be mid-stream when the drain comes


@pytest.fixture(scope="module")
def cluster(checkpoint):
    config = tiny_config(checkpoint, prefill=POOL, decode={**POOL, "replicas": 2})
    with live_cluster(config) as c:
        yield c


def test_draining_the_worker_a_request_streams_from_moves_it_whole(cluster, checkpoint, capsys):
    (prompt,) = random_prompts([60], VOCAB, seed=31)
    engine = Engine(EngineConfig(model=checkpoint, dtype="float32", kv_cache_memory_mib=16))
    (want,) = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens, final, drained = [], None, None
    with Client(cluster.address, timeout=120) as client:
        options = dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0, request_id="moving")
        for item in client.stream(prompt, **options):
            if isinstance(item, Final):
                final = item
                continue
            tokens += item.token_ids
            if drained is None and len(tokens) >= 10:
                st = client.cluster_status()
                (drained,) = [
                    w.worker_id for p in st.pools for w in p.workers if w.role == "decode" and w.running
                ]
                assert main(["drain", drained, "--server", cluster.address]) == 0
        st = client.cluster_status(traces=1)
        wait_kv_free(client)
    assert tokens == want.token_ids  # nothing repeated, skipped or changed
    assert final.decode_worker not in ("", drained)
    assert f"{drained} drained: 1 request(s) moved off, 0 left" in capsys.readouterr().out
    (trace,) = st.traces
    assert "moved" in [m.name for m in trace.marks]
