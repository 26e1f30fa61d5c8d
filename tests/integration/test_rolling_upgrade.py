"""A rolling upgrade on a live cluster, under load: real Ray actors (one prefill and
one decode worker of the tiny model, revision A), NIXL, the gRPC door. ``splitserve
upgrade --model B`` (another checkpoint of the same shapes: revision B) replaces
both workers while clients stream requests without a pause: no request fails;
each request's tokens are revision A's greedy tokens or revision B's, never a
mix (no request prefilled by one revision and decoded by the other: the traces
name both phases' revisions, and they agree); afterwards every worker serves B.
Where no replacement fits beside the old workers, they are replaced in place, with
the same guarantees; where in place would leave a pool empty, the upgrade is
refused at once, naming what it needs. Each test runs a cluster of its own."""

from __future__ import annotations

import threading

import pytest

from splitserve.cli.main import main
from splitserve.client import Client
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import make_hf_checkpoint, random_prompts
from tests.integration.cluster_util import VOCAB, live_cluster, tiny_config, wait_kv_free

POOL = {"num_cpus": 0.5, "engine": {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}}
PROMPTS = random_prompts([20, 50, 90, 130], VOCAB, seed=41)
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def revision_b(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("revision-b")
    make_hf_checkpoint("llama", directory, seed=1)  # the same shapes, other weights
    return str(directory)


def _reference(model: str) -> list[list[int]]:
    engine = Engine(EngineConfig(model=model, dtype="float32", kv_cache_memory_mib=16))
    return [c.token_ids for c in engine.generate(PROMPTS, PARAMS)]


def _load(address: str, done: threading.Event, outcomes: list, k: int) -> None:
    """Greedy requests one after another until ``done``: (prompt index, tokens or error)."""
    i = k
    with Client(address, timeout=120) as c:
        while not done.is_set():
            try:
                out = c.generate(PROMPTS[i % len(PROMPTS)], max_tokens=24, ignore_eos=True, temperature=0.0)
                outcomes.append((i % len(PROMPTS), out.token_ids))
            except Exception as e:  # counted: the goal is none
                outcomes.append((i % len(PROMPTS), e))
            i += 1


def _upgrade_under_load(address: str, model: str, clients: int) -> list:
    """``splitserve upgrade --model model`` (it must succeed) while ``clients`` threads
    send greedy requests without a pause; the requests' outcomes (``_load``'s), once
    every thread has ended."""
    done, outcomes = threading.Event(), []
    threads = [threading.Thread(target=_load, args=(address, done, outcomes, k)) for k in range(clients)]
    for t in threads:
        t.start()
    try:
        assert main(["upgrade", "--model", model, "--server", address]) == 0
    finally:
        done.set()
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads)
    return outcomes


def test_every_worker_is_replaced_under_load_and_no_request_mixes_revisions(checkpoint, revision_b, capsys):
    """Room to surge (one prefill and one decode worker of 0.5 CPU on 2 CPUs): each
    replacement starts beside the worker it replaces."""
    with live_cluster(tiny_config(checkpoint, prefill=POOL, decode=POOL)) as cluster:
        want = {"A": _reference(checkpoint), "B": _reference(revision_b)}
        assert want["A"] != want["B"]
        with Client(cluster.address, timeout=120) as client:
            before = {w.worker_id: w.revision for p in client.cluster_status().pools for w in p.workers}
        assert len(set(before.values())) == 1
        outcomes = _upgrade_under_load(cluster.address, revision_b, clients=3)
        printed = capsys.readouterr().out
        assert "upgraded: 2 worker(s) started" in printed and "2 stopped" in printed

        errors = [o for _, o in outcomes if isinstance(o, Exception)]
        assert errors == [] and len(outcomes) >= 6
        served = {"A": 0, "B": 0}
        for i, tokens in outcomes:
            (which,) = [r for r in ("A", "B") if tokens == want[r][i]]  # one revision's, whole
            served[which] += 1
        with Client(cluster.address, timeout=120) as client:
            st = client.cluster_status(traces=100)
            after = {w.worker_id: w.revision for p in st.pools for w in p.workers}
            wait_kv_free(client)
        assert not set(after) & set(before) and len(set(after.values())) == 1
        assert set(after.values()) != set(before.values())
        for t in st.traces:
            if t.prefill_revision:
                assert t.prefill_revision == t.decode_revision, t.request_id
        assert served["B"] >= 1  # the upgrade ran under load: both revisions served


def test_with_no_room_to_surge_the_workers_are_replaced_in_place_under_load(checkpoint, revision_b, capsys):
    """One prefill (0.5 CPU) and two decode workers (0.75 each) fill the 2 CPUs: no new
    worker fits beside them, so each old one goes (its requests move to the other decode
    worker; while the prefill worker is replaced, the decode workers prefill) before its
    replacement starts in its room. No request fails, none mixes revisions."""
    decode = {**POOL, "num_cpus": 0.75, "replicas": 2}
    with live_cluster(tiny_config(checkpoint, prefill=POOL, decode=decode)) as cluster:
        want = {"A": _reference(checkpoint), "B": _reference(revision_b)}
        with Client(cluster.address, timeout=120) as client:
            before = {w.worker_id for p in client.cluster_status().pools for w in p.workers}
        outcomes = _upgrade_under_load(cluster.address, revision_b, clients=2)
        printed = capsys.readouterr().out
        assert "upgraded: 3 worker(s) started" in printed and "3 stopped" in printed
        assert ": stopped" in printed and ": active" in printed  # progress, worker by worker
        errors = [o for _, o in outcomes if isinstance(o, Exception)]
        assert errors == [] and len(outcomes) >= 4
        for i, tokens in outcomes:
            assert tokens in (want["A"][i], want["B"][i])  # one revision's, whole
        with Client(cluster.address, timeout=120) as client:
            st = client.cluster_status(traces=100)
            wait_kv_free(client)
        after = {w.worker_id: w.revision for p in st.pools for w in p.workers}
        assert not set(after) & before and len(after) == 3 and len(set(after.values())) == 1
        for t in st.traces:
            if t.prefill_revision:
                assert t.prefill_revision == t.decode_revision, t.request_id


def test_an_upgrade_that_cannot_start_is_refused_at_once_naming_what_it_needs(checkpoint, revision_b):
    """The default cluster's shape (one prefill and one decode worker of 1 CPU each) on 2
    CPUs: no room to surge, and in place would leave no decode worker. The upgrade is
    refused with FAILED_PRECONDITION and a sentence, and nothing changed."""
    from splitserve.client.errors import FailedPrecondition

    pool = {**POOL, "num_cpus": 1}
    with live_cluster(tiny_config(checkpoint, prefill=pool, decode=pool)) as cluster:
        with Client(cluster.address, timeout=120) as client:
            before = {w.worker_id: w.revision for p in client.cluster_status().pools for w in p.workers}
            with pytest.raises(FailedPrecondition) as caught:
                client.upgrade("", revision_b, 1)
            message = caught.value.details
            assert "1 decode worker(s) of 1 x {CPU: 1}" in message and "CPU 0 free" in message
            assert "leave the decode pool with no worker" in message and "nothing was changed" in message
            assert main(["upgrade", "--model", revision_b, "--server", cluster.address]) == 1
            after = {w.worker_id: w.revision for p in client.cluster_status().pools for w in p.workers}
            out = client.generate(PROMPTS[0], max_tokens=24, ignore_eos=True, temperature=0.0)
        assert after == before
        assert out.token_ids == _reference(checkpoint)[0]  # still serving, still revision A
