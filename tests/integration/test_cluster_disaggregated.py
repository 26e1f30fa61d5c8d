"""The disaggregated cluster end to end: real Ray actors, the real gRPC router
and SDK over localhost, KV over NIXL, a tiny random-weight model (float32).
One Ray instance and one cluster for the whole module."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import ray

from splitserve.client import (
    Client,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
)
from splitserve.engine import Engine, EngineConfig, SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import (
    VOCAB,
    kv_used,
    live_cluster,
    mixed_workload,
    reference_tokens,
    stream_all,
    tiny_checkpoint,
    tiny_config,
    wait_kv_free,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(checkpoint):
    with live_cluster(tiny_config(checkpoint)) as c:
        yield c


@pytest.fixture(scope="module")
def reference(checkpoint):
    return Engine(EngineConfig(model=checkpoint, dtype="float32", num_kv_blocks=2048))


@pytest.fixture()
def client(cluster):
    with Client(cluster.address, timeout=60) as c:
        yield c


def test_32_concurrent_streams_equal_monolithic_greedy(cluster, reference, client):
    prompts, params = mixed_workload(32)
    expected = reference_tokens(reference, prompts, params)
    results = stream_all(cluster.address, prompts, params)
    for i, ((out, _), want) in enumerate(zip(results, expected)):
        assert out.token_ids == want, f"request {i} (prompt {len(prompts[i])} tokens) differs"
        f = out.final
        assert f.completion_tokens == len(want) and f.prompt_tokens == len(prompts[i])
        assert f.finish_reason == ("length" if len(want) == params[i].max_tokens else "stop")
        assert f.prefill_worker == "prefill-0"
        assert len(out.times_ms) == len(want) and out.times_ms == sorted(out.times_ms)
        if len(want) > 1:
            assert f.decode_worker == "decode-0" and f.transfer_ms > 0
    # Streaming, not one final blob: long outputs arrive in several chunks.
    assert max(chunks for _, chunks in results) > 3
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}


def test_cancel_mid_stream_frees_every_block(client):
    prompt = random_prompts([200], VOCAB, seed=3)[0]
    stream = client.stream(prompt, max_tokens=800, ignore_eos=True)
    for _ in range(3):
        next(stream)
    assert kv_used(client)["decode-0"] > 0  # the request holds blocks now
    stream.close()  # the client cancels the call
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}
    assert client.cluster_status().inflight_requests == 0


@pytest.mark.parametrize("how", ["timeout_ms", "grpc_deadline"])
def test_deadline_ends_the_call_and_frees_blocks(client, how):
    prompt = random_prompts([50], VOCAB, seed=4)[0]
    kwargs = {"timeout_ms": 300} if how == "timeout_ms" else {"timeout": 0.3}
    with pytest.raises(DeadlineExceeded):
        client.generate(prompt, max_tokens=960, ignore_eos=True, **kwargs)
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}


BAD_INPUTS = [
    ({"prompt": []}, "empty"),
    ({"prompt": "hello"}, "tokenizer"),  # the tiny model has none: token ids only
    ({"prompt": list(range(2)) * 600}, "context"),
    ({"prompt": [1, 2, 3], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2, 3], "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": [1, 2, 3], "model": "gpt-5"}, "unknown model"),
    ({"prompt": [1, 2, 3], "temperature": -1.0}, "temperature"),
    ({"prompt": [1, 2, 3], "top_p": 1.5}, "top_p"),
    ({"prompt": [1, VOCAB + 5]}, "token ids"),
    ({"prompt": None}, "no input"),
    ({"prompt": [1, 2, 3], "timeout_ms": 0, "request_id": "dup"}, None),  # valid, for contrast
]


def test_bad_input_is_refused_clearly_while_good_requests_complete(cluster, reference, client):
    prompts, params = mixed_workload(6, seed=11)
    expected = reference_tokens(reference, prompts, params)
    good: list = []
    t = threading.Thread(target=lambda: good.extend(stream_all(cluster.address, prompts, params)))
    t.start()
    for kwargs, needle in BAD_INPUTS:
        kwargs = dict(kwargs)
        prompt = kwargs.pop("prompt")
        if needle is None:
            assert client.generate(prompt, **kwargs).final is not None
            continue
        with pytest.raises(InvalidArgument) as e:
            client.generate(prompt, **kwargs)
        assert needle in e.value.details, e.value.details
    t.join(120)
    assert [out.token_ids for out, _ in good] == expected
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}


def test_backpressure_past_the_inflight_limit(cluster, client):
    d = cluster.dispatcher
    original = d.policy
    cluster.run(_set_policy(d, dataclasses.replace(original, max_inflight_requests=2)))
    try:
        streams = [
            client.stream(random_prompts([20], VOCAB, seed=s)[0], max_tokens=900, ignore_eos=True)
            for s in (1, 2)
        ]
        for s in streams:
            next(s)  # both admitted and streaming
        with pytest.raises(ResourceExhausted, match="capacity"):
            client.generate([1, 2, 3], max_tokens=2)
        for s in streams:
            s.close()
    finally:
        cluster.run(_set_policy(d, original))
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}
    assert client.generate([1, 2, 3], max_tokens=2).final.completion_tokens == 2


async def _set_policy(dispatcher, policy):
    dispatcher.policy = policy


def test_health_reflection_models_and_tokenize(cluster, client, checkpoint):
    import grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    assert client.health()
    with grpc.insecure_channel(cluster.address) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "splitserve.v1.Splitserve" in services and "grpc.health.v1.Health" in services
    (model,) = client.list_models()
    assert model.id == checkpoint.rsplit("/", 1)[-1] and model.vocab_size == VOCAB
    with pytest.raises(InvalidArgument, match="tokenizer"):
        client.tokenize("hello")


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_worker(cluster, reference, client):
    d = cluster.dispatcher
    original = d.policy
    cluster.run(_set_policy(d, dataclasses.replace(original, local_prefill_below_tokens=32)))
    try:
        short, long = random_prompts([10, 100], VOCAB, seed=5)
        params = SamplingParams(max_tokens=8)
        want = reference_tokens(reference, [short, long], [params, params])
        a = client.generate(short, max_tokens=8)
        b = client.generate(long, max_tokens=8)
    finally:
        cluster.run(_set_policy(d, original))
    assert (a.token_ids, b.token_ids) == (want[0], want[1])
    assert a.final.prefill_worker == "" and a.final.transfer_ms == 0
    assert b.final.prefill_worker == "prefill-0"


def test_openai_http_endpoint_with_the_official_client(cluster, client):
    """The OpenAI-compatible endpoint, driven by the ``openai`` package itself."""
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0)
    (model,) = api.models.list().data
    prompt = random_prompts([30], VOCAB, seed=12)[0]
    out = api.completions.create(
        model=model.id, prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (30, 7)
    chunks = list(
        api.completions.create(
            model=model.id,
            prompt=prompt,
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 7
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model=model.id, prompt=prompt, max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="unknown model"):
        api.completions.create(model="gpt-5", prompt=prompt, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="n > 1"):
        api.completions.create(model=model.id, prompt=prompt, max_tokens=5, n=2)
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}


def test_bench_load_generator_against_the_live_cluster(cluster, client):
    """``splitserve bench serve``'s load generator: every request completes with the
    asked output length, and the metrics see every token."""
    import asyncio

    from splitserve.bench import workloads
    from splitserve.bench.metrics import compute_metrics
    from splitserve.bench.serve_bench import run_load

    reqs = workloads.random_requests(8, 40, 12, vocab_size=VOCAB, seed=3, range_ratio=0.5)
    arrivals = workloads.arrival_times(len(reqs), rate=20.0, seed=3)
    records, duration = asyncio.run(
        run_load(cluster.address, reqs, arrivals, max_concurrency=4, progress=False)
    )
    assert all(r.success for r in records)
    assert [r.output_len for r in records] == [q.output_len for q in reqs]
    assert [r.prompt_len for r in records] == [len(q.prompt_ids) for q in reqs]
    m = compute_metrics(records, duration, {"tpot": 10_000})
    assert m["completed"] == 8 and m["total_output_tokens"] == sum(q.output_len for q in reqs)
    assert m["slo_attainment"] == 1.0 and 0 < m["mean_ttft_ms"] <= m["mean_e2el_ms"]
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}


def test_a_restarted_prefill_worker_is_used_again(cluster, reference, client):
    """Ray restarts a killed prefill worker; its KV source comes back with a new
    incarnation and the decode worker reconnects to it. Requests in between get
    a clear UNAVAILABLE or succeed; none hangs. (Runs last: it kills a worker.)"""
    import time

    from splitserve.client import Unavailable

    (pw,) = cluster.dispatcher.prefill
    ray.kill(pw.handle, no_restart=False)
    prompt = random_prompts([40], VOCAB, seed=9)[0]
    (want,) = reference_tokens(reference, [prompt], [SamplingParams(max_tokens=6)])
    deadline = time.monotonic() + 120
    while True:
        try:
            got = client.generate(prompt, max_tokens=6, timeout=30)
            break
        except Unavailable:
            assert time.monotonic() < deadline, "the prefill worker never came back"
            time.sleep(0.5)
    assert got.token_ids == want and got.final.prefill_worker == "prefill-0"
    assert wait_kv_free(client) == {"prefill-0": 0, "decode-0": 0}
