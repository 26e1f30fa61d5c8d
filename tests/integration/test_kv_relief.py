"""Live migration instead of preemption: a decode worker whose KV cache fills up has
requests moved off, with their KV, to a worker with room (``router.moves.Moves.relieve``,
run by the router's stats poller: ``RouterServer(relief=...)``).

Two real decode workers running SmolLM2 in this process (``bench.migration_pause.
DecodePair``, KV over NIXL), 48 KV blocks (768 tokens) each. Four requests of 100
prompt tokens and 150 output tokens start on decode-0 (decode-1 drained meanwhile):
together they end holding ~1,000 tokens, so decode-0 alone must preempt, as the
control run shows. With relief on and decode-1 back, decode-0 preempts nothing,
requests moved (their KV imported, not computed), and every output is the greedy
tokens of the request run alone."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.bench.migration_pause import DecodePair
from splitserve.engine.engine import Engine
from splitserve.router.dispatch import Dispatcher
from splitserve.router.events import GenerateInput, TokenEvent
from splitserve.router.lifecycle import Phase
from splitserve.router.moves import Relief
from splitserve.router.server import RouterServer
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.waiting import until

pytestmark = [pytest.mark.needs_smollm2]

ENGINE = EngineConfig(
    model="smollm2", dtype="float32", num_kv_blocks=48, max_model_len=768, enable_prefix_caching=False
)
PARAMS = SamplingParams(max_tokens=150, ignore_eos=True)
PROMPTS = {f"r{i}": [(j * 7919 + i * 104729) % 40000 + 500 for j in range(100)] for i in range(4)}


@pytest.fixture(scope="module")
def pair():
    p = DecodePair(ENGINE)
    yield p
    p.close()


async def _tokens(d: Dispatcher, rid: str, prompt: list[int]) -> list[int]:
    out = []
    async for event in d.generate(GenerateInput(PARAMS, prompt=prompt, request_id=rid)):
        if isinstance(event, TokenEvent):
            out += event.token_ids
    return out


async def _on_decode_0_then_both(pair: DecodePair, tag: str) -> dict[str, list[int]]:
    """The four requests started on decode-0 alone; once all decode there, decode-1 is
    routable again (and relief, where the router has it, may move them)."""
    d = pair.dispatcher
    d.registry.drain("decode-1")
    tasks = {rid: asyncio.ensure_future(_tokens(d, f"{tag}-{rid}", p)) for rid, p in PROMPTS.items()}
    lives = d.moves.lives

    def all_decoding() -> bool:
        ours = [lf for rid, lf in lives.items() if rid.startswith(tag)]
        return len(ours) == len(PROMPTS) and all(lf.phase is Phase.DECODING for lf in ours)

    await until(all_decoding, "the four requests decode on decode-0", 300)
    await d.registry.activate("decode-1")
    return {rid: await t for rid, t in tasks.items()}


def _imported(pair: DecodePair) -> int:
    """Prompt tokens whose KV moved into either worker, ever."""
    return sum(pair.run(c.stats()).engine.import_moved_tokens for c in pair.clients.values())


def _preemptions(pair: DecodePair, wid: str) -> int:
    return pair.run(pair.clients[wid].stats()).engine.num_preemptions


def test_a_filling_decode_worker_moves_requests_off_instead_of_preempting(pair):
    d = pair.dispatcher
    # each request's greedy tokens as if run alone (float32: batching changes no token here)
    out = Engine(ENGINE).generate(list(PROMPTS.values()), PARAMS)
    alone = {rid: o.token_ids for rid, o in zip(PROMPTS, out)}

    # control: no relief, so decode-0 must preempt to finish all four
    before = _preemptions(pair, "decode-0")
    control = pair.run(_on_decode_0_then_both(pair, "control"))
    preempted = _preemptions(pair, "decode-0") - before
    assert preempted > 0
    assert control == alone  # preempted and recomputed, whole

    server = RouterServer(d, "disaggregated", "127.0.0.1", 0, stats_interval_s=0.05, relief=Relief(0.65, 0.6))
    pair.run(server.start())
    try:
        before = _preemptions(pair, "decode-0")
        imported = _imported(pair)
        moved = d.moves.moved["kv_full"]
        relieved = pair.run(_on_decode_0_then_both(pair, "relief"))
    finally:
        pair.run(server.stop(0.5))
    print(f"without relief: {preempted} preemption(s); with it: {d.moves.moved['kv_full'] - moved} move(s)")
    assert relieved == alone  # moved mid-stream, nothing repeated, skipped or changed
    assert _preemptions(pair, "decode-0") == before
    assert d.moves.moved["kv_full"] > moved
    # the moved requests' KV came over (each holds its prompt at least), not computed
    # again; either way: once decode-1 fills up in turn, a request may move back
    assert _imported(pair) - imported >= 100 * (d.moves.moved["kv_full"] - moved)
