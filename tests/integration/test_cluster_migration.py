"""Live migration on a live cluster: real Ray actors (one prefill and two decode
workers of the tiny model), NIXL, the router's gRPC door. ``splitserve drain``
on the decode worker a request streams from moves it to the other with its KV
(``RayDecodeWorker.move_out``, the new worker pulling from the old one through
``RayDecodePeer``, most of it ahead of the switch): the client's tokens equal the monolithic engine's greedy
tokens, none repeated or skipped, the trace says its KV was pulled (no transfer failed,
nothing computed again), and no KV stays held. A worker killed during a move leaves the
request whole by computing it again: the trace says so."""

from __future__ import annotations

import asyncio
import os

import pytest

from splitserve.client import Client, Final
from splitserve.cluster.pools import START_TIMEOUT_S
from splitserve.engine.engine import Engine
from splitserve.router.registry import Membership
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import WorkerLost
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import (
    VOCAB,
    assert_move_pulled,
    drain_mid_stream,
    live_cluster,
    process_exited,
    tiny_config,
    trace_of,
    transfer_failures,
    wait_kv_free,
    wait_until,
)
from tests.integration.holding import Hold, hold
from tests.waiting import until

POOL = {"num_cpus": 0.5, "engine": {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}}
MAX_TOKENS = 600  # long enough to be mid-stream when the drain comes


@pytest.fixture(scope="module")
def cluster(checkpoint):
    config = tiny_config(checkpoint, prefill=POOL, decode={**POOL, "replicas": 2})
    with live_cluster(config) as c:
        yield c


@pytest.fixture(autouse=True)
def undrained(cluster):
    """After each test, a decode worker it drained is routed to again, whether the test
    passed or failed (a drained worker stays so until removed: the tests after it would
    find one decode worker where they move requests between two)."""
    yield
    for w in cluster.registry.workers("decode"):
        if w.state is Membership.DRAINING and w.alive:
            cluster.run(cluster.registry.activate(w.worker_id), timeout=60)


def test_draining_the_worker_a_request_streams_from_moves_it_whole(cluster, checkpoint, capsys):
    (prompt,) = random_prompts([60], VOCAB, seed=31)
    engine = Engine(EngineConfig(model=checkpoint, dtype="float32", kv_cache_memory_mib=16))
    (want,) = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    with Client(cluster.address, timeout=120) as client:
        failures = transfer_failures(client)
        tokens, final, drained = drain_mid_stream(cluster, client, prompt, "moving", MAX_TOKENS)
        st = client.cluster_status(traces=1)
        wait_kv_free(client)
        assert transfer_failures(client) == failures  # the move's pull did not fail
    assert tokens == want.token_ids  # nothing repeated, skipped or changed
    assert final.decode_worker not in ("", drained)
    assert f"{drained} drained: 1 request(s) moved off, 0 left" in capsys.readouterr().out
    assert_move_pulled(trace_of(st.traces, "moving"), to=final.decode_worker)
    taker = cluster.run(cluster.registry.get(final.decode_worker).client.stats(), timeout=60).engine
    assert taker.import_precopied_tokens > 0  # its full blocks were copied ahead of the switch


def _moving_stream(cluster, prompt, rid: str, on_tokens) -> tuple[list[int], Final]:
    """A greedy stream of ``prompt``, held on its decode worker at its 10th token
    (``holding.hold``); ``on_tokens(n, held)`` after each chunk (n tokens so far), which
    releases ``held`` once it moved the request (the stream would hang at 10 otherwise;
    the hold ends with the stream in any case)."""
    tokens, final = [], None
    options = dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0, request_id=rid)
    with hold(cluster, rid, at=10) as held, Client(cluster.address, timeout=120) as client:
        for item in client.stream(prompt, **options):
            if isinstance(item, Final):
                final = item
                continue
            tokens += item.token_ids
            on_tokens(len(tokens), held)
    return tokens, final


@pytest.mark.parametrize("killed", ["source", "destination"])
def test_a_worker_killed_during_a_move_leaves_the_request_whole(cluster, checkpoint, killed, monkeypatch):
    """The worker a request moves from is killed right after it exported the KV, and
    gone before the new one pulls (the new one recomputes the request: its pull fails,
    a transfer failure, or, where its stream there broke before it let the request go,
    it resumes it), or the one it moves to is killed as the move starts (the old one
    recomputes it: redirected, its start there failed, or resumed, if it had started):
    either way the client's tokens are the engine's greedy tokens, whole; nothing hangs
    and no KV stays held. The pool replaces the killed worker."""
    import ray

    (prompt,) = random_prompts([60], VOCAB, seed=43 if killed == "source" else 47)
    engine = Engine(EngineConfig(model=checkpoint, dtype="float32", kv_cache_memory_mib=16))
    (want,) = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    d, rid, moved = cluster.dispatcher, f"killed-{killed}", []

    async def until_gone(w, pid: int) -> None:
        """Until ``w``'s actor answers no more and its process ``pid`` has exited (Ray
        kills an actor asynchronously, and calls it dead before its process is: until
        then the process still serves pulls of its memory)."""
        while True:
            try:
                await w.client.stats()
            except WorkerLost:
                break
            await asyncio.sleep(0.05)
        await until(lambda: process_exited(pid), f"{w.worker_id}'s process {pid} exited")

    def kill_during_move(n: int, held: Hold) -> None:
        if moved or n < 10:
            return
        life = d.moves.lives[rid]
        old = life.decode_worker
        (new,) = [w for w in cluster.registry.routable("decode") if w is not old]
        if killed == "source":
            real = old.client.move_out
            pid = ray.get(old.client.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)

            async def move_out_then_die(request_id, export=True, from_block=0):
                out = await real(request_id, export, from_block)
                ray.kill(old.client.actor, no_restart=True)
                await asyncio.wait_for(until_gone(old, pid), 60)  # no pull can reach it now
                return out

            monkeypatch.setattr(old.client, "move_out", move_out_then_die)
        else:
            ray.kill(new.client.actor, no_restart=True)
        try:
            cluster.run(d.moves.migrate(rid, to=new.worker_id), timeout=120)
        finally:
            held.release()
        moved.append((old.worker_id, new.worker_id))

    def two() -> bool:  # the pool replaces a killed worker: as long as a start may take
        return len(cluster.registry.routable("decode")) == 2

    wait_until(two, "two decode workers to move between", timeout=START_TIMEOUT_S)
    with Client(cluster.address, timeout=120) as client:
        failures = transfer_failures(client)
        tokens, final = _moving_stream(cluster, prompt, rid, kill_during_move)
        trace = trace_of(client.cluster_status(traces=5).traces, rid)
        failed = transfer_failures(client)
        assert moved and tokens == want.token_ids and final.finish_reason == "length"
        ((old, new),) = moved
        marks = [(m.name, m.worker) for m in trace.marks]
        if killed == "source":  # computed again on the new worker: nothing was pulled
            recomputed = ("kv_recompute", new) in marks  # its pull from the killed worker failed
            assert recomputed or ("resumed", new) in marks, str(marks)
            assert "move_pulled" not in [name for name, _ in marks], str(marks)
            assert final.decode_worker == new, final
            assert sum(failed.values()) == sum(failures.values()) + recomputed, (failures, failed)
        else:  # computed again on the old worker
            assert ("redirected", old) in marks or ("resumed", old) in marks, str(marks)
            assert final.decode_worker == old, final
            assert failed == failures
        wait_until(two, "the pool replaced the killed worker", timeout=START_TIMEOUT_S)
        wait_kv_free(client, timeout=60)
