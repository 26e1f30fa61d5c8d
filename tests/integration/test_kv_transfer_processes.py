"""KV transfer between two real processes, for each cross-process backend.

A source process (``splitserve.bench.kv_peers``; a Ray actor for the ray
backend) runs the real SmolLM2 prefill and exports the KV; this process pulls
it into its own engine and decodes. The greedy tokens must equal the
monolithic engine's, token for token. Failure cases: the source killed after
export (a typed error within the timeout, no hang), lease expiry (prefill
blocks freed, late pulls refused), bytes corrupted after the checksum
(detected, no tokens), an incompatible peer (refused at handshake). Layer-wise
streaming over nixl: the decode side pulls while the source still prefills,
with the same greedy tokens; a layer corrupted in flight fails the pull. Every
source process must exit 0 (UCX has been seen to segfault at exit).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from splitserve.bench.kv_peers import (
    Confirm,
    Corrupt,
    ExportRandom,
    Prefill,
    SourceSpec,
    SpawnChild,
    Status,
    Streaming,
    start_source,
)
from splitserve.engine.engine import Engine
from splitserve.kv_transfer import CLUSTER_BACKENDS, get_backend
from splitserve.kv_transfer.integrity import layer_checksums
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import (
    IncompatiblePeer,
    IntegrityError,
    KVTransferError,
    LeaseExpired,
    PeerLost,
    TransferTimeout,
)
from splitserve.wire.kv import CompatInfo
from splitserve.wire.kv_layout import KVLayout
from splitserve.wire.sampling import SamplingParams
from tests.conftest import require_smollm2
from tests.integration.cluster_util import shared_ray
from tests.waiting import wait_until

BACKENDS = list(CLUSTER_BACKENDS)
CFG = EngineConfig(model="smollm2", dtype="float32", kv_cache_memory_mib=128)
PARAMS = SamplingParams(max_tokens=20)
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]
SMALL = KVLayout(num_layers=2, num_blocks=32, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    shared_ray()  # for the ray backend's source actor


@pytest.fixture(scope="module")
def decode_engine():
    require_smollm2()
    return Engine(CFG)


@pytest.fixture(scope="module")
def chats(decode_engine):
    tok = decode_engine.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(decode_engine, chats):
    return [c.token_ids for c in decode_engine.generate(chats, PARAMS)]


@pytest.fixture(scope="module", params=BACKENDS)
def prefill_source(request, decode_engine):
    src = start_source(SourceSpec(request.param, engine=CFG))
    yield request.param, src
    assert src.stop() == 0


def sink_for(backend: str, engine: Engine):
    return get_backend(backend).sink("decode-0", engine.kv_cache.tensor, engine.kv_compat())


def wait_released(src, request_ids, timeout=10.0):
    """The source's status once the leases of ``request_ids`` have all ended."""
    status = []

    def released() -> bool:
        status[:] = [src.call(Status())]
        return set(request_ids) <= set(status[0].released)

    wait_until(released, f"the leases of {request_ids} ended", timeout, 0.05)
    return status[0]


def assert_decodes_like(engine: Engine, exported, reference) -> None:
    """Decode every activated request; first token + decoded tokens equal the reference."""
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    for e, ref in zip(exported, reference):
        assert e.output_token_ids + outs[e.descriptor.request_id] == ref


def corrupt_on_the_wire(sink, cache: torch.Tensor, layer: int, byte: int) -> None:
    """Make ``sink`` flip one byte of ``layer`` in the first block it fills, after the
    bytes land and before they are verified."""
    real_transfer = sink._transfer

    def faulty_wire(desc, dst_blocks, deadline, layers):
        real_transfer(desc, dst_blocks, deadline, layers)
        if layer in layers:
            cache[layer, 1, dst_blocks[0]].view(-1).view(torch.uint8)[byte] ^= 0x10

    sink._transfer = faulty_wire


def test_greedy_output_equals_monolithic(prefill_source, decode_engine, chats, reference):
    backend, src = prefill_source
    sink = sink_for(backend, decode_engine)
    sink.connect(src.handshake)
    exported = src.call(Prefill(chats, PARAMS))
    assert len(exported) == len(chats)
    for e in exported:
        rid = e.descriptor.request_id
        blocks = decode_engine.import_request(rid, e.prompt_token_ids, e.output_token_ids, PARAMS)
        conf = sink.pull(e.descriptor, blocks, timeout=30.0)
        if not conf.delivered:
            src.call(Confirm(conf.transfer_id))
        decode_engine.activate(rid)
    assert_decodes_like(decode_engine, exported, reference)
    status = wait_released(src, [e.descriptor.request_id for e in exported])
    assert status.num_exported == 0
    assert decode_engine.tokenizer.decode(reference[0]).startswith("The capital of France is Paris")
    sink.close()


