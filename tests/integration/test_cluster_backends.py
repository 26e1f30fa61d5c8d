"""The disaggregated cluster end to end, once per KV transfer backend (nixl,
torch_dist, ray): real Ray actors, the real gRPC router and SDK over
localhost, a tiny random-weight model (float32). One Ray instance and one
cluster per backend.

For each backend: 32 concurrent streams equal the monolithic engine's greedy
output; cancel and deadlines free every block; the prefill worker gives a
request's KV up at the decode worker's pull (confirmed), not at the end of the
request; handshakes cross once per peer pair; a restarted prefill worker is
re-handshaken and used again."""

from __future__ import annotations

import time

import pytest
import ray

from splitserve.client import Chunk, DeadlineExceeded, Unavailable
from splitserve.cluster.worker_client import remote_calls
from splitserve.kv_transfer import CLUSTER_BACKENDS
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import (
    VOCAB,
    kv_used,
    live_cluster,
    mixed_workload,
    reference_tokens,
    scrape,
    stream_all,
    tiny_config,
    total,
    wait_kv_free,
)
from tests.waiting import wait_until

IDLE = {"prefill-0": 0, "decode-0": 0}


@pytest.fixture(scope="module", params=CLUSTER_BACKENDS)
def cluster(request, checkpoint):
    # A long lease: a KV export that is freed during the stream was freed by the pull's
    # confirmation, never by the lease running out.
    config = tiny_config(checkpoint, transfer={"backend": request.param, "lease_s": 300})
    with live_cluster(config) as c:
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
            # the decode worker pulled its KV; the handover the client waited for beyond the
            # first token may be none (the KV had landed before the router passed that token on)
            assert f.decode_worker == "decode-0" and f.kv_pull_ms > 0 and f.transfer_ms >= 0
    # Streaming, not one final blob: long outputs arrive in several chunks.
    assert max(chunks for _, chunks in results) > 3
    assert wait_kv_free(client) == IDLE
    # nixl streams handoffs layer by layer (transfer.stream_layers); the others pull whole
    # caches. A prompt whose last step had finished before the prefill worker could
    # announce it goes whole with nixl too (its result is already there): on a busy
    # machine some do.
    metrics = scrape(cluster)
    streamed = total(metrics, "splitserve:kv_handoffs_total", mode="streamed")
    whole = total(metrics, "splitserve:kv_handoffs_total", mode="whole")
    if cluster.cluster.config.transfer.backend == "nixl":
        assert streamed > 0
    else:
        assert streamed == 0 and whole > 0


def test_cancel_mid_stream_frees_every_block(client):
    prompt = random_prompts([200], VOCAB, seed=3)[0]
    stream = client.stream(prompt, temperature=0, max_tokens=800, ignore_eos=True)
    for _ in range(3):
        next(stream)
    assert kv_used(client)["decode-0"] > 0  # the request holds blocks now
    stream.close()  # the client cancels the call
    assert wait_kv_free(client) == IDLE
    assert client.cluster_status().inflight_requests == 0


@pytest.mark.parametrize("how", ["timeout_ms", "grpc_deadline"])
def test_deadline_ends_the_call_and_frees_blocks(client, how):
    prompt = random_prompts([50], VOCAB, seed=4)[0]
    kwargs = {"timeout_ms": 300} if how == "timeout_ms" else {"timeout": 0.3}
    with pytest.raises(DeadlineExceeded):
        client.generate(prompt, temperature=0, max_tokens=960, ignore_eos=True, **kwargs)
    assert wait_kv_free(client) == IDLE


def _prefill_stats(cluster):
    (pw,) = cluster.registry.workers("prefill")
    return cluster.run(pw.client.stats())


def test_prefill_kv_is_freed_at_the_pull_not_at_the_end(cluster, client):
    """A long generation: once the decode worker has pulled the KV (its first token
    arrives), the prefill worker holds no export for the request, while the stream
    still runs; the export ended by confirmation (not by the lease, which is 300 s,
    nor by an abort)."""
    before = _prefill_stats(cluster)
    prompt = random_prompts([120], VOCAB, seed=21)[0]
    stream = client.stream(prompt, temperature=0, max_tokens=600, ignore_eos=True, request_id="long-1")
    first = [next(stream) for _ in range(2)]  # the prefill token, then the decode worker's first
    assert all(isinstance(c, Chunk) for c in first)
    pulled_at = time.monotonic()
    wait_until(lambda: "long-1" not in _prefill_stats(cluster).exports, "the export freed", 60, 0.01)
    st = _prefill_stats(cluster)
    freed_after_s = time.monotonic() - pulled_at
    item = next(stream)  # the stream is still running after the export was freed
    assert isinstance(item, Chunk)
    assert st.leases_confirmed == before.leases_confirmed + 1
    assert (st.leases_expired, st.leases_released) == (before.leases_expired, before.leases_released)
    backend = cluster.cluster.config.transfer.backend
    print(f"{backend}: export freed {freed_after_s * 1000:.0f} ms after the pull")
    rest = list(stream)
    assert rest[-1].finish_reason == "length"
    assert wait_kv_free(client) == IDLE


