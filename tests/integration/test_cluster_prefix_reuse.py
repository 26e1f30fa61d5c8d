"""Prefix reuse across the cluster (issue 37): a decode worker that holds a prompt's
prefix takes only the KV after it from the prefill worker, and a prefill worker that
lacks a prefix another prefill worker computed copies it from that one instead of
computing it; greedy output equal to transformers' ``generate``, the bytes moved per
request counted by the router, the copy in the request's trace and the counters."""

from __future__ import annotations

import contextlib

import pytest

from splitserve.client import Client
from splitserve.wire.prefix import prompt_block_hashes
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts
from tests.integration.cluster_util import live_cluster, scrape, stream_all, tiny_config, total, wait_until

BLOCK = 8
ENGINE = {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256, "block_size": BLOCK}
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prefix-llama")
    hf = make_hf_checkpoint("llama", directory, max_position=2048)
    return str(directory), hf


def test_a_1024_token_prefix_is_imported_only_as_its_tail_and_copied_between_prefill_workers(model):
    directory, hf = model
    prefix = random_prompts([1024], 512, seed=21)[0]
    first, second, third = (prefix + tail for tail in random_prompts([37, 21, 29], 512, seed=22))
    expected = [hf_greedy(hf, p, PARAMS.max_tokens) for p in (first, second, third)]
    config = tiny_config(
        directory,
        prefill={"num_cpus": 0.5, "replicas": 2, "engine": ENGINE},
        decode={"num_cpus": 0.5, "engine": ENGINE},
    )
    with live_cluster(config) as cluster, Client(cluster.address, timeout=60) as client:
        (per_token,) = {w.kv_bytes_per_token for p in client.cluster_status().pools for w in p.workers}
        block_bytes = per_token * BLOCK
        moved = []
        for prompt, want in zip((first, second), expected[:2]):
            before = total(scrape(cluster), "splitserve:kv_transfer_bytes_total")
            ((out, _),) = stream_all(cluster.address, [prompt], [PARAMS])
            assert out.final.prefill_worker == "prefill-0" and out.token_ids == want
            moved.append(total(scrape(cluster), "splitserve:kv_transfer_bytes_total") - before)
        # The first request moved its whole prompt; the second only what follows the
        # 1024 prefix tokens (128 blocks) the decode worker held from the first.
        assert moved[0] == -(-len(first) // BLOCK) * block_bytes
        assert moved[1] == -(-(len(second) - 1024) // BLOCK) * block_bytes
        (decode,) = [w for p in client.cluster_status().pools for w in p.workers if w.role == "decode"]
        reuse = decode.prefix_reuse
        assert (reuse.import_held_tokens, reuse.import_moved_tokens) == (
            1024,
            len(first) + len(second) - 1024,
        )
        print(f"KV moved per request: {moved[0]:,.0f} bytes, then {moved[1]:,.0f} with the prefix held")

        # prefill-1 has none of the prefix, prefill-0 all of it (as the router's index
        # shows) but a long queue: the third prompt goes to prefill-1, which copies the
        # 1024 tokens from prefill-0. The handover cost is pinned at 0 so the decider's
        # cost model (tests/unit/router/test_decider.py) surely chooses the copy.
        holder = cluster.registry.get("prefill-0")
        wait_until(
            lambda: holder.prefix.cached_blocks(prompt_block_hashes(prefix, BLOCK)) == 128,
            "the router never learned the holder's prefix",
        )
        with busy(cluster, holder):
            cluster.dispatcher.decider.handover_s = 0.0
            ((out, _),) = stream_all(cluster.address, [third], [PARAMS])
        assert out.final.prefill_worker == "prefill-1" and out.token_ids == expected[2]
        st = client.cluster_status(traces=1)
        (trace,) = st.traces
        assert (trace.prefix_pulled_tokens, trace.prefix_pulled_from) == (1024, "prefill-0")
        reuse = {w.worker_id: w.prefix_reuse for p in st.pools for w in p.workers}
        assert (reuse["prefill-1"].pulled_tokens, reuse["prefill-1"].pulls) == (1024, 1)
        assert reuse["prefill-0"].lent_tokens == 1024
        metrics = scrape(cluster)
        assert total(metrics, "splitserve:prefix_pulls_total", outcome="pulled") == 1
        assert total(metrics, "splitserve:prefix_pulls_total", outcome="failed") == 0


@contextlib.contextmanager
def busy(cluster, worker):
    """``worker`` counted by the router as holding a long prompt queue (its own bookkeeping)."""
    stack = contextlib.ExitStack()

    async def enter() -> None:
        stack.enter_context(cluster.registry.prefilling(worker, "busy", 1_000_000))

    async def leave() -> None:
        stack.close()

    cluster.run(enter())
    try:
        yield
    finally:
        cluster.run(leave())
