"""The colocated baseline: two workers that each run both phases (no KV
transfer), behind the same router and SDK. Same correctness bar as the
disaggregated cluster. One Ray instance and one cluster for the module."""

from __future__ import annotations

import os

import grpc
import pytest
import ray

from splitserve.client import DeadlineExceeded
from splitserve.wire import token_stream
from splitserve.wire.decode import DecodeTask
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import (
    VOCAB,
    cancel_mid_stream,
    kv_used,
    live_cluster,
    mixed_workload,
    reference_tokens,
    stream_all,
    tiny_config,
    wait_kv_free,
)

IDLE = {"colocated-0": 0, "colocated-1": 0}
POOL_ENV = {"SPLITSERVE_POOL_MARK": "colocated", "GOMP_SPINCOUNT": "2000"}  # the pool's env


@pytest.fixture(scope="module")
def cluster(checkpoint):
    config = tiny_config(checkpoint, mode="colocated")
    config = config.model_copy(update={"colocated": config.colocated.model_copy(update={"env": POOL_ENV})})
    with live_cluster(config) as c:
        yield c


def test_every_worker_process_has_its_pools_env(cluster):
    workers = cluster.registry.workers("colocated")
    assert len(workers) == 2
    for w in workers:
        seen = w.client.actor.__ray_call__.remote(
            lambda _, names: {n: os.environ.get(n) for n in names}, POOL_ENV
        )
        assert ray.get(seen, timeout=60) == POOL_ENV


def test_32_concurrent_streams_equal_monolithic_greedy(cluster, reference, client):
    prompts, params = mixed_workload(32)
    expected = reference_tokens(reference, prompts, params)
    results = stream_all(cluster.address, prompts, params)
    assert [out.token_ids for out, _ in results] == expected
    finals = [out.final for out, _ in results]
    assert all(f.prefill_worker == "" and f.transfer_ms == 0 for f in finals)
    assert {f.decode_worker for f in finals} == {"colocated-0", "colocated-1"}  # both workers used
    assert client.cluster_status().mode == "colocated"
    assert wait_kv_free(client) == IDLE


def test_cancel_and_deadline_free_every_block(client):
    assert cancel_mid_stream(client) == IDLE
    prompt = random_prompts([200], VOCAB, seed=3)[0]
    with pytest.raises(DeadlineExceeded):
        client.generate(prompt, temperature=0, max_tokens=800, ignore_eos=True, timeout_ms=300)
    assert wait_kv_free(client) == IDLE


def test_requests_on_a_token_stream_its_reader_left_are_aborted(cluster, client):
    """A worker's tokens reach a router over one gRPC stream (at its ``token_address``);
    when the router stops reading it (cancels it, or dies), the worker aborts every
    request started on it."""
    actor = cluster.registry.workers("colocated")[0].client.actor
    prompt = random_prompts([200], VOCAB, seed=5)[0]
    task = DecodeTask("left-behind", prompt, SamplingParams(max_tokens=800, ignore_eos=True))
    with grpc.insecure_channel(ray.get(actor.token_address.remote())) as channel:
        read = channel.unary_stream(
            token_stream.METHOD,
            request_serializer=token_stream.encode_outbox,
            response_deserializer=token_stream.decode_item,
        )
        stream = read("reader-1")
        ray.get(actor.start.remote("reader-1", task))
        first = next(stream)
        assert [b.request_id for b in first] == ["left-behind"] and first[0].token_ids
        assert sum(kv_used(client).values()) > 0
        stream.cancel()
    assert wait_kv_free(client) == IDLE
