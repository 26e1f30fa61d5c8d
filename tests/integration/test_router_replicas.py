"""Router replicas (``router.replicas``): several router processes serve one gRPC and
one HTTP port (``SO_REUSEPORT``), each with its own registry and its own token stream
from every decode worker; connections spread over them and every answer equals the
engine's greedy output. A killed replica is replaced, and the new one serves."""

from __future__ import annotations

import json
import urllib.request

import pytest
import ray

from splitserve.client import Client
from splitserve.cluster.replicas import share
from splitserve.engine.engine import Engine
from splitserve.router.policy import LimitsSpec
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import (
    VOCAB,
    live_cluster,
    mixed_workload,
    reference_tokens,
    stream_all,
    streams_through_a_fault,
    tiny_config,
    wait_kv_free,
    wait_until,
)


@pytest.fixture(scope="module")
def config(checkpoint):
    cfg = tiny_config(checkpoint, "disaggregated")
    return cfg.model_copy(update={"router": cfg.router.model_copy(update={"replicas": 2})})


@pytest.fixture(scope="module")
def cluster(config):
    with live_cluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def workload(config):
    prompts, params = mixed_workload(24, seed=21)
    return prompts, params, reference_tokens(Engine(config.engine_config("decode")), prompts, params)


def _admitted(cluster) -> list[int]:
    """Requests admitted by the primary, then by each replica."""
    return [r.admitted for r in cluster.run(cluster.cluster.routers(), timeout=60)]


def _serve_and_check(cluster, workload) -> list[int]:
    """Every request on a connection of its own, all at once; each router's share."""
    prompts, params, reference = workload
    before = _admitted(cluster)
    results = stream_all(cluster.address, prompts, params)
    assert [out.token_ids for out, _ in results] == reference
    return [b - a for a, b in zip(before, _admitted(cluster), strict=True)]


def test_both_routers_serve_one_port_and_answer_as_the_engine(cluster, workload):
    served = _serve_and_check(cluster, workload)
    assert sum(served) == len(workload[0])
    assert all(n > 0 for n in served), f"one router got every connection: {served}"


def test_the_http_port_is_shared_too(cluster, workload):
    """Completions over HTTP on connections of their own (urllib opens one per request)
    are admitted by the routers together, each answered in full."""
    prompts = workload[0]
    before = _admitted(cluster)
    for prompt in prompts[:8]:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(
            f"http://{cluster.http_address}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
        assert answer["usage"]["completion_tokens"] == 6 and answer["choices"][0]["finish_reason"] == "length"
    assert sum(_admitted(cluster)) - sum(before) == 8


def test_a_replica_killed_under_load_ends_its_streams_and_is_replaced(cluster, config, workload):
    """Streams on connections of their own, all past their first token, when one router's
    process is killed: each either completes with the engine's tokens (it was on the
    other router) or ends with UNAVAILABLE (none hangs), no KV stays held, and a new
    replica takes the dead one's place and serves."""
    prompts = random_prompts([40] * 12, VOCAB, seed=41)
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    reference = reference_tokens(Engine(config.engine_config("decode")), prompts, [params] * len(prompts))
    finish = streams_through_a_fault(cluster.address, prompts, 400, retries=3)
    replicas = cluster.cluster.replicas
    (old,) = replicas.actors
    ray.kill(old)
    outcomes = finish(180)
    for (code, tokens), expected in zip(outcomes, reference, strict=True):
        assert code in ("OK", "UNAVAILABLE"), code
        assert tokens == (expected if code == "OK" else expected[: len(tokens)])
    with Client(cluster.address, timeout=60) as c:
        assert not any(wait_kv_free(c, timeout=60).values()), "KV stayed held"
    wait_until(lambda: replicas.replaced == 1 and replicas.actors[0] is not old, "no replica replaced it")
    wait_until(
        lambda: _serve_and_check(cluster, workload)[1] > 0,
        "the new replica got no connection",
        300,
    )


def test_admission_limits_are_split_between_routers():
    limits = share(LimitsSpec(max_inflight_requests=9, max_queued_prompt_tokens=1001, max_decode_batch=3), 2)
    assert (limits.max_inflight_requests, limits.max_queued_prompt_tokens) == (5, 501)
    assert limits.max_decode_batch == 2
    assert share(LimitsSpec(), 3).max_decode_batch is None
