"""Decode workers that are tensor-parallel groups (2 Ray actors over gloo each,
every rank pulling its own KV heads) fed by a TP=4 prefill group, over NIXL. The
decode groups speculate with a draft model (the target's checkpoint, loaded whole
on each group's rank 0; the prefill group runs none).
The tiny model has 2 KV heads: the prefill group replicates each over two ranks,
and each decode rank reads its one head from the lowest prefill rank holding it
(the other replica is exported to no reader). One Ray instance for the module.

- Concurrent streams equal the TP=1 monolithic engine's greedy tokens, and no
  KV stays held on any rank afterwards.
- A decode group that loses a rank mid-stream ends its requests with
  ``WorkerLost``; the router resumes them on the other decode group, exactly,
  and the pool replaces the broken group.
"""

from __future__ import annotations

import pytest
import ray

from splitserve.client import Chunk, Client, Completion
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import (
    VOCAB,
    assert_kv_moved,
    kv_used,
    live_cluster,
    mixed_workload,
    reference_tokens,
    stream_all,
    tiny_config,
    wait_kv_free,
    wait_until,
)

ENGINE = {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def cluster(checkpoint):
    # whole on each rank 0; the target as its own draft, which the price rule would not run
    draft = {"method": "draft", "num_tokens": 3, "draft_model": str(checkpoint), "adaptive": False}
    config = tiny_config(
        checkpoint,
        prefill={"num_cpus": 0.25, "tp_size": 4, "engine": ENGINE},
        decode={"num_cpus": 0.25, "tp_size": 2, "replicas": 2, "engine": ENGINE | {"speculative": draft}},
    )
    with live_cluster(config) as c:
        yield c


def test_tp2_decode_groups_take_kv_from_a_tp4_prefill_group_exactly(cluster, reference, client):
    prompts, params = mixed_workload(24)
    expected = reference_tokens(reference, prompts, params)
    results = stream_all(cluster.address, prompts, params)
    assert [out.token_ids for out, _ in results] == expected
    finals = [out.final for out, _ in results]
    assert {f.prefill_worker for f in finals} == {"prefill-0"}
    # the groups verified drafts (rank 1 following) and kept them: the draft is the target,
    # so it proposes the target's own greedy tokens (rank 0's draft KV, caught up from the
    # handed-over tokens, is right), except where penalties and a logit bias (every third
    # request) move the target's choice off the draft's
    plain = [f for f, p in zip(finals, params) if not p.logit_bias]
    proposed = sum(f.draft_tokens for f in plain)
    assert proposed >= sum(f.completion_tokens for f in plain) // 2, plain
    assert sum(f.accepted_draft_tokens for f in plain) >= 0.9 * proposed, plain
    assert_kv_moved(finals, client)  # the KV moved, not recomputed
    used = wait_kv_free(client, timeout=30)
    assert set(used.values()) == {0}, used  # every prefill rank's lease ended


def test_a_decode_group_losing_a_rank_resumes_its_requests_on_another(cluster, reference, client):
    pool = cluster.cluster.pools["decode"]
    prompt = random_prompts([60], VOCAB, seed=11)[0]
    params = SamplingParams(max_tokens=900, ignore_eos=True)
    (expected,) = reference_tokens(reference, [prompt], [params])
    out, killed = Completion(), None
    for item in client.stream(
        prompt, temperature=0, max_tokens=params.max_tokens, ignore_eos=True, timeout_ms=600_000
    ):
        out.add(item)
        if killed is None and isinstance(item, Chunk) and len(out.token_ids) >= 20:
            (holder,) = [w for w, used in kv_used(client).items() if w.startswith("decode") and used]
            killed = holder
            ray.kill(pool.actors(holder)[1], no_restart=True)  # its TP rank 1
    assert killed is not None, "the stream ended before a rank could be killed"
    assert out.token_ids == expected  # resumed exactly where it was
    assert out.final.decode_worker not in ("", killed)
    # the broken group is replaced by its pool: two routable decode groups again
    wait_until(
        lambda: sum(w.routable and w.worker_id != killed for w in pool.workers) == 2,
        "the broken decode group was never replaced",
        timeout=600,
    )
    with Client(cluster.address, timeout=60) as again:
        short = random_prompts([30], VOCAB, seed=12)[0]
        (want,) = reference_tokens(reference, [short], [SamplingParams(max_tokens=8, ignore_eos=True)])
        assert again.generate(short, temperature=0, max_tokens=8, ignore_eos=True).token_ids == want