@pytest.mark.parametrize("where", ["source", "wire"])
def test_corruption_is_detected_and_yields_no_tokens(prefill_source, decode_engine, chats, where):
    """``source``: the source's block changes after its checksum was taken (a block
    reused early); ``wire``: a byte flips between the wire and verification."""
    backend, src = prefill_source
    if where == "source" and backend == "ray":
        pytest.skip("the ray backend copies the blocks into the object store at export")
    sink = sink_for(backend, decode_engine)
    sink.connect(src.handshake)
    (e,) = src.call(Prefill(chats[:1], PARAMS))
    if where == "source":
        src.call(Corrupt(e.descriptor.transfer_id))
    else:
        corrupt_on_the_wire(sink, decode_engine.kv_cache.tensor, layer=7, byte=100)
    rid = e.descriptor.request_id
    blocks = decode_engine.import_request(rid, e.prompt_token_ids, e.output_token_ids, PARAMS)
    used = decode_engine.block_manager.num_used_blocks
    with pytest.raises(IntegrityError, match=f"layer {0 if where == 'source' else 7} "):
        sink.pull(e.descriptor, blocks, timeout=30.0)
    assert decode_engine.abort(rid)
    assert decode_engine.step() == []
    assert decode_engine.block_manager.num_used_blocks == used - len(blocks)
    sink.close()


def test_lease_expiry_frees_the_prefill_blocks(prefill_source, decode_engine, chats):
    backend, src = prefill_source
    sink = sink_for(backend, decode_engine)
    sink.connect(src.handshake)
    free_before = src.call(Status()).num_free_blocks
    (e,) = src.call(Prefill(chats[1:2], PARAMS, lease_s=0.3))
    assert src.call(Status()).num_free_blocks < free_before
    status = wait_released(src, [e.descriptor.request_id])
    assert status.num_free_blocks == free_before
    rid = e.descriptor.request_id
    blocks = decode_engine.import_request(rid, e.prompt_token_ids, e.output_token_ids, PARAMS)
    with pytest.raises(LeaseExpired):
        sink.pull(e.descriptor, blocks, timeout=5.0)
    decode_engine.abort(rid)
    sink.close()


def test_incompatible_peer_is_refused_at_handshake(prefill_source, decode_engine):
    backend, src = prefill_source
    lay = decode_engine.kv_cache.layout
    cache = torch.zeros(
        lay.num_layers, 2, 4, lay.block_size, lay.num_kv_heads, lay.head_dim, dtype=torch.bfloat16
    )
    other = CompatInfo(
        model=CFG.model,
        layout=KVLayout(lay.num_layers, 4, lay.block_size, lay.num_kv_heads, lay.head_dim, "bfloat16"),
        revision=src.handshake.compat.revision,  # the same weights: only the dtype differs
    )
    sink = get_backend(backend).sink("decode-bf16", cache, other)
    with pytest.raises(IncompatiblePeer, match="dtype: 'float32' there vs 'bfloat16' here"):
        sink.connect(src.handshake)
    sink.close()


def bare_pair(backend: str, name: str, layout: KVLayout = SMALL):
    src = start_source(SourceSpec(backend, layout=layout))
    cache = torch.zeros(layout.cache_shape, dtype=torch.bfloat16)
    sink = get_backend(backend).sink(name, cache, CompatInfo(model="random", layout=layout))
    sink.connect(src.handshake)
    return src, sink, cache


