"""A running request moved between two engines (live migration, engine level):
``suspend`` on the engine it runs on, its KV exported and pulled over a real
transfer backend (``local``: the same source and sink code as NIXL's, in one
process), ``import_request`` with every token it generated on the other engine,
``activate``; then it decodes on there. Its tokens and text, across both
engines, equal an undisturbed run's for greedy, seeded and JSON-schema requests
(SmolLM2, the real model); nothing is emitted twice; the KV moved (the
importing engine computed no prompt token)."""

from __future__ import annotations

import json

import pytest

from splitserve.bench.migration_pause import SCHEMA
from splitserve.engine.engine import Engine
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.backends.local import LocalHub
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import InvalidRequest, UnknownRequest
from splitserve.wire.sampling import SamplingParams, StructuredOutput

PARAMS = {
    "greedy": SamplingParams(max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
    "penalized": SamplingParams(
        max_tokens=24, temperature=0.7, seed=3, repetition_penalty=1.3, ignore_eos=True
    ),
    "json": SamplingParams(max_tokens=60, structured=StructuredOutput("json_schema", json.dumps(SCHEMA))),
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON, then tell me about them."}]


def _engine() -> Engine:
    return Engine(EngineConfig(model="smollm2", dtype="float32", block_size=16, num_kv_blocks=96))


@pytest.fixture(scope="module")
def engines(smollm2):
    return _engine(), _engine()


def _add_all(engine: Engine, messages: list[dict[str, str]] = MESSAGES) -> dict[str, str]:
    return {name: engine.add_request(messages=messages, params=p) for name, p in PARAMS.items()}


def _run(engine: Engine, ids: dict[str, str], until=None) -> dict[str, tuple[list[int], str]]:
    """Step ``engine`` until ``until()`` (default: nothing left); each request's emitted
    tokens and text."""
    got = {rid: ([], "") for rid in ids.values()}
    while engine.has_unfinished() and not (until and until()):
        for out in engine.step():
            if out.request_id in got:
                tokens, text = got[out.request_id]
                got[out.request_id] = (tokens + out.new_token_ids, text + out.text)
    return {name: got[rid] for name, rid in ids.items()}


def test_a_running_request_moves_with_its_kv_and_decodes_on_as_if_undisturbed(engines):
    a, b = engines
    reference = _run(a, _add_all(a))
    ids = _add_all(a)
    before = _run(a, ids, until=lambda: all(a.requests[r].seq.num_output_tokens >= 6 for r in ids.values()))
    hub, backend = LocalHub(), get_backend("local")
    source = backend.source("decode-a", a.kv_cache.tensor, a.kv_compat(), lease_s=30.0, hub=hub)
    sink = backend.sink("decode-b", b.kv_cache.tensor, b.kv_compat(), hub=hub)
    sink.connect(source.handshake())
    moved_before, kv_tokens = b.stats().import_moved_tokens, 0
    for name, rid in ids.items():
        moved = a.suspend(rid)
        assert moved.output_token_ids == before[name][0]  # everything it emitted, nothing held back
        assert moved.num_kv_tokens == len(moved.prompt_token_ids) + len(moved.output_token_ids) - 1
        kv_tokens += moved.num_kv_tokens
        desc = source.export(rid, moved.block_ids, moved.num_kv_tokens)
        blocks = b.import_request(rid, moved.prompt_token_ids, moved.output_token_ids, PARAMS[name])
        assert sink.pull(desc, blocks, timeout=30.0).transfer_id == desc.transfer_id
        a.release(rid)
        b.activate(rid)
    assert not a.has_unfinished() and a.block_manager.num_used_blocks == 0
    assert b.stats().import_moved_tokens - moved_before == kv_tokens  # pulled, not computed
    after = _run(b, ids)
    for name in PARAMS:
        tokens, text = before[name][0] + after[name][0], before[name][1] + after[name][1]
        assert (tokens, text) == reference[name], name
    assert json.loads(reference["json"][1]).keys() == {"name", "age"}  # it moved mid-object


def test_only_a_decoding_request_can_be_suspended(engines):
    a, _ = engines
    rid = a.add_request([5, 6, 7] * 30, SamplingParams(max_tokens=4))
    with pytest.raises(UnknownRequest, match="no running request"):
        a.suspend(rid)  # waiting: its prompt not computed
    a.abort(rid)
    with pytest.raises(UnknownRequest):
        a.suspend("never-added")
    rid = a.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    a.step()  # prefilled: running, one token sampled
    with pytest.raises(InvalidRequest, match="at most its 0 full blocks"):
        a.suspend(rid, from_block=1)
    a.abort(rid)


def test_a_move_after_a_pre_copy_takes_only_the_blocks_after_it(engines):
    """Pre-copy: while each request still decodes on ``a``, ``b`` reserves blocks for its
    full blocks so far (``reserve_moving``), ``a`` lends them (``lend_running``) and ``b``
    pulls them (``fill_moving``); ``a`` decodes on, then the move exports only the blocks
    after them (``suspend(from_block=...)``). The streams equal an undisturbed run's, and
    every KV token ``b`` took came by a pull: the pre-copy's and the move's together."""
    a, b = engines
    messages = [{"role": "user", "content": "Describe a cat as JSON, then tell me about it."}]  # new to b
    reference = _run(a, _add_all(a, messages))
    ids = _add_all(a, messages)
    before = _run(a, ids, until=lambda: all(a.requests[r].seq.num_output_tokens >= 6 for r in ids.values()))
    hub, backend = LocalHub(), get_backend("local")
    source = backend.source("decode-a", a.kv_cache.tensor, a.kv_compat(), lease_s=30.0, hub=hub)
    sink = backend.sink("decode-b", b.kv_cache.tensor, b.kv_compat(), hub=hub)
    sink.connect(source.handshake())
    stats, bs = b.stats(), b.block_manager.block_size
    precopied: dict[str, int] = {}  # request -> blocks b holds before the move
    pulled = 0  # blocks the pre-copy pulled
    for name, rid in ids.items():
        seq = a.requests[rid].seq
        held, blocks = b.reserve_moving(rid, seq.prompt_token_ids, seq.output_token_ids, PARAMS[name])
        want = held + len(blocks)
        if blocks:  # b lacks them (some of the prompt's it may hold: an earlier one's pre-copy)
            lent = a.lend_running(f"{rid}/pre", rid, seq.token_ids[: want * bs], from_block=held)
            assert len(lent.block_ids) == len(blocks)  # its full blocks, shared while it decodes on
            desc = source.export(f"{rid}/pre", lent.block_ids, lent.num_kv_tokens)
            sink.pull(desc, blocks, timeout=30.0)
            a.release(f"{rid}/pre")
        assert b.fill_moving(rid, want) == len(blocks) * bs
        pulled += len(blocks)
        precopied[name] = want
    during = _run(a, ids, until=lambda: all(a.requests[r].seq.num_output_tokens >= 9 for r in ids.values()))
    tail_tokens = 0
    for name, rid in ids.items():
        moved = a.suspend(rid, from_block=precopied[name])
        desc = source.export(rid, moved.block_ids, moved.num_kv_tokens)
        blocks = b.import_request(rid, moved.prompt_token_ids, moved.output_token_ids, PARAMS[name])
        assert len(blocks) == len(moved.block_ids)  # only the blocks after the pre-copied ones
        sink.pull(desc, blocks, timeout=30.0)
        a.release(rid)
        b.activate(rid)
        tail_tokens += moved.num_kv_tokens
    assert a.block_manager.num_used_blocks == 0
    after, moved_in = _run(b, ids), b.stats()
    for name in PARAMS:
        tokens = before[name][0] + during[name][0] + after[name][0]
        text = before[name][1] + during[name][1] + after[name][1]
        assert (tokens, text) == reference[name], name
    precopied_tokens = moved_in.import_precopied_tokens - stats.import_precopied_tokens
    assert precopied_tokens == pulled * bs > 0
    assert moved_in.import_moved_tokens - stats.import_moved_tokens == precopied_tokens + tail_tokens


def test_a_pre_copy_is_refused_with_a_sentence_and_holds_nothing(engines):
    _, b = engines
    used = b.block_manager.num_used_blocks
    with pytest.raises(InvalidRequest, match="no full block"):
        b.reserve_moving("short", [5, 6, 7], [8, 9], SamplingParams(max_tokens=8))
    with pytest.raises(InvalidRequest, match="not a running request"):
        b.reserve_moving("fresh", [5, 6, 7] * 10, [], SamplingParams(max_tokens=8))
    held, blocks = b.reserve_moving("r", [5, 6, 7] * 10, [8, 9, 10], SamplingParams(max_tokens=8))
    with pytest.raises(InvalidRequest, match="other tokens"):
        b.import_request("r", [5, 6, 7] * 10, [8, 11, 10, 12], SamplingParams(max_tokens=8))
    assert b.abort("r") and b.block_manager.num_used_blocks == used
    rid = b.add_request([5, 6, 7] * 10, SamplingParams(max_tokens=8))
    b.step()  # prefilled: running, 30 tokens computed (one full block of 16)
    with pytest.raises(InvalidRequest, match="other tokens"):
        b.lend_running("loan", rid, [5, 6, 8] * 10, from_block=0)
    assert b.lend_running("loan", rid, [5, 6, 7] * 10, from_block=1) is None  # nothing past block 1
    lent = b.lend_running("loan", rid, [5, 6, 7] * 10, from_block=0)
    assert lent.block_ids == b.requests[rid].seq.block_table[:1] and lent.num_kv_tokens == 16
    b.release("loan")
    b.abort(rid)
    assert b.block_manager.num_used_blocks == used
