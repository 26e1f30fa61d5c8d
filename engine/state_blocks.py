"""A hybrid model's linear-layer states, kept in the KV cache's own blocks.

A Gated DeltaNet layer's memory of a sequence is a fixed-size state (the
convolution's last inputs and the recurrent matrix, ``engine.model.deltanet``), not
KV. Each sequence that runs holds state slots (its state, the next one, a
snapshot to be: ``engine.state_slots``), and slot s is ``blocks_per_slot`` blocks
of the cache tensor past the KV blocks::

    cache[kv layer, K/V, block, ...]
    block ids   0 .. kv_blocks - 1                    the paged KV (the block manager's)
                kv_blocks + s * R .. + R - 1          slot s's states (R = blocks_per_slot)

Within slot s's R blocks, each (KV layer, plane) is a contiguous run of
``R * block_bytes`` bytes, and holds the states of the linear layers that come
before that KV layer in the model (and after the one before it), one after the
other, each whole within one run: so when KV layer l is written, every state in
its runs is final too, and a layer-wise export or hash of layer l covers them.

So the states travel as blocks: a request's export names its KV blocks and its
current slot's R blocks, and every transfer backend, checksum, live migration and TP-1
handoff moves and verifies them as it does KV (what vLLM does by sizing its
state pages as its KV pages). The bytes cost: R blocks on every KV layer and
plane for each of ``max_num_seqs`` slots, more than the states themselves where
they do not pack evenly (``StatePlan.overhead``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.deltanet import DeltaStates, delta_shape
from splitserve.wire.errors import ModelLoadError
from splitserve.wire.kv_layout import KVLayout

_ALIGN = 16  # bytes: every state part starts aligned for any dtype's view


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class StatePlan:
    """Where each linear layer's state of a slot lies: ``places[j]`` = (KV layer, plane,
    byte offset in that run) of the j-th linear layer; ``conv_bytes`` and
    ``state_bytes`` (aligned) of one layer's state; ``blocks_per_slot`` (R)."""

    blocks_per_slot: int
    places: tuple[tuple[int, int, int], ...]
    conv_bytes: int
    state_bytes: int
    block_bytes: int
    planes: int
    kv_layers: int
    tp_size: int = 1  # the rank's share of the heads (``deltanet.delta_shape``)

    @property
    def slot_bytes(self) -> int:
        """Cache bytes one slot takes (its R blocks on every KV layer and plane)."""
        return self.blocks_per_slot * self.block_bytes * self.planes * self.kv_layers

    @property
    def overhead(self) -> float:
        """Cache bytes a slot takes over its states' own bytes."""
        return self.slot_bytes / (len(self.places) * self.state_bytes)

    def signature(self) -> str:
        """What a peer must share for a slot's blocks to mean the same (``KVLayout.states``)."""
        parts = f"{self.conv_bytes}+{self.state_bytes - self.conv_bytes}B"
        return f"deltanet:{len(self.places)}x{parts}/{self.blocks_per_slot}"

    def slot_blocks(self, kv_blocks: int, slot: int) -> list[int]:
        """The block ids of ``slot``'s states, past ``kv_blocks`` KV blocks."""
        first = kv_blocks + slot * self.blocks_per_slot
        return list(range(first, first + self.blocks_per_slot))