# full, sliding, sliding, full, sliding: runs of either kind, as the transports group them
WINDOWED = KVLayout(5, 32, 16, 2, 64, "bfloat16", windows=(0, 48, 48, 0, 48))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sliding_layer_moves_only_the_blocks_of_its_window(backend):
    """An export of 200 tokens (13 blocks) whose sliding layers need blocks 9.. only: the
    full layers arrive whole and verified, the sliding layers' blocks 9..12 too, their
    blocks before that are not sent (the destination's bytes there stay as they were),
    and the descriptor counts exactly the bytes sent."""
    src, sink, cache = bare_pair(backend, "decode-w", WINDOWED)
    cache.view(torch.uint8).fill_(0x5A)
    untouched = cache.clone()
    wf = WINDOWED.window_from(0, 200)
    assert wf == 9  # keys from 200 - 48 + 1 = 153 on: block 9 (144..159) and after
    desc = src.call(ExportRandom(num_tokens=200, window_from=wf)).descriptor
    dst = list(range(31, 18, -1))  # reversed: no run is contiguous on both sides
    try:
        sink.pull(desc, dst, timeout=60.0)
        assert desc.window_from == wf
        assert desc.num_bytes == (2 * 13 + 3 * 4) * 2 * WINDOWED.block_bytes  # full layers' 13, sliding 4
        assert layer_checksums(cache, dst, WINDOWED, wf) == desc.layer_checksums
        for layer in range(5):
            sent = dst if not WINDOWED.windowed(layer) else dst[wf:]
            kept = [] if not WINDOWED.windowed(layer) else dst[:wf]
            for b in sent:
                assert not torch.equal(cache[layer, :, b], untouched[layer, :, b]), (layer, b)
            for b in kept:
                assert torch.equal(cache[layer, :, b], untouched[layer, :, b]), (layer, b)
    finally:
        sink.close()
        assert src.stop() == 0


