"""Live migration through the real request path, in this process: the router's
dispatcher in front of two real decode workers running SmolLM2
(``bench.migration_pause.DecodePair``: ``DecodeWorker`` behind
``InProcessDecodeClient``, no Ray), whose KV moves over NIXL (host
memory). A request moved mid-stream (``router.moves.Moves.migrate``) keeps its stream
whole: greedy, seeded and JSON-schema requests give the tokens and text of an
undisturbed run, none repeated or skipped (a speculating one's drafts all still
kept after the move: the new worker's draft catches up from the tokens); the KV moved (each
request's trace shows the new worker's pull and no recompute, no transfer failed; the new
worker imported it, prefilled nothing; it copied the full blocks ahead of the move while
the old worker decoded on) and nothing stays held on either worker.

The pause this costs against resuming by recompute is measured in
``bench/migration_pause.py`` (the issue's 2,048-token context), not here."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from splitserve.bench.migration_pause import SCHEMA, DecodePair
from splitserve.engine.speculative.cost import StepCost
from splitserve.router.dispatch import Dispatcher
from splitserve.router.events import FinalEvent, GenerateInput, TokenEvent
from splitserve.wire.config import EngineConfig, SpeculativeConfig
from splitserve.wire.errors import InvalidRequest, UnknownRequest
from splitserve.wire.sampling import SamplingParams, StructuredOutput
from tests.integration.cluster_util import assert_move_pulled, trace_of
from tests.waiting import until, wait_until

pytestmark = [pytest.mark.needs_smollm2]

# speculating with SmolLM2 as its own draft: in float32 it proposes the target's own tokens
DRAFT = SpeculativeConfig(method="draft", num_tokens=4, draft_model="smollm2")
ENGINE = EngineConfig(
    model="smollm2", dtype="float32", kv_cache_memory_mib=96, max_model_len=1024, speculative=DRAFT
)
PARAMS = {
    "greedy": SamplingParams(max_tokens=32, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
    "json": SamplingParams(max_tokens=60, structured=StructuredOutput("json_schema", json.dumps(SCHEMA))),
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON. " + "Be precise and brief. " * 40}]


@pytest.fixture(scope="module")
def pair():
    p = DecodePair(ENGINE)
    yield p
    p.close()


async def _generate(
    d: Dispatcher, rid: str, params: SamplingParams, move_after: int | None = None, by: str = "kv"
):
    """(tokens, text, final, the worker it moved to); with ``move_after``, the request
    moves (``by``) once that many tokens came."""
    tokens, text, final, moved_to = [], "", None, None
    async for event in d.generate(GenerateInput(params, messages=MESSAGES, request_id=rid)):
        if isinstance(event, TokenEvent):
            tokens += event.token_ids
            text += event.text
            if move_after is not None and moved_to is None and len(tokens) >= move_after:
                moved_to = await d.moves.migrate(rid, by=by)
        elif isinstance(event, FinalEvent):
            final = event
    return tokens, text, final, moved_to


def test_a_request_moved_mid_stream_streams_on_as_if_undisturbed(pair):
    d = pair.dispatcher
    stats = {wid: pair.run(c.stats()).engine for wid, c in pair.clients.items()}
    failures = dict(d.transfer_failures)
    least_moved = 0  # the KV tokens the moves took at least: each prompt, and 5 of its tokens
    for name, params in PARAMS.items():
        ref_tokens, ref_text, ref_final, _ = pair.run(_generate(d, f"ref-{name}", params))
        tokens, text, final, moved_to = pair.run(_generate(d, f"moved-{name}", params, move_after=6))
        assert moved_to is not None and final.decode_worker == moved_to, name
        assert (tokens, text) == (ref_tokens, ref_text), name  # nothing repeated, skipped or changed
        assert final.finish_reason == ref_final.finish_reason and final.completion_tokens == len(tokens)
        assert_move_pulled(trace_of(d.traces.latest(2), f"moved-{name}"), to=moved_to)  # with its KV
        least_moved += final.prompt_tokens + 5
    assert dict(d.transfer_failures) == failures  # no pull failed (a failed one is recomputed)
    assert json.loads(ref_text).keys() == {"name", "age"}
    after = {wid: pair.run(c.stats()).engine for wid, c in pair.clients.items()}

    def gained(field: str) -> int:
        return sum(getattr(after[w], field) - getattr(stats[w], field) for w in after)

    # the new worker took the KV (pulled, or held in its cache already), computed none of it
    assert gained("import_moved_tokens") + gained("import_held_tokens") >= least_moved
    # most of it was copied ahead, while the request still decoded on the old worker
    assert gained("import_precopied_tokens") > 0

    def nothing_held() -> bool:
        return all(pair.run(c.stats()).engine.num_used_blocks == 0 for c in pair.clients.values())

    wait_until(nothing_held, "every block freed on both workers (exports confirmed, requests ended)")


def test_a_speculating_request_moved_mid_stream_keeps_every_draft(pair, monkeypatch):
    """A request that speculates (its draft proposing every step: the draft's measured
    price is taken as nothing here) moves mid-stream: the new worker's draft catches
    up from the tokens, so every proposal on either worker is still the target's own
    token and kept, and the stream is the undisturbed run's."""
    monkeypatch.setattr(StepCost, "min_gain", property(lambda self: 0.0))
    d, params = pair.dispatcher, PARAMS["greedy"]
    ref_tokens, ref_text, _, _ = pair.run(_generate(d, "ref-speculating", params))

    def counters() -> dict[str, tuple[int, int]]:
        stats = {wid: pair.run(c.stats()).engine.speculation for wid, c in pair.clients.items()}
        return {wid: (s.proposed_tokens, s.accepted_tokens) for wid, s in stats.items()}

    before, failures = counters(), dict(d.transfer_failures)
    tokens, text, final, moved_to = pair.run(_generate(d, "moved-speculating", params, move_after=6))
    assert moved_to is not None and final.decode_worker == moved_to
    assert_move_pulled(trace_of(d.traces.latest(1), "moved-speculating"), to=moved_to)
    assert dict(d.transfer_failures) == failures
    assert (tokens, text) == (ref_tokens, ref_text)
    after = counters()
    gained = {w: (after[w][0] - before[w][0], after[w][1] - before[w][1]) for w in after}
    # proposals on both workers (the old one's before the move, the new one's after it),
    # every one kept; the request's Final sums them
    assert all(proposed > 0 and kept == proposed for proposed, kept in gained.values()), gained
    assert (final.draft_tokens, final.accepted_draft_tokens) == tuple(map(sum, zip(*gained.values())))


