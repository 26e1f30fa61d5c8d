"""Prefix reuse across the cluster (issue 37): a decode worker that holds a prompt's
prefix takes only the KV after it from the prefill worker, with greedy output equal to
transformers' ``generate`` and the bytes moved per request counted by the router."""

from __future__ import annotations

import pytest

from splitserve.client import Client
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts
from tests.integration.cluster_util import live_cluster, scrape, stream_all, tiny_config, total

BLOCK = 8
ENGINE = {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256, "block_size": BLOCK}
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prefix-llama")
    hf = make_hf_checkpoint("llama", directory, max_position=2048)
    return str(directory), hf


def test_a_decode_worker_holding_a_1024_token_prefix_imports_only_the_tail(model):
    directory, hf = model
    prefix = random_prompts([1024], 512, seed=21)[0]
    first, second = (prefix + tail for tail in random_prompts([37, 21], 512, seed=22))
    expected = [hf_greedy(hf, p, PARAMS.max_tokens) for p in (first, second)]
    config = tiny_config(
        directory,
        prefill={"num_cpus": 0.5, "engine": ENGINE},
        decode={"num_cpus": 0.5, "engine": ENGINE},
    )
    with live_cluster(config) as cluster, Client(cluster.address, timeout=60) as client:
        (per_token,) = {w.kv_bytes_per_token for p in client.cluster_status().pools for w in p.workers}
        block_bytes = per_token * BLOCK
        moved = []
        for prompt, want in zip((first, second), expected):
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
