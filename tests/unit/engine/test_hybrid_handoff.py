"""A hybrid model's state moves with its KV (``engine.state_blocks``).

Tiny random Qwen3-Next and Qwen3.5 checkpoints, two or three engines and the
``local`` backend (the sources' and sinks' own code, in one process). A prompt
prefilled on one engine (in chunks: the linear layers' state carried across them)
and handed to another decodes there to transformers' tokens, the decode engine
running no prompt token: its linear layers start from the state that came with
the KV, byte for byte the prefill engine's. A state byte changed on the way is
caught by the checksum; a request moved on mid-stream keeps its tokens; a peer
whose cache has no state blocks is refused at the handshake, both layouts named.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from splitserve.engine.engine import Engine
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.backends.local import LocalHub
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import IncompatiblePeer, IntegrityError, InvalidRequest
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

MAX_NEW = 10
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_text"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, directory)
    prompts = random_prompts([17, 90], 512, seed=4)
    return directory, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def make_engine(directory) -> Engine:
    cfg = EngineConfig(
        model=str(directory), dtype="float32", block_size=8, max_num_batched_tokens=32, max_num_seqs=4
    )
    return Engine(cfg)


def pair(a: Engine, b: Engine, hub: LocalHub, name: str):
    backend = get_backend("local")
    source = backend.source(f"{name}-src", a.kv_cache.tensor, a.kv_compat(), lease_s=30.0, hub=hub)
    sink = backend.sink(f"{name}-dst", b.kv_cache.tensor, b.kv_compat(), hub=hub)
    sink.connect(source.handshake())
    return source, sink


def prefill(engine: Engine, prompts) -> list:
    ids = [engine.add_request(p, PARAMS, prefill_only=True) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.prefilled(i) for i in ids]


def states_of(engine: Engine, request_id: str) -> list[torch.Tensor]:
    slot = engine.requests[request_id].seq.state_slot
    return [t for s in engine.kv_cache.states for t in (s.conv[slot].clone(), s.recurrent[slot].clone())]


def test_the_state_moves_with_the_kv_and_the_decode_engine_computes_no_prompt(model):
    directory, prompts, expected = model
    pre, dec, taker = make_engine(directory), make_engine(directory), make_engine(directory)
    hub = LocalHub()
    source, sink = pair(pre, dec, hub, "handoff")
    done = prefill(pre, prompts)
    for p in done:
        kv_blocks = -(-p.num_kv_tokens // 8)
        assert len(p.block_ids) == kv_blocks + pre.kv_cache.state_plan.blocks_per_slot
        sent = states_of(pre, p.request_id)
        desc = source.export(p.request_id, p.block_ids, p.num_kv_tokens)
        blocks = dec.import_request(p.request_id, p.prompt_token_ids, p.output_token_ids, PARAMS)
        sink.pull(desc, blocks, timeout=30.0)
        got = states_of(dec, p.request_id)
        assert all(torch.equal(a, b) for a, b in zip(sent, got)) and any(t.any() for t in got)
        pre.release(p.request_id)
        dec.activate(p.request_id)
    assert pre.block_manager.num_used_blocks == 0
    tokens_run = dec.runner.tokens_run
    # the first request decodes 4 tokens here, then moves on to a third engine mid-stream
    first = done[0].request_id
    head: dict[str, list[int]] = {p.request_id: [] for p in done}
    while len(head[first]) < 4:
        for o in dec.step():
            head[o.request_id].extend(o.new_token_ids)
    moved = dec.suspend(first)
    mover, taker_sink = pair(dec, taker, hub, "move")
    mdesc = mover.export(first, moved.block_ids, moved.num_kv_tokens)
    taken = taker.import_request(first, moved.prompt_token_ids, moved.output_token_ids, PARAMS)
    taker_sink.pull(mdesc, taken, timeout=30.0)
    dec.release(first)
    taker.activate(first)
    tail: dict[str, list[int]] = {p.request_id: [] for p in done}
    for engine in (dec, taker):
        while engine.has_unfinished():
            for o in engine.step():
                tail[o.request_id].extend(o.new_token_ids)
    for p, want in zip(done, expected):
        assert p.output_token_ids + head[p.request_id] + tail[p.request_id] == want
    # one row per decode step of each request after the handoff: no prompt token ran here
    assert dec.runner.tokens_run - tokens_run == len(head[first]) + len(head[done[1].request_id]) + len(
        tail[done[1].request_id]
    )


def test_a_state_byte_changed_on_the_way_fails_the_pull(model):
    directory, prompts, _ = model
    pre, dec = make_engine(directory), make_engine(directory)
    source, sink = pair(pre, dec, LocalHub(), "corrupt")
    (p,) = prefill(pre, prompts[:1])
    desc = source.export(p.request_id, p.block_ids, p.num_kv_tokens)
    state_block = p.block_ids[-1]  # the slot's last block: state bytes only
    pre.kv_cache.tensor[0, 0, state_block].view(-1).view(torch.uint8)[3] ^= 0x10
    blocks = dec.import_request(p.request_id, p.prompt_token_ids, p.output_token_ids, PARAMS)
    with pytest.raises(IntegrityError, match="layer 0"):
        sink.pull(desc, blocks, timeout=30.0)


def test_a_peer_without_the_state_blocks_is_refused_at_the_handshake(model):
    directory, _, _ = model
    pre = make_engine(directory)
    compat = pre.kv_compat()
    assert compat.layout.states.startswith("deltanet:")
    plain = dataclasses.replace(compat, layout=dataclasses.replace(compat.layout, states=""))
    backend, hub = get_backend("local"), LocalHub()
    source = backend.source("src", pre.kv_cache.tensor, compat, lease_s=30.0, hub=hub)
    sink = backend.sink("dst", pre.kv_cache.tensor, plain, hub=hub)
    with pytest.raises(
        IncompatiblePeer, match=re.escape(f"states: '{compat.layout.states}' there vs '' here")
    ):
        sink.connect(source.handshake())
    with pytest.raises(InvalidRequest, match="caches no prompt prefixes"):
        pre.lend_prefix("loan", list(range(40)), 0)


def test_a_decode_engine_holding_a_prefix_takes_only_the_rest_and_the_state(model):
    """The decode engine has served a prompt (its blocks cached, a state snapshot at the
    last one): a prompt that extends it holds those blocks there (``hold_prefix``), the
    prefill engine exports only the blocks after them and its final state, and the
    request decodes to the tokens of a run without any cache."""
    directory, prompts, _ = model
    pre, dec = make_engine(directory), make_engine(directory)
    first = prompts[1]  # 90 tokens
    dec.generate([first], PARAMS)
    extended = first + [3, 1, 4, 1, 5]
    (want,) = make_engine(directory).generate([extended], PARAMS)
    held = dec.hold_prefix("ext", extended, PARAMS)
    assert held == 88  # the first prompt's whole blocks, up to its snapshot
    rid = pre.add_request(extended, PARAMS, request_id="ext", prefill_only=True, export_from_block=held // 8)
    while pre.has_unfinished():
        pre.step()
    done = pre.prefilled(rid)
    source, sink = pair(pre, dec, LocalHub(), "held")
    desc = source.export(rid, done.block_ids, done.num_kv_tokens)
    blocks = dec.import_request(rid, done.prompt_token_ids, done.output_token_ids, PARAMS)
    assert len(blocks) == len(done.block_ids)  # the blocks after the held ones, and the state slot
    sink.pull(desc, blocks, timeout=30.0)
    pre.release(rid)
    dec.activate(rid)
    tokens = list(done.output_token_ids)
    while dec.has_unfinished():
        for o in dec.step():
            tokens.extend(o.new_token_ids)
    assert tokens == want.token_ids