def test_a_request_moved_by_recompute_streams_on_as_if_undisturbed(pair):
    """The other way to move (a worker that cannot export its KV moves so): the new worker
    prefills the prompt and the tokens so far; the stream is whole all the same."""
    d, params = pair.dispatcher, PARAMS["seeded"]
    moved = {wid: pair.run(c.stats()).engine.import_moved_tokens for wid, c in pair.clients.items()}
    ref_tokens, ref_text, _, _ = pair.run(_generate(d, "ref-recompute", params))
    tokens, text, final, moved_to = pair.run(
        _generate(d, "by-recompute", params, move_after=6, by="recompute")
    )
    assert final.decode_worker == moved_to and (tokens, text) == (ref_tokens, ref_text)
    after = {wid: pair.run(c.stats()).engine.import_moved_tokens for wid, c in pair.clients.items()}
    assert after == moved  # no KV moved: it was computed again


def test_what_cannot_move_is_refused_with_a_sentence(pair):
    d = pair.dispatcher
    with pytest.raises(UnknownRequest, match="no request 'nobody'"):
        pair.run(d.moves.migrate("nobody"))
    with pytest.raises(InvalidRequest, match="by 'kv' or 'recompute'"):
        pair.run(d.moves.migrate("nobody", by="teleport"))
    with pytest.raises(InvalidRequest, match="by 'kv' or 'recompute'"):
        pair.run(d.moves.move_off("decode-0", by="teleport"))

    async def move_while_prefilling():
        gen = d.generate(GenerateInput(PARAMS["greedy"], messages=MESSAGES, request_id="early"))
        first = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0)  # admitted, its prompt not yet prefilled
        with pytest.raises(InvalidRequest, match="only a decoding request moves"):
            await d.moves.migrate("early")
        await first
        await gen.aclose()

    pair.run(move_while_prefilling())


