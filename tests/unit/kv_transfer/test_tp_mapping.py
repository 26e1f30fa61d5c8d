"""KV head mapping between TP sizes: the plan on its own, then ``RankSink`` and
``HeadMappingSink`` over the in-process backend, checked against the unsharded
cache it came from (FP8 caches of different scales included)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from splitserve.engine.kv_quant import FP8, SCHEME
from splitserve.kv_transfer.backends.local import LocalHub, LocalSink, LocalSource
from splitserve.kv_transfer.tp_mapping import (
    HeadCopy,
    HeadMappingSink,
    RankSink,
    plan_head_copies,
    readers_of,
    shard_layout,
)
from splitserve.wire.errors import IncompatiblePeer, IntegrityError
from splitserve.wire.kv import CompatInfo
from splitserve.wire.kv_layout import KVLayout

FULL = KVLayout(num_layers=2, num_blocks=12, block_size=4, num_kv_heads=8, head_dim=8, dtype="float32")


def test_plan_merge_split_and_regroup():
    assert plan_head_copies(2, FULL) == [HeadCopy(0, 0, 4, 0, 4), HeadCopy(1, 0, 4, 4, 8)]
    assert plan_head_copies(1, shard_layout(FULL, 4, 1, 12)) == [HeadCopy(0, 2, 4, 0, 2)]
    assert plan_head_copies(4, shard_layout(FULL, 2, 1, 12)) == [
        HeadCopy(2, 0, 2, 0, 2),
        HeadCopy(3, 0, 2, 2, 4),
    ]
    assert plan_head_copies(2, shard_layout(FULL, 2, 1, 12)) == [HeadCopy(1, 0, 4, 0, 4)]
    with pytest.raises(ValueError, match="neither split over nor replicate"):
        plan_head_copies(3, FULL)


def test_plan_reads_each_replicated_head_once_from_its_lowest_rank_and_equal_groups_rank_to_rank():
    two = dataclasses.replace(FULL, num_kv_heads=2)  # 2 KV heads; TP 4 holds each on two ranks
    assert [shard_layout(two, 4, r, 1).kv_head_range for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert plan_head_copies(4, two) == [HeadCopy(0, 0, 1, 0, 1), HeadCopy(2, 0, 1, 1, 2)]
    assert [readers_of(r, 4, 1, 2) for r in range(4)] == [1, 0, 1, 0]
    # a replicated destination: decode TP 4 over 2 heads, each of its ranks one head
    assert plan_head_copies(1, shard_layout(two, 4, 3, 1)) == [HeadCopy(0, 1, 2, 0, 1)]
    assert [readers_of(r, 2, 4, 2) for r in range(2)] == [2, 2]
    # groups of one size: rank r reads all of source rank r, replicas included
    assert plan_head_copies(4, shard_layout(two, 4, 1, 1)) == [HeadCopy(1, 0, 1, 0, 1)]
    assert plan_head_copies(2, shard_layout(FULL, 2, 1, 1)) == [HeadCopy(1, 0, 4, 0, 4)]
    assert [readers_of(r, 4, 4, 2) for r in range(4)] == [1, 1, 1, 1]


def _cache(layout: KVLayout) -> torch.Tensor:
    lay = layout
    shape = (lay.num_layers, 2, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
    return torch.zeros(shape, dtype=getattr(torch, lay.dtype))


@pytest.mark.parametrize(
    "heads, src_tp, dst_tp",
    [(8, 2, 1), (8, 1, 2), (8, 4, 2), (8, 2, 4), (8, 2, 2), (2, 4, 1), (2, 4, 2), (2, 1, 4), (2, 4, 4)],
)
def test_rank_sinks_rebuild_every_destination_shard(heads, src_tp, dst_tp):
    """Each rank of the destination group pulls with a ``RankSink``: straight from the
    same rank between groups of one size, through a ``HeadMappingSink`` otherwise."""
    torch.manual_seed(0)
    model = dataclasses.replace(FULL, num_kv_heads=heads)
    full = torch.randn(_cache(model).shape)  # the model's whole KV, as TP=1 would hold it
    src_blocks = [7, 2, 9]
    hub = LocalHub()
    sources, descs = [], []
    for r in range(src_tp):
        lay = shard_layout(model, src_tp, r, model.num_blocks)
        h0, h1 = lay.kv_head_range
        cache = full[..., h0:h1, :].contiguous()
        sources.append(LocalSource(f"p{r}", cache, CompatInfo("m", lay), 30.0, hub=hub))
        readers = readers_of(r, src_tp, dst_tp, heads)
        descs.append(sources[r].export("req", src_blocks, num_tokens=10, readers=readers))
    unread = {r for r in range(src_tp) if readers_of(r, src_tp, dst_tp, heads) == 0}
    for r in unread:  # a replica nobody reads: its lease is over at once
        assert [e.state.value for e in sources[r].poll()] == ["confirmed"]
        assert descs[r].num_bytes == 0
    ended = set(unread)
    make_sink = functools.partial(LocalSink, hub=hub)
    left = [readers_of(r, src_tp, dst_tp, heads) for r in range(src_tp)]
    for d in range(dst_tp):
        lay = shard_layout(model, dst_tp, d, 6)
        dst = _cache(lay)
        sink = RankSink(f"d{d}", dst, CompatInfo("m", lay), make_sink, max_blocks=4)
        sink.connect([s.handshake() for s in reversed(sources)])  # any order
        confirmations, _ = sink.pull(tuple(descs), [5, 0, 3], timeout=10.0)
        plan = plan_head_copies(src_tp, lay)
        assert sink.maps(descs[0].source_worker) == (src_tp != dst_tp)  # staged only between sizes
        for c in plan:
            left[c.src_rank] -= 1
        # a source's lease ends confirmed with its last reader, not before (and once)
        for r, s in enumerate(sources):
            ends = [e.state.value for e in s.poll()]
            assert ends == ([] if left[r] or r in ended else ["confirmed"])
            if not left[r]:
                ended.add(r)
        assert len(confirmations) == len(plan) >= 1
        h0, h1 = lay.kv_head_range
        expected = full[:, :, src_blocks][..., h0:h1, :]
        torch.testing.assert_close(dst[:, :, [5, 0, 3]], expected, rtol=0, atol=0)
        assert dst[:, :, [1, 2, 4]].abs().sum() == 0  # nothing written elsewhere
        sink.close()
    assert left == [0] * src_tp


def test_mapping_sink_refuses_another_model_and_incomplete_groups():
    hub = LocalHub()
    src_lay = shard_layout(FULL, 2, 0, FULL.num_blocks)
    other = dataclasses.replace(FULL, head_dim=16)
    src = LocalSource("p0", _cache(other), CompatInfo("m", other), 30.0, hub=hub)
    sink = HeadMappingSink("d", _cache(FULL), CompatInfo("m", FULL), functools.partial(LocalSink, hub=hub), 4)
    with pytest.raises(IncompatiblePeer, match="head_dim"):
        sink.connect([src.handshake()])
    half = LocalSource("p1", _cache(src_lay), CompatInfo("m", src_lay), 30.0, hub=hub)
    with pytest.raises(IncompatiblePeer, match="one TP group"):
        sink.connect([half.handshake()])  # rank 0 of 2 alone


def test_corrupted_shard_fails_the_pull():
    hub = LocalHub()
    sources = []
    for r in range(2):
        lay = shard_layout(FULL, 2, r, FULL.num_blocks)
        sources.append(
            LocalSource(f"p{r}", torch.randn(_cache(lay).shape), CompatInfo("m", lay), 30.0, hub=hub)
        )
    descs = [s.export("req", [1, 2], num_tokens=8) for s in sources]
    sources[1].cache[0, 0, 2, 0, 0, 0] += 1.0  # after the checksum was taken
    sink = HeadMappingSink("d", _cache(FULL), CompatInfo("m", FULL), functools.partial(LocalSink, hub=hub), 4)
    sink.connect([s.handshake() for s in sources])
    with pytest.raises(IntegrityError, match="corrupted"):
        sink.pull(descs, [3, 4])


@pytest.mark.parametrize("src_tp, dst_tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_fp8_kv_is_rescaled_into_the_sinks_own_scales(src_tp, dst_tp):
    """FP8 caches whose scales differ (each worker calibrates its own): what a rank pulls
    is stored in its own scales and means the source's values, within e4m3's rounding
    (moved as bytes, checked by the source's checksums, then rescaled)."""
    torch.manual_seed(1)
    model = dataclasses.replace(FULL, dtype="float8_e4m3fn", kv_scales=SCHEME)
    full = torch.randn(_cache(FULL).shape)  # the model's KV in float32
    src_scales = full.abs().amax(dim=(2, 3, 5)) / 200  # [layers, 2, heads]
    dst_scales = src_scales * torch.linspace(0.6, 1.7, 8)  # another worker's calibration
    hub, sources, descs = LocalHub(), [], []
    for r in range(src_tp):
        lay = shard_layout(model, src_tp, r, model.num_blocks)
        h0, h1 = lay.kv_head_range
        own = src_scales[:, :, h0:h1]
        cache = (full[..., h0:h1, :] / own[:, :, None, None, :, None]).to(FP8)
        compat = CompatInfo("m", lay, tuple(own.flatten().tolist()))
        sources.append(LocalSource(f"p{r}", cache, compat, 30.0, hub=hub))
        descs.append(
            sources[r].export("req", [7, 2, 9], num_tokens=10, readers=readers_of(r, src_tp, dst_tp, 8))
        )
    for d in range(dst_tp):
        lay = shard_layout(model, dst_tp, d, 6)
        h0, h1 = lay.kv_head_range
        own = dst_scales[:, :, h0:h1]
        dst = torch.zeros(_cache(lay).shape, dtype=FP8)
        compat = CompatInfo("m", lay, tuple(own.flatten().tolist()))
        sink = RankSink(f"d{d}", dst, compat, functools.partial(LocalSink, hub=hub), max_blocks=4)
        sink.connect([s.handshake() for s in sources])
        sink.pull(tuple(descs), [5, 0, 3], timeout=10.0)
        got = dst.view(torch.uint8)[:, :, [5, 0, 3]].view(FP8).float() * own[:, :, None, None, :, None]
        want = full[:, :, [7, 2, 9]][..., h0:h1, :]
        big = want.abs() > 0.05 * want.abs().amax()
        # two roundings to e4m3 (source, then rescale): each at most 2**-4 relative
        assert ((got - want).abs()[big] / want.abs()[big]).max() <= 2 * 2**-4 + 2**-8
        sink.close()


def test_an_fp8_sink_refuses_a_bf16_source_at_handshake():
    hub = LocalHub()
    bf16 = dataclasses.replace(FULL, dtype="bfloat16")
    src = LocalSource(
        "p0", torch.zeros(_cache(bf16).shape, dtype=torch.bfloat16), CompatInfo("m", bf16), 30.0, hub=hub
    )
    fp8 = dataclasses.replace(FULL, dtype="float8_e4m3fn", kv_scales=SCHEME)
    scales = tuple([1.0] * (2 * 2 * 8))
    dst = torch.zeros(_cache(FULL).shape, dtype=FP8)
    sink = RankSink("d", dst, CompatInfo("m", fp8, scales), functools.partial(LocalSink, hub=hub), 4)
    with pytest.raises(IncompatiblePeer, match="dtype: 'bfloat16' there vs 'float8_e4m3fn' here"):
        sink.connect([src.handshake()])
