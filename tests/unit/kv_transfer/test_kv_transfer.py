"""The KV transfer contract in one process: runs and checksums, the state
machine, handshake checks, leases, integrity, restarts — through the ``local``
backend between two real engines (tiny random Llama). The cross-process
backends have their own tests in tests/integration."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from splitserve.engine.engine import Engine
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.backends.local import LocalHub
from splitserve.kv_transfer.integrity import layer_checksums, paired_runs, runs
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import IncompatiblePeer, IntegrityError, LeaseExpired, PeerLost
from splitserve.wire.kv import CompatInfo, TransferState, check_transition
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.waiting import wait_until

PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def test_runs_coalesce_consecutive_ids():
    assert runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert paired_runs([3, 4, 5, 9], [0, 1, 7, 8]) == [(3, 0, 2), (5, 7, 1), (9, 8, 1)]
    with pytest.raises(ValueError):
        paired_runs([1, 2], [1])


def test_layer_checksums_see_flips_swaps_and_other_blocks():
    cache = torch.randn(2, 2, 8, 4, 2, 8).to(torch.bfloat16)
    base = layer_checksums(cache, [1, 2, 5])
    assert len(base) == 2 and base[0] != base[1]
    assert layer_checksums(cache.clone(), [1, 2, 5]) == base
    swapped = layer_checksums(cache, [2, 1, 5])  # order matters: a swapped block is an error
    assert swapped[0] != base[0] and swapped[1] != base[1]
    assert layer_checksums(cache, [1, 2, 6]) != base
    cache[1, 1, 5].view(-1).view(torch.uint8)[3] ^= 1  # one bit of the last layer's V
    flipped = layer_checksums(cache, [1, 2, 5])
    assert flipped[0] == base[0] and flipped[1] != base[1]  # names the layer
    cache[1, 1, 5].view(-1).view(torch.uint8)[3] ^= 1
    cache[0, 0, 0] = 0  # a block not in the set
    assert layer_checksums(cache, [1, 2, 5]) == base


def test_state_machine_rejects_illegal_steps():
    s = check_transition(None, TransferState.PULLING)
    s = check_transition(s, TransferState.VERIFYING)
    assert check_transition(s, TransferState.DONE) is TransferState.DONE
    with pytest.raises(RuntimeError):
        check_transition(TransferState.CONFIRMED, TransferState.EXPIRED)
    with pytest.raises(RuntimeError):
        check_transition(TransferState.PULLING, TransferState.DONE)  # never without verifying


def make_engine(checkpoint, **kw) -> Engine:
    cfg = dict(
        model=str(checkpoint), dtype="float32", block_size=8, max_num_batched_tokens=64, num_kv_blocks=64
    )
    return Engine(EngineConfig(**{**cfg, **kw}))


def compat(engine: Engine, model: str = "tiny") -> CompatInfo:
    return CompatInfo(model, engine.kv_cache.layout, engine.kv_cache.scale_values())


@pytest.fixture()
def pair(checkpoint):
    return local_pair(checkpoint)


def local_pair(checkpoint):
    """(prefill engine, decode engine, source, sink) joined by the local backend."""
    hub = LocalHub()
    backend = get_backend("local")
    pre, dec = make_engine(checkpoint), make_engine(checkpoint, num_kv_blocks=48)
    source = backend.source("prefill-0", pre.kv_cache.tensor, compat(pre), lease_s=30.0, hub=hub)
    sink = backend.sink("decode-0", dec.kv_cache.tensor, compat(dec), hub=hub)
    sink.connect(source.handshake())
    return pre, dec, source, sink


def prefill(engine: Engine, prompts, params=PARAMS) -> list:
    ids = [engine.add_request(p, params, prefill_only=True) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.prefilled(i) for i in ids]


def decode_all(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_local_handover_matches_monolithic(pair, checkpoint):
    pre, dec, source, sink = pair
    prompts = random_prompts([5, 17, 40, 33], 512, seed=3)
    reference = make_engine(checkpoint).generate(prompts, PARAMS)
    done = prefill(pre, prompts)
    for p in done:
        desc = source.export(p.request_id, p.block_ids, p.num_kv_tokens)
        blocks = dec.import_request(p.request_id, p.prompt_token_ids, p.output_token_ids, PARAMS)
        conf = sink.pull(desc, blocks, timeout=5.0)
        assert conf.delivered
        dec.activate(p.request_id)
    ended = source.poll()
    assert {e.request_id for e in ended} == {p.request_id for p in done}
    assert all(e.state is TransferState.CONFIRMED for e in ended)
    for e in ended:
        pre.release(e.request_id)
    assert pre.block_manager.num_used_blocks == 0
    outs = decode_all(dec)
    for p, ref in zip(done, reference):
        assert p.output_token_ids + outs[p.request_id] == ref.token_ids


def test_lease_expiry_frees_prefill_blocks_and_refuses_late_pulls(pair):
    pre, dec, source, sink = pair
    (p,) = prefill(pre, random_prompts([30], 512, seed=4))
    assert pre.block_manager.num_used_blocks > 0
    desc = source.export(p.request_id, p.block_ids, p.num_kv_tokens, lease_s=0.2)
    ended = []
    wait_until(lambda: ended.extend(source.poll()) or ended, "the lease expired", 60, 0.01)
    assert time.time() >= desc.lease_expiry  # not reported before it ran out
    (end,) = ended
    assert end.state is TransferState.EXPIRED and end.request_id == p.request_id
    pre.release(end.request_id)
    assert pre.block_manager.num_used_blocks == 0
    blocks = dec.import_request(p.request_id, p.prompt_token_ids, p.output_token_ids, PARAMS)
    with pytest.raises(LeaseExpired):
        sink.pull(desc, blocks)
    dec.abort(p.request_id)
    assert dec.block_manager.num_used_blocks == 0


def test_corrupted_bytes_fail_the_transfer_and_yield_no_tokens(pair):
    pre, dec, source, sink = pair
    (p,) = prefill(pre, random_prompts([21], 512, seed=5))
    desc = source.export(p.request_id, p.block_ids, p.num_kv_tokens)
    pre.kv_cache.tensor[-1, 1, p.block_ids[0]].view(-1)[5] += 1.0  # after the checksum was taken
    blocks = dec.import_request(p.request_id, p.prompt_token_ids, p.output_token_ids, PARAMS)
    with pytest.raises(IntegrityError, match="corrupted"):
        sink.pull(desc, blocks)
    assert dec.abort(p.request_id)
    assert dec.step() == [] and dec.block_manager.num_used_blocks == 0
    assert source.poll() == []  # not confirmed: the source keeps the lease


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(model="another-model"), "weights"),
        (dict(dtype="bfloat16"), "dtype"),
        (dict(block_size=16), "block_size"),
        (dict(tp_size=2), "tp_size"),
        (dict(checksum="kv64"), "checksum: 'xxh3-64' there vs 'kv64' here"),  # a cache on a GPU
    ],
)
def test_handshake_refuses_incompatible_peers(pair, change, field):
    pre, _, source, _ = pair
    layout = pre.kv_cache.layout
    layout_change = {k: v for k, v in change.items() if k in ("dtype", "block_size", "tp_size")}
    other = CompatInfo(
        model=change.get("model", "tiny"),
        layout=dataclasses.replace(layout, **layout_change),
        checksum=change.get("checksum", "xxh3-64"),
    )
    lay = other.layout
    cache = torch.zeros(
        lay.num_layers,
        2,
        lay.num_blocks,
        lay.block_size,
        lay.num_kv_heads,
        lay.head_dim,
        dtype=getattr(torch, lay.dtype),
    )
    sink = get_backend("local").sink("decode-1", cache, other, hub=source.hub)
    with pytest.raises(IncompatiblePeer, match=field):
        sink.connect(source.handshake())
    bad_version = dataclasses.replace(source.handshake(), version=99)
    with pytest.raises(IncompatiblePeer, match="protocol v99"):
        get_backend("local").sink(
            "decode-2", pre.kv_cache.tensor.clone(), compat(pre), hub=source.hub
        ).connect(bad_version)


def test_descriptor_from_a_restarted_source_is_refused(pair, checkpoint):
    pre, dec, source, sink = pair
    (p,) = prefill(pre, random_prompts([12], 512, seed=6))
    desc = source.export(p.request_id, p.block_ids, p.num_kv_tokens)
    source.close()
    restarted = get_backend("local").source(
        "prefill-0", pre.kv_cache.tensor, compat(pre), 30.0, hub=source.hub
    )
    sink.connect(restarted.handshake())  # the new incarnation replaces the old link
    blocks = dec.import_request(p.request_id, p.prompt_token_ids, p.output_token_ids, PARAMS)
    with pytest.raises(PeerLost, match="restarted"):
        sink.pull(desc, blocks)


def test_a_backend_failing_to_link_a_peer_is_a_lost_peer(pair, checkpoint, monkeypatch):
    """A transfer library's own exception while linking (NIXL's, for a source that died
    between its handshake and the link) is ``PeerLost``, which the router recomputes
    after, not an unknown error that reaches the client as INTERNAL."""
    pre, dec, source, sink = pair
    source.close()
    restarted = get_backend("local").source(
        "prefill-0", pre.kv_cache.tensor, compat(pre), 30.0, hub=source.hub
    )

    def refuse(hs, replacing):
        raise RuntimeError("remote agent metadata is stale")

    monkeypatch.setattr(sink, "_connect", refuse)
    with pytest.raises(PeerLost, match="connecting to worker prefill-0 failed: RuntimeError"):
        sink.connect(restarted.handshake())
    assert sink.peers["prefill-0"].incarnation != restarted.handshake().incarnation  # the old link stays


def test_unknown_backend_and_bad_cache_are_clear_errors(pair):
    pre, *_ = pair
    with pytest.raises(ValueError, match="unknown KV transfer backend 'carrier-pigeon'"):
        get_backend("carrier-pigeon")
    with pytest.raises(ValueError, match="does not match layout"):
        get_backend("local").sink("d", torch.zeros(3), compat(pre), hub=LocalHub())