def plan_states(cfg: ModelConfig, layout: KVLayout, dtype: torch.dtype) -> StatePlan:
    """Place a hybrid ``cfg``'s linear layers' states in slots of ``layout``'s blocks
    (its layers are the model's KV layers, its heads this rank's): each linear layer
    with the first KV layer after it. ``ModelLoadError`` for a model whose last layer is linear (its state
    would follow every KV layer)."""
    kv = cfg.kv_layers
    linear = [i for i in range(cfg.num_layers) if cfg.is_linear(i)]
    if linear and (not kv or linear[-1] > kv[-1]):
        raise ModelLoadError(
            f"{cfg.model_type}: a hybrid model whose last layer is a linear-attention one is not run yet"
        )
    s = delta_shape(cfg, layout.tp_size)
    conv = _aligned(s.conv_channels * (s.conv_width - 1) * torch.empty((), dtype=dtype).element_size())
    state = conv + _aligned(s.v_heads * s.dk * s.dv * 4)
    groups: dict[int, list[int]] = {}
    for j, layer in enumerate(linear):
        groups.setdefault(next(c for c, k in enumerate(kv) if k > layer), []).append(j)
    per_plane = -(-max(len(g) for g in groups.values()) // layout.planes)
    blocks = -(-per_plane * state // layout.block_bytes)
    places: list[tuple[int, int, int]] = [(0, 0, 0)] * len(linear)
    for c, members in groups.items():
        for k, j in enumerate(members):
            places[j] = (c, k // per_plane, (k % per_plane) * state)
    return StatePlan(
        blocks,
        tuple(places),
        conv,
        state,
        layout.block_bytes,
        layout.planes,
        layout.num_layers,
        layout.tp_size,
    )


def state_views(
    cache: torch.Tensor, plan: StatePlan, cfg: ModelConfig, kv_blocks: int, slots: int, dtype: torch.dtype
) -> list[DeltaStates]:
    """Each linear layer's ``DeltaStates`` as views of ``cache`` (laid out with
    ``kv_blocks + slots * plan.blocks_per_slot`` blocks), a row per slot."""
    s = delta_shape(cfg, plan.tp_size)
    out = []
    for layer, plane, offset in plan.places:
        run = cache[layer, plane, kv_blocks : kv_blocks + slots * plan.blocks_per_slot]
        raw = run.view(torch.uint8).reshape(slots, plan.blocks_per_slot * plan.block_bytes)
        conv = raw[:, offset : offset + s.conv_channels * (s.conv_width - 1) * _size(dtype)]
        rec = raw[:, offset + plan.conv_bytes : offset + plan.conv_bytes + s.v_heads * s.dk * s.dv * 4]
        out.append(
            DeltaStates(
                conv.view(dtype).view(slots, s.conv_channels, s.conv_width - 1),
                rec.view(torch.float32).view(slots, s.v_heads, s.dk, s.dv),
            )
        )
    return out


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class StateMapper:
    """Rebuilds a hybrid request's states pulled from a source TP group of another size
    (``kv_transfer.tp_mapping.HeadMappingSink``): each source rank holds the states of
    its share of the linear layers' heads; this rank (``layout``: its cache's) takes
    the heads of its own share from whichever source rank holds them."""

    def __init__(self, cfg: ModelConfig, layout: KVLayout, dtype: torch.dtype):
        self.cfg, self.layout, self.dtype = cfg, layout, dtype
        self.plan = plan_states(cfg, layout, dtype)

    @property
    def blocks_per_slot(self) -> int:
        """The blocks of a slot here: the last of a pull's destination blocks."""
        return self.plan.blocks_per_slot

    def copy(
        self,
        staged: dict[int, tuple[torch.Tensor, KVLayout]],
        first: int,
        cache: torch.Tensor,
        dst: list[int],
    ) -> None:
        """Fill the slot at blocks ``dst`` (consecutive) of ``cache`` from the source ranks'
        staging caches (rank -> (cache, its layout)), each holding its slot's blocks from
        block ``first`` on."""
        lin = self.cfg.linear
        mine = state_views(cache, self.plan, self.cfg, dst[0], 1, self.dtype)
        k_mine, v_mine = _heads(lin.k_heads, self.layout), _heads(lin.v_heads, self.layout)
        for staging, src in staged.values():
            theirs = state_views(
                staging, plan_states(self.cfg, src, self.dtype), self.cfg, first, 1, self.dtype
            )
            k_src, v_src = _heads(lin.k_heads, src), _heads(lin.v_heads, src)
            k0, k1 = max(k_mine[0], k_src[0]), min(k_mine[1], k_src[1])
            v0, v1 = max(v_mine[0], v_src[0]), min(v_mine[1], v_src[1])
            for to, fro in zip(mine, theirs):
                if v1 > v0:
                    to.recurrent[0, v0 - v_mine[0] : v1 - v_mine[0]] = fro.recurrent[
                        0, v0 - v_src[0] : v1 - v_src[0]
                    ]
                for rows_to, rows_fro in _conv_rows(lin, k_mine, v_mine, k_src, v_src, (k0, k1), (v0, v1)):
                    to.conv[0, rows_to] = fro.conv[0, rows_fro]


def _heads(total: int, layout: KVLayout) -> tuple[int, int]:
    """The heads [start, stop) of ``total`` that rank ``layout.tp_rank`` of ``tp_size`` holds."""
    per = total // layout.tp_size
    return layout.tp_rank * per, (layout.tp_rank + 1) * per


def _conv_rows(lin, k_to, v_to, k_fro, v_fro, ks, vs):
    """(rows here, rows there) of the convolution channels of key heads ``ks`` (their q
    and k channels) and value heads ``vs`` (their v channels), on two ranks whose heads
    are ``k_to``/``v_to`` and ``k_fro``/``v_fro``: each rank's channels are its q, then
    its k, then its v."""
    dk, dv = lin.k_head_dim, lin.v_head_dim
    keys_to, keys_fro = (k_to[1] - k_to[0]) * dk, (k_fro[1] - k_fro[0]) * dk
    out = []
    if ks[1] > ks[0]:
        for base_to, base_fro in ((0, 0), (keys_to, keys_fro)):  # q, then k
            out.append(
                (
                    slice(base_to + (ks[0] - k_to[0]) * dk, base_to + (ks[1] - k_to[0]) * dk),
                    slice(base_fro + (ks[0] - k_fro[0]) * dk, base_fro + (ks[1] - k_fro[0]) * dk),
                )
            )
    if vs[1] > vs[0]:
        out.append(
            (
                slice(2 * keys_to + (vs[0] - v_to[0]) * dv, 2 * keys_to + (vs[1] - v_to[0]) * dv),
                slice(2 * keys_fro + (vs[0] - v_fro[0]) * dv, 2 * keys_fro + (vs[1] - v_fro[0]) * dv),
            )
        )
    return out