# the same layers in layer groups: full (0, 3) in rows 0 and 1, sliding (1, 2) and (4) in
# groups of their own, each holding only its window's blocks
GROUPED = KVLayout(5, 32, 16, 2, 64, "bfloat16", windows=(0, 48, 48, 0, 48), grouped=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_groups_move_each_group_s_window_into_its_own_blocks(backend):
    """The same export in layer groups: the ids name the full layers' 13 blocks, then each
    sliding group's 4 (blocks 9..12 of the sequence); each layer's bytes land in its
    group's blocks at its row of the tensor, verified, and nothing else is written."""
    assert (GROUPED.rows, GROUPED.window_groups) == (2, 2)
    src, sink, cache = bare_pair(backend, "decode-g", GROUPED)
    cache.view(torch.uint8).fill_(0x5A)
    untouched = cache.clone()
    wf = GROUPED.window_from(0, 200)
    desc = src.call(ExportRandom(num_tokens=200, window_from=wf)).descriptor
    dst = list(range(31, 10, -1))  # 13 + 2 * 4 ids, reversed
    try:
        assert len(desc.block_ids) == len(dst)
        sink.pull(desc, dst, timeout=60.0)
        assert desc.num_bytes == (2 * 13 + 3 * 4) * 2 * GROUPED.block_bytes
        assert layer_checksums(cache, dst, GROUPED, wf) == desc.layer_checksums
        written = {
            (GROUPED.row(layer), b) for layer in range(5) for b in GROUPED.layer_blocks(layer, dst, wf)
        }
        assert len(written) == 2 * 13 + 3 * 4  # no two layers share a block of a row
        for row in range(GROUPED.rows):
            for b in range(GROUPED.num_blocks):
                changed = not torch.equal(cache[row, :, b], untouched[row, :, b])
                assert changed == ((row, b) in written), (row, b)
    finally:
        sink.close()
        assert src.stop() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_source_killed_after_export_fails_fast_or_delivers_intact(backend):
    """nixl and torch_dist read the source's memory: a dead source is a typed error
    at once (not a TransferTimeout after the pull's 5 minutes). The ray backend
    copied the blocks into the object store at export, but the source process owns
    that object, and Ray drops an object whose owner died: the pull either still
    finds it (delivered, verified) or fails at once with a typed error."""
    src, sink, cache = bare_pair(backend, "decode-k")
    desc = src.call(ExportRandom(num_tokens=200)).descriptor
    src.kill()
    dst = list(range(len(desc.block_ids)))
    try:
        sink.pull(desc, dst, timeout=300.0)
    except KVTransferError as e:
        assert not isinstance(e, TransferTimeout), "a dead source must fail at once"
    else:
        assert backend == "ray", "only the ray backend can deliver from a dead source"
        assert layer_checksums(cache, dst) == desc.layer_checksums and bool(cache.view(torch.uint8).any())
    sink.close()


@pytest.mark.parametrize("backend", ["torch_dist", "nixl", "ucx"])
def test_a_killed_source_whose_child_holds_its_socket_open_fails_fast(backend):
    """A source killed while a child process of it (a subprocess started without
    ``close_fds``) still holds its inheritable sockets. For torch_dist that is gloo's
    connection, which then never closes, so gloo alone would wait out the pull's 5
    minutes; the sink sees the source's store refuse connections and fails with
    ``PeerLost`` instead (ucx: its listener). NIXL (UCX) reports the remote gone at
    once either way."""
    src, sink, _ = bare_pair(backend, "decode-o")
    desc = src.call(ExportRandom(num_tokens=200)).descriptor
    child = src.call(SpawnChild())
    src.kill()
    try:
        with pytest.raises(PeerLost):
            sink.pull(desc, list(range(len(desc.block_ids))), timeout=300.0)
    finally:
        os.kill(child, signal.SIGKILL)
        sink.close()


@pytest.mark.parametrize("backend", ["torch_dist", "ucx"])
def test_stalled_source_times_out(backend):
    """A source that stops answering (SIGSTOP) mid-protocol: TransferTimeout, on time."""
    src, sink, _ = bare_pair(backend, "decode-s")
    desc = src.call(ExportRandom(num_tokens=200)).descriptor
    os.kill(src.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            sink.pull(desc, list(range(len(desc.block_ids))), timeout=1.0)
        assert time.monotonic() - t0 >= 1.0  # not before its timeout
    finally:
        os.kill(src.proc.pid, signal.SIGCONT)
        src.kill()


@pytest.fixture(scope="module")
def streaming_source(decode_engine):
    src = start_source(SourceSpec("nixl", engine=CFG, worker_id="prefill-stream"))
    yield src
    assert src.stop() == 0


def pull_streamed(src, sink, engine: Engine, chats, faulty_layer: int | None = None):
    """Prefill ``chats`` streaming; pull each as soon as its descriptor is published
    (before the first token exists), then take the first tokens. Returns
    (exported, errors by request id)."""
    if faulty_layer is not None:
        corrupt_on_the_wire(sink, engine.kv_cache.tensor, layer=faulty_layer, byte=9)
    src.send(Prefill(chats, PARAMS, stream=True))
    streaming = src.receive()
    assert isinstance(streaming, Streaming) and len(streaming.descriptors) == len(chats)
    prompt_of = dict(zip((d.request_id for d in streaming.descriptors), chats))
    errors = {}
    for desc in streaming.descriptors:
        assert desc.stream is not None and desc.layer_checksums == ()
        blocks = engine.import_request(desc.request_id, prompt_of[desc.request_id], [], PARAMS)
        try:
            assert sink.pull(desc, blocks, timeout=60.0).delivered
        except KVTransferError as e:
            errors[desc.request_id] = e
            assert engine.abort(desc.request_id)
    exported = src.receive()
    assert [e.descriptor for e in exported] == list(streaming.descriptors)
    return exported, errors


def test_layerwise_streaming_over_nixl_equals_monolithic(streaming_source, decode_engine, chats, reference):
    sink = sink_for("nixl", decode_engine)
    sink.connect(streaming_source.handshake)
    exported, errors = pull_streamed(streaming_source, sink, decode_engine, chats)
    assert errors == {}
    for e in exported:
        decode_engine.activate(e.descriptor.request_id, e.output_token_ids)
    assert_decodes_like(decode_engine, exported, reference)
    wait_released(streaming_source, [e.descriptor.request_id for e in exported])
    sink.close()


def test_a_corrupted_layer_of_a_stream_is_detected_and_yields_no_tokens(
    streaming_source, decode_engine, chats
):
    sink = get_backend("nixl").sink("decode-c", decode_engine.kv_cache.tensor, decode_engine.kv_compat())
    sink.connect(streaming_source.handshake)
    used = decode_engine.block_manager.num_used_blocks
    exported, errors = pull_streamed(streaming_source, sink, decode_engine, chats[:1], faulty_layer=5)
    (err,) = errors.values()
    assert isinstance(err, IntegrityError) and "layer 5 " in str(err)
    assert decode_engine.step() == [] and decode_engine.block_manager.num_used_blocks == used
    assert streaming_source.call(Status()).num_exported == 1  # unconfirmed: the source keeps its lease
    sink.close()


def test_ucx_source_gone_before_the_handshake_fails_at_connect():
    """ucx checks the link at ``connect`` (a ping on the new endpoint): a source that
    is gone by then is ``PeerLost`` there, not a surprise at the first pull."""
    src = start_source(SourceSpec("ucx", layout=SMALL))
    handshake = src.handshake
    src.kill()
    cache = torch.zeros(2, 2, SMALL.num_blocks, 16, 2, 64, dtype=torch.bfloat16)
    sink = get_backend("ucx").sink("decode-g", cache, CompatInfo(model="random", layout=SMALL))
    try:
        with pytest.raises(PeerLost):
            sink.connect(handshake)
    finally:
        sink.close()
