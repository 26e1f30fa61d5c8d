"""The KV checksum a GPU computes where the KV lives (``kv_transfer.device_hash``): the
kernel, run on CPU tensors through Triton's interpreter, gives the value of its numpy
specification for the same bytes (float32, bf16, FP8, an MLA cache's one plane, blocks
larger than a tile), and every kind of wrong byte a transfer could leave changes it. On a
GPU the same tests run the compiled kernel over CUDA tensors: the device's value equals the
host's numpy value for the same bytes."""

from __future__ import annotations

import os

import pytest
import torch

from splitserve.kv_transfer.device_hash import TILE, layer_kv64, reference

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="runs in Triton's CPU interpreter or on a GPU",
)
# the kernel compiled for the GPU where there is one, else interpreted over host tensors
DEVICE = torch.device(
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)


def _stream(planes: torch.Tensor, ids: list[int]) -> bytes:
    """The bytes a transfer moves for one layer: K of each block in order, then V."""
    return b"".join(
        planes[p, b].contiguous().view(torch.uint8).cpu().numpy().tobytes()
        for p in range(planes.shape[0])
        for b in ids
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("planes_per_layer", [2, 1], ids=["k-and-v", "mla"])
def test_the_kernel_computes_its_specification(dtype, planes_per_layer):
    torch.manual_seed(1)
    cache = (
        torch.randn(3, planes_per_layer, 12, 8, 2, 32).to(dtype).to(DEVICE)
    )  # [layer, k/v, block, slot, head, dim]
    ids = [7, 2, 3, 11, 0]
    for layer in range(3):
        assert layer_kv64(cache[layer], ids) == reference(_stream(cache[layer], ids))


def test_a_block_larger_than_a_tile_is_hashed_whole():
    cache = torch.randn(1, 2, 4, 16, 4, 64, device=DEVICE)  # 4096 words a block: four tiles
    assert cache[0, 0, 0].numel() > 2 * TILE
    assert layer_kv64(cache[0], [3, 1]) == reference(_stream(cache[0], [3, 1]))


def test_every_wrong_byte_changes_it():
    torch.manual_seed(2)
    planes = torch.randn(2, 8, 4, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    ids = [1, 4, 5, 6]
    right = layer_kv64(planes, ids)
    flipped = planes.clone()
    flipped.view(torch.uint8).view(-1)[4 * planes[0, 0].numel() * 2 + 7] ^= 1  # a bit of block 4's K
    assert layer_kv64(flipped, ids) != right
    assert layer_kv64(planes, [1, 5, 4, 6]) != right  # two blocks in each other's place
    swapped = planes.flip(0).contiguous()  # K and V in each other's place
    assert layer_kv64(swapped, ids) != right
    shifted = planes.clone()  # two words of a block in each other's place
    words = shifted.view(torch.uint8).view(torch.int32).view(-1)
    at = 5 * (planes[0, 0].numel() // 2)
    words[at], words[at + 1] = words[at + 1].clone(), words[at].clone()
    assert words[at] != words[at + 1] and layer_kv64(shifted, ids) != right
    assert layer_kv64(planes, ids[:3]) != right  # a block short


def test_a_pull_verifies_each_layer_by_kernel_and_catches_a_wrong_byte(monkeypatch):
    """A cache hashed with kv64 (a GPU's; here forced on a host cache, the kernel
    interpreted): the source's checksums of every layer come from one queued batch, the
    sink queues each layer's kernel as its chunk lands and reads them back once; the
    values equal the specification's, and a byte changed after the export fails the pull
    naming its layer."""
    from splitserve.kv_transfer import get_backend, integrity
    from splitserve.kv_transfer.backends.local import LocalHub
    from splitserve.wire.errors import IntegrityError
    from splitserve.wire.kv import CompatInfo
    from splitserve.wire.kv_layout import KVLayout

    monkeypatch.setattr(integrity, "checksum_kind", lambda device_type: "kv64")
    layout = KVLayout(
        num_layers=3, num_kv_heads=2, head_dim=32, num_blocks=12, block_size=4, dtype="bfloat16"
    )
    shape = (3, 2, 12, 4, 2, 32)
    src = torch.randn(shape, dtype=torch.bfloat16, device=DEVICE)
    hub, backend, compat = LocalHub(), get_backend("local"), CompatInfo("random", layout, checksum="kv64")
    source = backend.source("prefill-0", src, compat, lease_s=30.0, hub=hub)
    dst = torch.zeros_like(src)
    sink = backend.sink("decode-0", dst, compat, hub=hub)
    sink.MIN_CHUNK_BYTES = sink.MIN_DEVICE_CHUNK_BYTES = 1  # a chunk per layer
    sink.connect(source.handshake())
    ids, into = [7, 2, 3, 11], [0, 5, 1, 9]
    desc = source.export("r1", ids, 16)
    assert list(desc.layer_checksums) == [reference(_stream(src[layer], ids)) for layer in range(3)]
    sink.pull(desc, into, timeout=30.0)
    assert torch.equal(dst[:, :, into], src[:, :, ids])

    bad = source.export("r2", ids, 16)
    src[1, 1, 3].view(-1)[5] += 1.0  # layer 1's V of the third block, after its checksum was taken
    with pytest.raises(IntegrityError, match="layer 1 "):
        sink.pull(bad, into, timeout=30.0)
