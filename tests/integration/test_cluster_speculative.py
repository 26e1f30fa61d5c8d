"""Speculation on one side of the handoff: a disaggregated cluster of the real
SmolLM2 (float32) whose prefill pool does not speculate and whose decode pool runs
a draft model (SmolLM2 itself, loaded a second time: in float32 it proposes the
target's own greedy tokens, so drafts are kept only if the draft's KV, computed on
the decode worker from the handed-over request's tokens, is right). Prompts stream
through the router with their KV moved from the prefill worker; their greedy
tokens equal the monolithic engine's without speculation, a request that opts out
too; the request's ``Final``, ``/metrics`` and ``status`` show drafts kept on the
decode workers only. A decode worker killed mid-stream: the request resumes on the
other with speculation on (its draft catching up from the tokens: the other worker
proposes for it and keeps its drafts), its tokens are the undisturbed run's and its
``Final`` says it ended whole.

The draft's state is a function of the tokens, so the handoff carries nothing for
it and the KV compatibility hash needs nothing more (docs/speculative.md)."""

from __future__ import annotations

import pytest
import ray

from splitserve.client import Client, Final
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.integration.cluster_util import (
    assert_kv_moved,
    kv_used,
    live_cluster,
    scrape,
    tiny_config,
    total,
    wait_kv_free,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.needs_smollm2

TEXTS = [
    "The harbour town wakes early. Fishing boats leave before dawn, and by seven the market is full.",
    "To reset the router, unplug it for thirty seconds, plug it back in and wait for the green light.",
]
MAX_TOKENS = 48
POOL = {"num_cpus": 0.5, "engine": {"kv_cache_memory_mib": 96, "max_num_batched_tokens": 256}}
# the draft is the target: worth nothing, so the price rule would not run it (adaptive off)
DRAFT = {"method": "draft", "num_tokens": 4, "draft_model": "smollm2", "adaptive": False}


@pytest.fixture(scope="module")
def reference():
    engine = Engine(EngineConfig(model="smollm2", dtype="float32", kv_cache_memory_mib=96))
    prompts = [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Repeat this text exactly:\n\n{t}"}]
        )
        for t in TEXTS
    ]
    want = [
        c.token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    ]
    return prompts, want


@pytest.fixture(scope="module")
def cluster():
    config = tiny_config(
        "smollm2",
        prefill=POOL,
        decode={**POOL, "replicas": 2, "engine": {**POOL["engine"], "speculative": DRAFT}},
    )
    with live_cluster(config) as c:
        yield c


def _stream(client: Client, prompt, **options) -> tuple[list[int], Final]:
    tokens, final = [], None
    for item in client.stream(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0, **options):
        if isinstance(item, Final):
            final = item
        else:
            tokens += item.token_ids
    return tokens, final


def test_prefill_none_decode_draft_streams_the_tokens_of_no_speculation(cluster, reference):
    prompts, want = reference
    with Client(cluster.address, timeout=180) as client:
        got = [_stream(client, p) for p in prompts]
        assert [t for t, _ in got] == want
        assert_kv_moved([f for _, f in got], client)
        # the draft is the target: what it proposes is kept (its KV caught up right);
        # with adaptive k off it proposes 4 tokens every step it may
        for _, final in got:
            assert final.draft_tokens >= MAX_TOKENS // 2, final
            assert final.accepted_draft_tokens >= 0.9 * final.draft_tokens, final
        opted_out, final = _stream(client, prompts[0], speculate=False)
        assert opted_out == want[0]
        assert final.draft_tokens == 0
        methods = {w.role: w.speculation.method for p in client.cluster_status().pools for w in p.workers}
    assert methods == {"prefill": "", "decode": "draft"}
    metrics = scrape(cluster)
    assert total(metrics, "splitserve:spec_decode_accepted_tokens_total", pool="decode") > 0
    assert total(metrics, "splitserve:spec_decode_draft_tokens_total", pool="prefill") == 0


def test_a_killed_decode_worker_resumes_with_speculation_and_the_same_tokens(cluster, reference):
    prompts, want = reference
    pool = cluster.cluster.pools["decode"]

    def speculation(worker_id: str) -> tuple[int, int]:
        """(tokens proposed, kept) on a decode worker since it started."""
        s = cluster.run(cluster.registry.get(worker_id).client.stats(), timeout=60).engine.speculation
        return s.proposed_tokens, s.accepted_tokens

    with Client(cluster.address, timeout=180) as client:
        wait_kv_free(client)
        before = {w.worker_id: speculation(w.worker_id) for w in pool.workers}
        tokens, final, killed = [], None, None
        for item in client.stream(prompts[1], max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0):
            if isinstance(item, Final):
                final = item
                continue
            tokens += item.token_ids
            if killed is None and len(tokens) >= 6:
                holders = [w for w, used in kv_used(client).items() if w.startswith("decode") and used]
                if holders:
                    killed = holders[0]
                    ray.kill(pool.actors(killed)[0], no_restart=False)
        assert killed is not None, "the output ended before its decode worker could be killed"
        assert tokens == want[1]
        # the resumed request ended whole on the other worker, which speculated for it
        # and kept its drafts (its draft caught up from the prompt and the tokens sent)
        assert final.finish_reason == "length" and final.completion_tokens == MAX_TOKENS, final
        survivor = final.decode_worker
        assert survivor in before and survivor != killed, final
        (proposed, kept), (proposed_before, kept_before) = speculation(survivor), before[survivor]
        proposed, kept = proposed - proposed_before, kept - kept_before
        assert proposed > 0 and kept >= 0.9 * proposed, (proposed, kept)
        assert final.draft_tokens >= proposed, final  # the Final counts them, and the killed one's
        assert final.accepted_draft_tokens >= 0.9 * final.draft_tokens, final
        wait_until(lambda: sum(w.routable for w in pool.workers) == 2, "the decode pool is not whole")