def test_draining_a_worker_by_migration_moves_every_request_off_it_whole(pair):
    """Three requests decoding on decode-0; it is drained and its requests moved off
    (``router.moves.Moves.move_off``): all three finish on decode-1, each stream equal to its
    undisturbed run, and decode-0 holds nothing, long before the requests would have
    ended there."""
    d = pair.dispatcher
    refs = {name: pair.run(_generate(d, f"drain-ref-{name}", p)) for name, p in PARAMS.items()}
    failures = dict(d.transfer_failures)

    async def scenario():
        d.registry.drain("decode-1")  # every request starts on decode-0
        streams = {name: [] for name in PARAMS}

        async def follow(name, params):
            events = d.generate(GenerateInput(params, messages=MESSAGES, request_id=f"drain-{name}"))
            finals = [e async for e in _recording(events, streams[name])]
            return finals[-1]

        tasks = {name: asyncio.ensure_future(follow(name, p)) for name, p in PARAMS.items()}
        await until(lambda: all(len(s) >= 6 for s in streams.values()), "every request decoding on decode-0")
        await d.registry.activate("decode-1")
        d.registry.drain("decode-0")
        moved = await d.moves.move_off("decode-0")
        finals = {name: await task for name, task in tasks.items()}
        await d.registry.activate("decode-0")
        return moved, streams, finals

    moved, streams, finals = pair.run(scenario())
    assert moved == 3
    for name, (ref_tokens, _, ref_final, _) in refs.items():
        assert streams[name] == ref_tokens and finals[name].decode_worker == "decode-1", name
        assert finals[name].finish_reason == ref_final.finish_reason
        assert_move_pulled(trace_of(d.traces.latest(3), f"drain-{name}"), to="decode-1")
    assert dict(d.transfer_failures) == failures

    def nothing_held() -> bool:
        return pair.run(pair.clients["decode-0"].stats()).engine.num_used_blocks == 0

    wait_until(nothing_held, "decode-0 holds no block once its requests moved off")


async def _recording(events, tokens: list[int]):
    """``events``' final events, each token id appended to ``tokens`` as it comes."""
    async for event in events:
        if isinstance(event, TokenEvent):
            tokens += event.token_ids
        elif isinstance(event, FinalEvent):
            yield event


def test_splitserve_drain_moves_a_running_request_off_through_the_front_door(pair, capsys):
    """The operator's way: ``splitserve drain decode-0`` (the ``Drain`` RPC) while a
    request streams from decode-0 over gRPC; it finishes on decode-1, whole."""
    from splitserve.cli.main import main
    from splitserve.client import Client
    from splitserve.client.types import Final
    from splitserve.router.server import RouterServer

    d = pair.dispatcher
    server = RouterServer(d, "disaggregated", "127.0.0.1", 0)
    pair.run(server.start())
    options = dict(messages=MESSAGES, max_tokens=32, ignore_eos=True, temperature=0.0)
    tokens, final, drained = [], None, False
    failures = dict(d.transfer_failures)
    try:
        with Client(server.address) as client:
            ref_tokens = client.generate(**options).token_ids
            d.registry.drain("decode-1")  # it starts on decode-0
            for item in client.stream(**options, request_id="drained-through-the-door"):
                if isinstance(item, Final):
                    final = item
                    continue
                tokens += item.token_ids
                if len(tokens) >= 6 and not drained:
                    drained = True
                    pair.run(d.registry.activate("decode-1"))
                    assert main(["drain", "decode-0", "--server", server.address]) == 0
    finally:
        pair.run(d.registry.activate("decode-0"))
        pair.run(server.stop(0.5))
    assert tokens == ref_tokens and final.decode_worker == "decode-1"
    assert "decode-0 drained: 1 request(s) moved off, 0 left to finish there" in capsys.readouterr().out
    assert_move_pulled(trace_of(d.traces.latest(1), "drained-through-the-door"), to="decode-1")
    assert dict(d.transfer_failures) == failures


