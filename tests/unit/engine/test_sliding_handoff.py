"""The KV of a model with sliding windows moves only where its layers still need it.

Tiny random gpt-oss and Gemma 3 checkpoints (sliding layers of a 16-token window
beside full ones, blocks of 4 tokens), two engines and the ``local`` backend (the
sources' and sinks' own code, in one process). A 61-token prompt prefilled on one
engine and handed to the other sends its full layers' 16 blocks and its sliding
layers' last 5 (keys 44.. on: the block holding key 46, the first the next token's
window reaches) and no more; the decode engine holds no block for its sliding
layers' older keys (layer groups: ``KVLayout.grouped``) and its greedy tokens equal
transformers' ``generate``. Its full blocks must never serve a later prompt as a
cached prefix (their windows' KV is not there): a prompt that is a prefix of the
first one computes its own KV and gives transformers' tokens too.
Moved on mid-stream (live migration) from that decode engine to a third, the
request keeps its tokens, its sliding layers' KV again sent from the window on.
"""

from __future__ import annotations

import pytest

from splitserve.engine.engine import Engine
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.backends.local import LocalHub
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

MAX_NEW = 12
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
BS = 4


@pytest.fixture(scope="module", params=["gpt_oss", "gemma3_text"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, directory)
    (prompt,) = random_prompts([61], 512, seed=5)
    shorter = prompt[:30]  # a prefix of it: its blocks are the first one's
    return directory, prompt, shorter, hf_greedy(hf, prompt, MAX_NEW), hf_greedy(hf, shorter, MAX_NEW)


def make_engine(directory) -> Engine:
    cfg = EngineConfig(model=str(directory), dtype="float32", block_size=BS, num_kv_blocks=64)
    return Engine(cfg)


def run(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def pair(a: Engine, b: Engine, hub: LocalHub, name: str):
    backend = get_backend("local")
    source = backend.source(f"{name}-src", a.kv_cache.tensor, a.kv_compat(), lease_s=30.0, hub=hub)
    sink = backend.sink(f"{name}-dst", b.kv_cache.tensor, b.kv_compat(), hub=hub)
    sink.connect(source.handshake())
    return source, sink


def test_a_windowed_handoff_sends_the_window_and_decodes_as_transformers(model):
    directory, prompt, shorter, expected, expected_shorter = model
    pre, dec, moved_to = make_engine(directory), make_engine(directory), make_engine(directory)
    layout = dec.kv_cache.layout
    sliding = [i for i in range(layout.num_layers) if layout.windowed(i)]
    assert sliding and len(sliding) < layout.num_layers  # both kinds of layer
    hub = LocalHub()
    source, sink = pair(pre, dec, hub, "handoff")

    rid = pre.add_request(prompt, PARAMS, prefill_only=True)
    run(pre)
    done = pre.prefilled(rid)
    # the next token (position 61) sees keys 46..61 through a 16-token window: blocks 11.. of
    # 16; the ids name the full layers' 16 blocks, then each sliding group's last 5
    groups = layout.window_groups
    assert layout.grouped and groups >= 1
    assert (len(done.block_ids), done.window_from) == (16 + groups * 5, 11)
    assert layout.token_blocks(len(done.block_ids), done.window_from) == 16
    desc = source.export(rid, done.block_ids, done.num_kv_tokens, window_from=done.window_from)
    full = layout.num_layers * 16 * layout.planes * layout.block_bytes
    sent = ((layout.num_layers - len(sliding)) * 16 + len(sliding) * 5) * layout.planes * layout.block_bytes
    assert desc.num_bytes == sent < full
    blocks = dec.import_request(rid, done.prompt_token_ids, done.output_token_ids, PARAMS)
    sink.pull(desc, blocks, timeout=30.0)
    pre.release(rid)
    dec.activate(rid)
    seq = dec.requests[rid].seq  # its sliding groups hold the window's blocks, no more
    assert seq.window_start == 11 and [len(t) for t in seq.window_tables] == [5] * groups
    assert dec.block_manager.num_used_blocks == 16 + groups * 5
    cache = dec.kv_cache.tensor
    for layer in sliding:  # each sliding layer's KV came into its own group's blocks
        group = seq.window_tables[layout.group(layer) - 1]
        assert cache[layout.row(layer), :, group].any()
    stats = dec.stats()

    # decode a few tokens here, then move the request on (live migration) mid-stream
    head: list[int] = []
    while len(head) < 4:
        for o in dec.step():
            head.extend(o.new_token_ids)
        assert all(len(t) <= 16 // BS + 1 for t in seq.window_tables)  # the window and one block
    moved = dec.suspend(rid)
    assert moved.window_from > 0
    mover, taker = pair(dec, moved_to, hub, "move")
    mdesc = mover.export(rid, moved.block_ids, moved.num_kv_tokens, window_from=moved.window_from)
    taken = moved_to.import_request(rid, moved.prompt_token_ids, moved.output_token_ids, PARAMS)
    taker.pull(mdesc, taken, timeout=30.0)
    dec.release(rid)
    moved_to.activate(rid)
    tail = run(moved_to)[rid]
    assert done.output_token_ids + head + tail == expected
    assert stats.import_moved_tokens == 61  # the prompt's KV came by the pull, none computed

    # the first request's blocks (its sliding layers' older KV never written) stay out of
    # the prefix cache: a prompt they would serve computes its own and is right
    assert not dec.block_manager.hash_to_block
    again = dec.add_request(shorter, PARAMS)
    assert run(dec)[again] == expected_shorter
    assert dec.requests == {} and dec.block_manager.num_used_blocks == 0


def test_a_prefill_engine_s_own_windowed_blocks_are_a_prefix(model):
    """The engine that computed a prompt holds every layer's KV: the same prompt again
    takes its cached blocks and gives the same tokens (the window does not stop prefix
    caching where the KV is whole)."""
    directory, prompt, shorter, expected, expected_shorter = model
    engine = make_engine(directory)
    first = engine.generate([prompt], PARAMS)[0]
    again = engine.generate([shorter], PARAMS)[0]
    assert (first.token_ids, again.token_ids) == (expected, expected_shorter)
    assert again.num_cached_tokens == (len(shorter) - 1) // BS * BS
