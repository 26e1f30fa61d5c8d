"""Layer-wise KV export in one process: the ``local`` backend between two real
engines (tiny random Llama), the sink pulling on its own thread while the
prefill engine computes. Greedy outputs equal the monolithic engine's; a
corrupted layer, an export that ends early and a stalled stream each fail the
pull with a typed error instead of tokens or a hang."""

from __future__ import annotations

import queue
import threading

import pytest

from splitserve.engine.engine import Engine
from splitserve.kv_transfer import integrity
from splitserve.kv_transfer.layerwise import LayerExporter
from splitserve.wire.errors import IntegrityError, LeaseExpired, TransferTimeout
from splitserve.wire.outputs import LayerObserver
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.unit.kv_transfer.test_kv_transfer import decode_all, local_pair, make_engine, prefill

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture()
def pair(checkpoint):
    return local_pair(checkpoint)


class Gate(LayerObserver):
    """Wraps the exporter: after layer ``hold``, the engine waits until ``release`` is set."""

    def __init__(self, inner: LayerExporter, hold: int, release: threading.Event):
        self.inner, self.hold, self.release = inner, hold, release

    def step_begins(self, finishing):
        self.inner.step_begins(finishing)

    def layer_done(self, layer: int) -> None:
        self.inner.layer_done(layer)
        if layer == self.hold and not self.release.wait(60):
            raise TimeoutError("the sink never moved the first layer")


def stream_prefill(pre: Engine, source, prompts, sink_job, observer=None) -> dict[str, list[int]]:
    """Prefill ``prompts`` streaming; ``sink_job(descriptor, prompt)`` runs on another
    thread for each streamed descriptor as soon as it is published. Returns the first
    tokens by request id, in prompt order."""
    descs: queue.SimpleQueue = queue.SimpleQueue()
    exporter = LayerExporter(source, stream=True, on_stream=lambda ds: [descs.put(d) for d in ds])
    pre.layer_observer = observer(exporter) if observer else exporter
    errors: list[BaseException] = []
    ids = [pre.add_request(p, PARAMS, prefill_only=True) for p in prompts]
    prompt_of = dict(zip(ids, prompts))

    def sink_loop():
        try:
            for _ in prompts:
                desc = descs.get(timeout=60)
                sink_job(desc, prompt_of[desc.request_id])
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    t = threading.Thread(target=sink_loop)
    t.start()
    while pre.has_unfinished():
        pre.step()
    t.join(120)
    assert not t.is_alive()
    firsts = {}
    for rid in ids:
        p = pre.prefilled(rid)
        assert exporter.export(rid, p.block_ids, p.num_kv_tokens).stream is not None
        firsts[rid] = p.output_token_ids
    if errors:
        raise errors[0]
    return firsts


# kv64: a GPU cache's checksums (the kernel, interpreted here over host memory): the exporter
# hashes each layer as it is computed, the sink queues a kernel per layer as it lands
CHECKSUMS = pytest.mark.parametrize("checksum", ["xxh3-64", "kv64"])


def use_checksum(monkeypatch, checksum: str) -> None:
    if checksum != "kv64":
        return
    from splitserve.kv_transfer.device_hash import PendingKV64

    monkeypatch.setattr(integrity, "checksum_kind", lambda device_type: "kv64")
    lock, add = threading.Lock(), PendingKV64.add

    def one_at_a_time(self, planes, block_ids):  # Triton's interpreter is not thread-safe
        with lock:
            add(self, planes, block_ids)

    monkeypatch.setattr(PendingKV64, "add", one_at_a_time)


@CHECKSUMS
def test_streamed_pull_moves_layers_while_prefill_computes_and_matches_monolithic(
    pair, checkpoint, monkeypatch, checksum
):
    use_checksum(monkeypatch, checksum)
    pre, dec, source, sink = pair
    prompts = random_prompts([9, 30, 44], 512, seed=11)
    reference = make_engine(checkpoint).generate(prompts, PARAMS)
    moved_first = threading.Event()
    ranges: list[range] = []
    real_transfer = sink._transfer

    def recording(desc, dst, deadline, layers):
        real_transfer(desc, dst, deadline, layers)
        ranges.append(layers)
        if layers.start == 0:
            moved_first.set()

    sink._transfer = recording

    def pull(desc, prompt):
        blocks = dec.import_request(desc.request_id, prompt, [], PARAMS)
        assert sink.pull(desc, blocks, timeout=60).delivered

    firsts = stream_prefill(pre, source, prompts, pull, lambda ex: Gate(ex, 0, moved_first))
    # layer 0 moved while the engine was held after layer 0: before layer 1 existed
    assert ranges[0] == range(0, 1)
    for rid, first in firsts.items():
        dec.activate(rid, first)
    outs = decode_all(dec)
    for rid, ref in zip(firsts, reference):
        assert firsts[rid] + outs[rid] == ref.token_ids
    assert {e.request_id for e in source.poll()} == set(firsts)  # every lease confirmed by the pull


