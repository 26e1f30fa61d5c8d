"""Elastic workers (``elastic_worker.worker``): one engine, loaded once, serving as a
prefill worker, a decode worker, or both. Two of them in this process over NIXL (no
Ray, the tiny model): A prefills for B's decodes; then the roles swap (B prefills for
A) with the same engines and weights, nothing reloaded; then A does both at once
(prefills for B and decodes a prompt it prefills itself). Every request's greedy
tokens equal the monolithic engine's, every handed-over request's KV was pulled (not
computed: the decode side prefilled none of its prompt), and afterwards neither worker
holds a block."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.cluster.role_switch import switch_role
from splitserve.decode_worker.in_process import InProcessDecodeClient
from splitserve.elastic_worker.worker import ElasticWorker
from splitserve.engine.engine import Engine
from splitserve.router.dispatch import Dispatcher
from splitserve.router.events import GenerateInput, TokenEvent
from splitserve.router.policy import PolicySpec
from splitserve.router.registry import WorkerRegistry
from splitserve.router.roles import Role
from splitserve.wire.config import EngineConfig
from splitserve.wire.decode import DecodeTask, DecodeWorkerSpec
from splitserve.wire.prefill import PrefillWorkerSpec
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import assert_move_pulled
from tests.waiting import until, wait_until

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
DEADLINE_S = 300  # a broken handover must fail the test, not hang it


def _elastic(worker_id: str, engine: EngineConfig) -> ElasticWorker:
    prefill = PrefillWorkerSpec(worker_id, engine, "nixl", 30.0, torch_threads=1)
    decode = DecodeWorkerSpec(worker_id, engine, "nixl", 30.0, 8, torch_threads=1)
    return ElasticWorker(prefill, decode)


async def _serve(decoder: ElasticWorker, tasks: list[DecodeTask]) -> dict[str, tuple[list[int], bool]]:
    """Run ``tasks`` on ``decoder``'s decode half: each request's tokens, and whether its
    KV was pulled from elsewhere."""
    got = {t.request_id: ([], False) for t in tasks}
    stream = decoder.stream(f"test-{tasks[0].request_id}")
    for task in tasks:
        await decoder.start(f"test-{tasks[0].request_id}", task)
    left = set(got)
    while left:
        for batch in await anext(stream):
            assert batch.error is None, batch.error
            tokens, pulled = got[batch.request_id]
            got[batch.request_id] = (tokens + batch.token_ids, pulled or batch.transfer_s is not None)
            if batch.finish_reason is not None:
                left.discard(batch.request_id)
    await stream.aclose()
    return got


@pytest.fixture(scope="module")
def workers(checkpoint):
    engine = EngineConfig(model=checkpoint, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=256)
    a, b = _elastic("elastic-a", engine), _elastic("elastic-b", engine)
    yield engine, a, b
    a.shutdown()
    b.shutdown()


def test_an_elastic_worker_prefills_decodes_and_switches_role_without_reloading(workers):
    engine, a, b = workers
    prompts = random_prompts([40, 90, 130, 70, 55], 512, seed=5)
    expected = [c.token_ids for c in Engine(engine).generate(prompts, PARAMS)]
    weights = {w.worker_id: w.engine.runner.model for w in (a, b)}

    def handed(prefiller: ElasticWorker, rid: str, i: int) -> DecodeTask:
        return DecodeTask(rid, prompts[i], PARAMS, source=prefiller.prefill)

    async def scenario():
        # A in the prefill role, B in the decode role
        first = await _serve(b, [handed(a, "ab-0", 0), handed(a, "ab-1", 1)])
        # roles swapped: B prefills, A decodes, on the same engines
        second = await _serve(a, [handed(b, "ba-2", 2), handed(b, "ba-3", 3)])
        # A in both roles at once: it prefills for B while it decodes one it prefills itself
        both = await asyncio.gather(
            _serve(b, [handed(a, "ab-4", 4)]), _serve(a, [DecodeTask("a-local-0", prompts[0], PARAMS)])
        )
        return first, second, both

    first, second, (to_b, local) = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    for got, want in [
        (first["ab-0"], expected[0]),
        (first["ab-1"], expected[1]),
        (second["ba-2"], expected[2]),
        (second["ba-3"], expected[3]),
        (to_b["ab-4"], expected[4]),
    ]:
        assert got == (want, True)  # the greedy tokens, with the KV pulled from the other
    assert local["a-local-0"] == (expected[0], False)  # prefilled where it decodes
    for w in (a, b):  # one engine and its weights all along: nothing was reloaded
        assert w.prefill.engine is w.engine
        assert w.engine.runner.model is weights[w.worker_id]
    # the decode halves computed no prompt they were handed: every one of their tokens came
    assert asyncio.run(b.stats()).engine.import_moved_tokens >= len(prompts[0]) + len(prompts[1])
    assert asyncio.run(a.stats()).engine.import_moved_tokens >= len(prompts[2]) + len(prompts[3])

    def nothing_held() -> bool:
        return all(asyncio.run(w.stats()).engine.num_used_blocks == 0 for w in (a, b))

    wait_until(nothing_held, "both workers free every block (exports confirmed, requests ended)")


def test_an_elastic_worker_refuses_what_it_cannot_be(checkpoint):
    engine = EngineConfig(model=checkpoint, dtype="float32", num_kv_blocks=64)
    other = EngineConfig(model=checkpoint, dtype="float32", num_kv_blocks=32)
    prefill = PrefillWorkerSpec("e", engine, "nixl", 30.0)
    with pytest.raises(ValueError, match="one worker with one engine"):
        ElasticWorker(prefill, DecodeWorkerSpec("e", other, "nixl", 30.0, 8))
    with pytest.raises(ValueError, match="needs a backend"):
        ElasticWorker(prefill, DecodeWorkerSpec("e", engine, None, 30.0, 8))


@pytest.fixture(scope="module")
def three(checkpoint):
    engine = EngineConfig(model=checkpoint, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=256)
    ws = {name: _elastic(f"elastic-{name}", engine) for name in "abc"}
    yield engine, ws
    for w in ws.values():
        w.shutdown()


def test_roles_switch_under_load_through_the_router_and_lose_nothing(three):
    """The router's dispatcher over three elastic workers (a: prefill; b, c: decode)
    while clients stream: c switches to prefill (its running requests move to b with
    their KV: each one's trace shows the pull, and no transfer failed), then a to decode
    (its exports pulled first). Every request's tokens equal the monolithic engine's;
    after the switches c prefills requests and a decodes them; c's decode half holds
    nothing; every worker frees every block."""
    engine, ws = three
    a, b, c = ws["a"], ws["b"], ws["c"]
    prompts = random_prompts([30 + 17 * i for i in range(18)], 512, seed=9)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = [x.token_ids for x in Engine(engine).generate(prompts, params)]

    async def scenario():
        registry = WorkerRegistry()
        registry.add("elastic-a", Role.PREFILL, a.prefill, engine.block_size)
        for w in (b, c):
            registry.add(w.worker_id, Role.DECODE, InProcessDecodeClient(w), engine.block_size)
        for w in (a, b, c):
            await registry.activate(w.worker_id)
        policy = PolicySpec(conditional_disaggregation=False)  # every prompt goes to a prefill worker
        d = Dispatcher(registry, a.engine.validator, "tiny", policy=policy)
        streams: dict[int, list[int]] = {}

        async def request(i: int) -> None:
            streams[i] = []
            inp = GenerateInput(params, prompt=prompts[i], request_id=f"r{i}")
            async for event in d.generate(inp):
                if isinstance(event, TokenEvent):
                    streams[i] += event.token_ids

        def wave(ids: range) -> list[asyncio.Future]:
            return [asyncio.ensure_future(request(i)) for i in ids]

        first = wave(range(0, 6))
        await until(lambda: all(len(streams.get(i, ())) >= 3 for i in range(6)), "the first wave decoding")
        took = [await switch_role(registry, c.worker_id, Role.PREFILL, c.prefill, d.moves.move_off)]
        second = wave(range(6, 12))
        await until(
            lambda: all(len(streams.get(i, ())) >= 3 for i in range(6, 12)), "the second wave decoding"
        )
        a_decode = InProcessDecodeClient(a)
        took.append(await switch_role(registry, a.worker_id, Role.DECODE, a_decode, d.moves.move_off))
        third = wave(range(12, 18))
        await asyncio.gather(*first, *second, *third)
        roles = {w.worker_id: w.role for w in registry.workers()}
        return streams, d.traces.latest(18), roles, d.moves.moved["drain"], took, d.transfer_failures

    streams, traces, roles, moved, took, failures = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    print(f"switches took {', '.join(f'{t:.2f} s' for t in took)}; {moved} request(s) moved off c")
    assert [streams[i] for i in range(18)] == expected  # nothing lost, repeated or changed
    # c's running requests moved, each with its KV: pulled on b, nothing recomputed
    moved_off = [t for t in traces if any(m.name == "moved" for m in t.marks)]
    assert moved > 0 and len(moved_off) == moved, (moved, [t.request_id for t in moved_off])
    for t in moved_off:
        assert_move_pulled(t, to="elastic-b")
    assert not failures, failures  # no KV transfer failed (a failed pull is recomputed)
    assert roles == {"elastic-a": Role.DECODE, "elastic-b": Role.DECODE, "elastic-c": Role.PREFILL}
    late = [t for t in traces if int(t.request_id[1:]) >= 12]
    assert {t.prefill_worker for t in late} == {"elastic-c"}  # c prefills now (a is a decode worker)
    assert "elastic-a" in {t.decode_worker for t in late}  # and a decodes
    assert not len(c.requests)  # c's decode half holds no request

    def nothing_held() -> bool:
        return all(asyncio.run(w.stats()).engine.num_used_blocks == 0 for w in (a, b, c))

    wait_until(nothing_held, "every worker frees every block once its role's work is done")