def _incarnations(pw) -> tuple[str, ...] | None:
    """The incarnations a prefill worker's handshakes name now; None while it does not
    answer (dead, restarting)."""
    try:
        info = ray.get(pw.client.actor.info.remote(), timeout=30)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # unavailable included
        return None
    return tuple(hs.incarnation for hs in info.handshakes)


def _decode_peers(cluster) -> dict[str, tuple[str, ...]]:
    """The prefill incarnations the decode worker holds handshakes of, as it reports them."""
    (dw,) = cluster.registry.workers("decode")
    return ray.get(dw.client.actor.stats.remote()).peers


def test_handshakes_cross_once_per_peer_pair(cluster, client):
    """Many requests over one (prefill, decode) pair: the decode worker links to the
    prefill worker itself, once per incarnation, and holds exactly its handshakes."""
    prompts, params = mixed_workload(8, seed=13)
    stream_all(cluster.address, prompts, params)
    (pw,) = cluster.registry.workers("prefill")
    incarnations = tuple(hs.incarnation for hs in ray.get(pw.client.actor.info.remote()).handshakes)
    assert _decode_peers(cluster) == {"prefill-0": incarnations}


def test_the_router_sends_one_call_per_request_and_relays_nothing(cluster, client):
    """One streamed disaggregated request, on a linked pair: the router makes no Ray
    call for it (it starts the request over its gRPC connection to the decode worker,
    opened once per worker, which also carries the tokens), and aborts nothing on
    success; the decode worker calls the prefill worker for the prompt (and confirms
    the transfer, where the backend has no channel of its own for that). Nothing goes
    from one worker to the other through the router."""
    (dw,) = cluster.registry.workers("decode")
    prompt = random_prompts([60], VOCAB, seed=31)[0]
    list(client.stream(prompt, temperature=0, max_tokens=4))  # linked, streams open
    remote_calls(reset=True)
    remote_calls(dw.client.actor, reset=True)
    chunks = list(client.stream(prompt, temperature=0, max_tokens=8, ignore_eos=True))
    assert chunks[-1].finish_reason == "length"
    router = {m: n for m, n in remote_calls().items() if m != "stats"}  # stats: the poller's
    decode = remote_calls(dw.client.actor)
    backend = cluster.cluster.config.transfer.backend
    print(f"{backend}: router -> worker {router}; decode -> prefill {decode}")
    assert router == {}
    assert decode.pop("prefill_stream") == 1 and decode.pop("confirm", 1) == 1 and decode == {}


def test_a_restarted_prefill_worker_is_used_again(cluster, reference, client):
    """Ray restarts a killed prefill worker; its KV source comes back with a new
    incarnation, which the decode worker notices in the next handoff and links to.
    Requests in between get a clear UNAVAILABLE or succeed (the decode worker
    prefilling them); none hangs. The test ends with the cluster
    serving again, so its place in the module does not matter."""
    (pw,) = cluster.registry.workers("prefill")
    old = _incarnations(pw)
    ray.kill(pw.client.actor, no_restart=False)  # it dies a moment later: it may serve one more
    prompt = random_prompts([40], VOCAB, seed=9)[0]
    (want,) = reference_tokens(reference, [prompt], [SamplingParams(max_tokens=6)])

    def prefilled_there() -> bool:
        now = _incarnations(pw)  # before the request: a new one means the old one is gone
        try:
            got = client.generate(prompt, temperature=0, max_tokens=6, timeout=30)
        except Unavailable:
            return False
        assert got.token_ids == want  # meanwhile, with no prefill worker left, the decode worker prefills it
        return now not in (None, old) and got.final.prefill_worker == "prefill-0"

    wait_until(prefilled_there, "the prefill worker back, prefilling", 120, 0.5)
    new = _incarnations(pw)
    assert new not in (None, old) and _decode_peers(cluster)["prefill-0"] == new
    assert wait_kv_free(client) == IDLE