@CHECKSUMS
def test_a_corrupted_layer_fails_a_streamed_pull_and_yields_no_tokens(pair, monkeypatch, checksum):
    use_checksum(monkeypatch, checksum)
    pre, dec, source, sink = pair
    (prompt,) = random_prompts([40], 512, seed=12)
    real_transfer = sink._transfer

    def faulty_wire(desc, dst, deadline, layers):
        real_transfer(desc, dst, deadline, layers)
        if 1 in layers:
            dec.kv_cache.tensor[1, 0, dst[0]].view(-1)[3] += 1.0

    sink._transfer = faulty_wire
    failures = []

    def pull(desc, prompt):
        blocks = dec.import_request(desc.request_id, prompt, [], PARAMS)
        with pytest.raises(IntegrityError, match="layer 1 ") as err:
            sink.pull(desc, blocks, timeout=60)
        failures.append(err.value)
        assert dec.abort(desc.request_id)

    stream_prefill(pre, source, [prompt], pull)
    assert len(failures) == 1
    assert dec.step() == [] and dec.block_manager.num_used_blocks == 0


def test_a_stream_that_ends_early_or_stalls_fails_the_pull_instead_of_hanging(pair):
    pre, dec, source, sink = pair
    (prompt,) = random_prompts([20], 512, seed=13)
    (p,) = prefill(pre, [prompt], PARAMS)
    rid = p.request_id
    stalled = source.begin_export(rid, p.block_ids, p.num_kv_tokens)
    source.layer_ready(stalled.transfer_id, 0, integrity.layer_checksum(source.cache, 0, p.block_ids))
    blocks = dec.import_request(rid, prompt, [], PARAMS)
    with pytest.raises(TransferTimeout, match="layer 1"):  # the source never finishes layer 1
        sink.pull(stalled, blocks, timeout=0.5)
    source.release(stalled.transfer_id)  # e.g. the request was cancelled mid-prefill
    with pytest.raises(LeaseExpired, match="ended before all its layers"):
        sink.pull(stalled, blocks, timeout=60)
    assert dec.abort(rid)
    (end,) = source.poll()
    assert end.transfer_id == stalled.transfer_id
    assert source.board.can_open()  # its slot went back


def test_the_exporter_hashes_during_prefill_so_export_hashes_nothing(pair, monkeypatch):
    pre, _, source, _ = pair
    prompts = random_prompts([12, 50], 512, seed=14)
    exporter = LayerExporter(source)
    pre.layer_observer = exporter
    ids = [pre.add_request(p, PARAMS, prefill_only=True) for p in prompts]
    while pre.has_unfinished():
        pre.step()

    def no_hashing(*a, **k):
        raise AssertionError("export hashed the blocks again")

    monkeypatch.setattr(integrity, "layer_checksums", no_hashing)
    for rid in ids:
        p = pre.prefilled(rid)
        desc = exporter.export(rid, p.block_ids, p.num_kv_tokens)
        assert desc.stream is None
        monkeypatch.undo()
        assert desc.layer_checksums == integrity.layer_checksums(source.cache, p.block_ids)
        monkeypatch.setattr(integrity, "layer_checksums", no_hashing)


@pytest.mark.parametrize("chunked", [True, False])
def test_a_pull_moves_every_layer_once_in_order(pair, chunked):
    """Chunked backends move layers in order, the last one alone (so only its
    verification follows the last byte); the others move everything in one call."""
    pre, dec, source, sink = pair
    (prompt,) = random_prompts([30], 512, seed=15)
    (p,) = prefill(pre, [prompt], PARAMS)
    rid = p.request_id
    desc = source.export(rid, p.block_ids, p.num_kv_tokens)
    sink.chunked = chunked
    ranges: list[range] = []
    real_transfer = sink._transfer

    def recording(desc, dst, deadline, layers):
        ranges.append(layers)
        real_transfer(desc, dst, deadline, layers)

    sink._transfer = recording
    blocks = dec.import_request(rid, prompt, p.output_token_ids, PARAMS)
    sink.pull(desc, blocks, timeout=60)
    num_layers = source.compat.layout.num_layers
    assert num_layers > 1
    if chunked:
        assert [r.start for r in ranges] == [0] + [r.stop for r in ranges[:-1]]  # contiguous, in order
        assert ranges[-1] == range(num_layers - 1, num_layers)
    else:
        assert ranges == [range(num_layers)]
