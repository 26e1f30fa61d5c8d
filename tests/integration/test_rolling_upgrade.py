"""A rolling upgrade on a live cluster, under load: real Ray actors (one prefill and
one decode worker of the tiny model, revision A), NIXL, the gRPC door. ``splitserve
upgrade --model B`` (another checkpoint of the same shapes: revision B) replaces
both workers while clients stream requests without a pause: no request fails;
each request's tokens are revision A's greedy tokens or revision B's, never a
mix (no request prefilled by one revision and decoded by the other: the traces
name both phases' revisions, and they agree); afterwards every worker serves B."""

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


@pytest.fixture(scope="module")
def cluster(checkpoint):
    with live_cluster(tiny_config(checkpoint, prefill=POOL, decode=POOL)) as c:
        yield c


def _reference(model: str) -> list[list[int]]:
    engine = Engine(EngineConfig(model=model, dtype="float32", kv_cache_memory_mib=16))
    return [c.token_ids for c in engine.generate(PROMPTS, PARAMS)]


def test_every_worker_is_replaced_under_load_and_no_request_mixes_revisions(
    cluster, checkpoint, revision_b, capsys
):
    want = {"A": _reference(checkpoint), "B": _reference(revision_b)}
    assert want["A"] != want["B"]
    with Client(cluster.address, timeout=120) as client:
        before = {w.worker_id: w.revision for p in client.cluster_status().pools for w in p.workers}
    assert len(set(before.values())) == 1

    done = threading.Event()
    outcomes: list[tuple[int, list[int] | Exception]] = []

    def load(k: int) -> None:
        i = k
        with Client(cluster.address, timeout=120) as c:
            while not done.is_set():
                try:
                    out = c.generate(
                        PROMPTS[i % len(PROMPTS)], max_tokens=24, ignore_eos=True, temperature=0.0
                    )
                    outcomes.append((i % len(PROMPTS), out.token_ids))
                except Exception as e:  # counted: the goal is none
                    outcomes.append((i % len(PROMPTS), e))
                i += 1

    threads = [threading.Thread(target=load, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        assert main(["upgrade", "--model", revision_b, "--server", cluster.address]) == 0
    finally:
        done.set()
        for t in threads:
            t.join(120)
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
