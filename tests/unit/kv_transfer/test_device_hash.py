"""The KV checksum a GPU computes where the KV lives (``kv_transfer.device_hash``): the
kernel, run on CPU tensors through Triton's interpreter, gives the value of its numpy
specification for the same bytes (float32, bf16, FP8, an MLA cache's one plane, blocks
larger than a tile), and every kind of wrong byte a transfer could leave changes it."""

from __future__ import annotations

import os

import pytest
import torch

from splitserve.kv_transfer.device_hash import TILE, layer_kv64, reference

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="runs in Triton's CPU interpreter or on a GPU",
)


def _stream(planes: torch.Tensor, ids: list[int]) -> bytes:
    """The bytes a transfer moves for one layer: K of each block in order, then V."""
    return b"".join(
        planes[p, b].contiguous().view(torch.uint8).numpy().tobytes()
        for p in range(planes.shape[0])
        for b in ids
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("planes_per_layer", [2, 1], ids=["k-and-v", "mla"])
def test_the_kernel_computes_its_specification(dtype, planes_per_layer):
    torch.manual_seed(1)
    cache = torch.randn(3, planes_per_layer, 12, 8, 2, 32).to(dtype)  # [layer, k/v, block, slot, head, dim]
    ids = [7, 2, 3, 11, 0]
    for layer in range(3):
        assert layer_kv64(cache[layer], ids) == reference(_stream(cache[layer], ids))


def test_a_block_larger_than_a_tile_is_hashed_whole():
    cache = torch.randn(1, 2, 4, 16, 4, 64)  # 4096 words a block: four tiles
    assert cache[0, 0, 0].numel() > 2 * TILE
    assert layer_kv64(cache[0], [3, 1]) == reference(_stream(cache[0], [3, 1]))


def test_every_wrong_byte_changes_it():
    torch.manual_seed(2)
    planes = torch.randn(2, 8, 4, 2, 16, dtype=torch.bfloat16)
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
