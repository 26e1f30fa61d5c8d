"""A hybrid model (Qwen3-Next: Gated DeltaNet layers beside gated attention, and MoE)
on a live cluster: one prefill and two decode workers, NIXL, the router's gRPC door.
A long greedy stream whose decode worker is drained moves to the other one with its
KV and its linear layers' states (the move pulled, nothing computed again: the
trace says so), and a stream whose decode worker is killed mid-way resumes on the
other one (recomputed: the state is rebuilt from the tokens); both give
transformers' tokens, none repeated or skipped."""

from __future__ import annotations

import pytest
import ray

from splitserve.client import Chunk, Client, Completion
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts
from tests.integration.cluster_util import (
    assert_move_pulled,
    drain_mid_stream,
    kv_used,
    live_cluster,
    tiny_config,
    trace_of,
    transfer_failures,
    wait_kv_free,
)

POOL = {"num_cpus": 0.5, "engine": {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}}
MAX_TOKENS = 300  # long enough to be mid-stream when the drain or the kill comes


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_next")
    hf = make_hf_checkpoint("qwen3_next", directory)
    prompts = random_prompts([60, 45], 512, seed=31)
    return str(directory), prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def cluster(model):
    config = tiny_config(model[0], prefill=POOL, decode={**POOL, "replicas": 2})
    with live_cluster(config) as c:
        yield c


def test_draining_a_hybrid_stream_s_worker_moves_its_kv_and_states(cluster, model, capsys):
    _, prompts, expected = model
    with Client(cluster.address, timeout=120) as client:
        failures = transfer_failures(client)
        tokens, final, drained = drain_mid_stream(cluster, client, prompts[0], "moving", MAX_TOKENS)
        st = client.cluster_status(traces=1)
        wait_kv_free(client)
        assert transfer_failures(client) == failures  # the move's pull did not fail
    assert tokens == expected[0]
    assert final.decode_worker not in ("", drained)
    assert f"{drained} drained: 1 request(s) moved off, 0 left" in capsys.readouterr().out
    assert_move_pulled(trace_of(st.traces, "moving"), to=final.decode_worker)
    cluster.run(cluster.registry.activate(drained))  # routed to again, for the test below


def test_a_hybrid_stream_whose_decode_worker_is_killed_resumes_exactly(cluster, model):
    _, prompts, expected = model
    pool = cluster.cluster.pools["decode"]
    out, killed = Completion(), None
    with Client(cluster.address, timeout=120) as client:
        for item in client.stream(prompts[1], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True):
            out.add(item)
            if killed is None and isinstance(item, Chunk) and len(out.token_ids) >= 20:
                (killed,) = [w for w, used in kv_used(client).items() if w.startswith("decode") and used]
                ray.kill(pool.actors(killed)[0], no_restart=True)
    assert killed is not None, "the stream ended before its worker could be killed"
    assert out.token_ids == expected[1]
    assert out.final.decode_worker not in ("", killed)