def test_a_move_whose_kv_arrives_corrupt_is_recomputed_and_holds_nothing(pair, monkeypatch):
    """The moved request's KV fails its checksums on the new worker (its handoff altered
    on the way, as bytes damaged in transit would): the pull fails, the new worker
    recomputes the request from its prompt and tokens, the stream is whole all the same,
    the old worker's export is released and neither worker holds a block."""
    d, old = pair.dispatcher, pair.workers["decode-0"]
    ref_tokens, _, _, _ = pair.run(_generate(d, "corrupt-ref", PARAMS["seeded"]))
    move_out = old.move_out

    async def move_out_damaged(request_id: str, export: bool = True, from_block: int = 0):
        moved = await move_out(request_id, export, from_block)
        (desc,) = moved.handoff.descriptors
        damaged = dataclasses.replace(desc, layer_checksums=tuple(c ^ 1 for c in desc.layer_checksums))
        return dataclasses.replace(moved, handoff=dataclasses.replace(moved.handoff, descriptors=(damaged,)))

    monkeypatch.setattr(old, "move_out", move_out_damaged)
    failures = sum(d.transfer_failures.values())

    async def scenario():
        d.registry.drain("decode-1")  # it starts on decode-0
        tokens: list[int] = []
        events = d.generate(GenerateInput(PARAMS["seeded"], messages=MESSAGES, request_id="corrupt"))
        result = asyncio.ensure_future(_last(_recording(events, tokens)))
        await until(lambda: len(tokens) >= 6, "the request decoding on decode-0")
        await d.registry.activate("decode-1")
        await d.moves.migrate("corrupt", to="decode-1")
        return tokens, await result

    tokens, final = pair.run(scenario())
    assert tokens == ref_tokens and final.decode_worker == "decode-1"
    assert (
        d.transfer_failures[("IntegrityError", "recompute")]
        and sum(d.transfer_failures.values()) == failures + 1
    )
    marks = [(m.name, m.worker) for m in trace_of(d.traces.latest(1), "corrupt").marks]
    assert ("kv_recompute", "decode-1") in marks and "move_pulled" not in [n for n, _ in marks], marks

    def nothing_held() -> bool:
        return all(pair.run(c.stats()).engine.num_used_blocks == 0 for c in pair.clients.values())

    wait_until(nothing_held, "every block freed on both workers (the export released)")


async def _last(items):
    """The last of ``items`` (an async iterator)."""
    seen = [item async for item in items]
    return seen[-1] if seen else None


@pytest.mark.parametrize("leaves", ["while-copying-ahead", "while-the-old-worker-lets-go"])
def test_a_move_whose_caller_leaves_still_ends_whole(pair, leaves):
    """``migrate``'s caller is cancelled (a ``Drain`` call whose client left, a router
    stopping its KV relief). During the pre-copy: there is no move, the request decodes
    on where it was, and the new worker frees what it copied. Once the old worker was
    asked to let the request go: the move goes on without the caller and the stream
    ends on the new worker. Whole either way. (Before, the cancel reached the old
    worker's call: the request stayed there, yet marked MOVING until it ended, so no
    later move could take it.)"""
    d = pair.dispatcher

    async def left_mid_move(rid: str):
        tokens, final, caller = [], None, None
        async for event in d.generate(GenerateInput(PARAMS["greedy"], messages=MESSAGES, request_id=rid)):
            if isinstance(event, TokenEvent):
                tokens += event.token_ids
                if caller is None and len(tokens) >= 6:
                    caller = asyncio.ensure_future(d.moves.migrate(rid))
                    life = d.moves.lives[rid]
                    if leaves == "while-copying-ahead":
                        await asyncio.sleep(0)  # the new worker was asked to copy
                    else:
                        asked = lambda life=life, caller=caller: life.moving or caller.done()  # noqa: E731
                        await until(asked, "the old worker asked to let it go")
                    caller.cancel()
            elif isinstance(event, FinalEvent):
                final = event
        return tokens, final, caller

    ref_tokens, _, _, _ = pair.run(_generate(d, f"left-ref-{leaves}", PARAMS["greedy"]))
    tokens, final, caller = pair.run(left_mid_move(f"left-{leaves}"))
    assert caller.cancelled()
    assert tokens == ref_tokens and final.decode_worker != ""
    trace = trace_of(d.traces.latest(1), f"left-{leaves}")
    moved = any(m.name == "moved" for m in trace.marks)
    assert moved == (leaves == "while-the-old-worker-lets-go")
    if moved:  # it went on without its caller, with its KV
        assert_move_pulled(trace, to=final.decode_worker)

    def nothing_held() -> bool:
        return all(pair.run(c.stats()).engine.num_used_blocks == 0 for c in pair.clients.values())

    wait_until(nothing_held, "every block freed on both workers (the copy ahead, the export)")
