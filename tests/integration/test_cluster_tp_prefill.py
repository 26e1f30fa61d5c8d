"""A prefill worker that is a tensor-parallel group (2 Ray actors over gloo, each
holding half the KV heads), feeding a TP=1 decode worker that merges the heads
of both shards as it pulls them over NIXL. One Ray instance for the module.

- 32 concurrent streams equal the TP=1 monolithic engine's greedy tokens.
- Every lease ends on both ranks: no KV stays held anywhere afterwards.
- Killing rank 1 does not fail the next request: with no prefill worker left,
  the decode worker prefills it (same tokens); the pool replaces the broken
  group by itself.
- A TP=1 decode worker whose engine stops while its process lives on (Ray sees
  nothing to restart) is replaced by its pool too.
"""

from __future__ import annotations

import pytest
import ray

from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import (
    VOCAB,
    assert_kv_moved,
    cancel_mid_stream,
    live_cluster,
    mixed_workload,
    reference_tokens,
    stream_all,
    tiny_config,
    wait_kv_free,
)
from tests.waiting import wait_until


def idle(used: dict[str, int]) -> bool:
    return set(used.values()) == {0}


@pytest.fixture(scope="module")
def cluster(checkpoint):
    engine = {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}
    config = tiny_config(checkpoint, prefill={"num_cpus": 0.5, "tp_size": 2, "engine": engine})
    with live_cluster(config) as c:
        yield c


def test_tp2_prefill_group_serves_tp1_decode_exactly(cluster, reference, client):
    prompts, params = mixed_workload(32)
    expected = reference_tokens(reference, prompts, params)
    decode = cluster.cluster.pools["decode"]
    (worker,) = decode.workers
    decode_rank0 = decode.actors(worker.worker_id)[0]

    def checked() -> dict[str, int]:  # the decode worker's meaning checks so far, by result
        return dict(ray.get(decode_rank0.stats.remote(), timeout=60).engine.meaning_checks)

    before = checked()
    results = stream_all(cluster.address, prompts, params)
    assert [out.token_ids for out, _ in results] == expected
    finals = [out.final for out, _ in results]
    assert len({f.prefill_worker for f in finals}) == 1  # the one TP group
    assert_kv_moved(finals, client)  # KV pulled from both ranks
    assert idle(wait_kv_free(client))  # every shard's lease ended; blocks released
    # each handoff (a request that went past its first token), its heads merged from both
    # ranks, was checked by meaning and passed
    after = checked()
    assert {k: after[k] - before.get(k, 0) for k in after} == {"ok": sum(len(t) > 1 for t in expected)}


def test_cancel_releases_both_ranks(client):
    assert idle(cancel_mid_stream(client))
    # The group still serves after the cancellation.
    prompt = random_prompts([200], VOCAB, seed=4)[0]
    assert len(client.generate(prompt, temperature=0, max_tokens=5, ignore_eos=True).token_ids) == 5


def test_a_lost_rank_is_served_around_and_the_pool_replaces_the_group(cluster, reference, client):
    pool = cluster.cluster.pools["prefill"]
    (broken,) = pool.workers
    ray.kill(pool._members[broken.worker_id].ranks[0], no_restart=True)
    prompt = random_prompts([50], VOCAB, seed=9)[0]
    # The group is the only prefill worker: while it is broken (or its replacement
    # loads), the decode worker prefills requests itself, exactly.
    (expected,) = reference_tokens(reference, [prompt], [SamplingParams(max_tokens=5, ignore_eos=True)])
    out = client.generate(prompt, temperature=0, max_tokens=5, ignore_eos=True, timeout_ms=600_000)
    assert out.token_ids == expected and out.final.prefill_worker == ""
    # The pool sees the group is lost for good (Ray never restarts a TP group) and starts
    # a new one in its place: the cluster serves again without anyone stepping in.
    wait_until(
        lambda: any(w.routable and w.worker_id != broken.worker_id for w in pool.workers),
        "the broken group replaced",
        600,
        0.1,
    )
    (new,) = pool.workers
    assert new.worker_id != broken.worker_id and pool.replaced == 1
    assert len(client.generate(prompt, temperature=0, max_tokens=5, ignore_eos=True).token_ids) == 5
    assert idle(wait_kv_free(client))


def test_a_worker_whose_engine_stopped_is_replaced(cluster, client):
    pool = cluster.cluster.pools["decode"]
    (stopped,) = pool.workers
    ray.get(pool.actors(stopped.worker_id)[0].shutdown.remote())  # the loop ends; the actor lives
    wait_until(
        lambda: any(w.routable and w.worker_id != stopped.worker_id for w in pool.workers),
        "the stopped worker replaced",
        600,
        0.1,
    )
    assert pool.replaced == 1 and stopped.worker_id not in [w.worker_id for w in pool.workers]
    prompt = random_prompts([50], VOCAB, seed=10)[0]
    assert len(client.generate(prompt, temperature=0, max_tokens=5, ignore_eos=True).token_ids) == 5
    assert idle(wait_kv_free(client))
