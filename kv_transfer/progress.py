"""The progress board: how a source tells sinks which layers of a streamed export
are ready, without a message per layer.

One int64 tensor per source, one row per slot::

    row = [serial, layers ready, checksum of layer 0, ..., checksum of layer L-1]

The source (one writer thread) opens a slot per streamed export and writes a
layer's checksum *before* raising the ready count. Sinks only read rows: in
process (``local``) or with a one-sided read of the registered tensor
(``nixl``). A slot belongs to an export while the row's serial is the
descriptor's; closing a slot zeroes the serial, so a reader of an ended export
sees the mismatch instead of another export's progress. Checksums are stored as
the int64 with the same bits.
"""

from __future__ import annotations

import torch

from splitserve.wire.errors import LeaseExpired
from splitserve.wire.kv import LayerProgress, StreamSlot

_SIGN = 1 << 63


def to_signed(value: int) -> int:
    return value - (1 << 64) if value >= _SIGN else value


def to_unsigned(value: int) -> int:
    return value + (1 << 64) if value < 0 else value


class ProgressBoard:
    """The source's rows of streamed-export progress (see the module docstring)."""

    def __init__(self, num_layers: int, num_slots: int):
        if num_layers < 1 or num_slots < 1:
            raise ValueError("a progress board needs at least one layer and one slot")
        self.num_layers = num_layers
        self.tensor = torch.zeros(num_slots, 2 + num_layers, dtype=torch.int64)
        self._free = list(range(num_slots - 1, -1, -1))
        self._serial = 0

    @property
    def row_bytes(self) -> int:
        return self.tensor.shape[1] * 8

    def can_open(self) -> bool:
        return bool(self._free)

    def open(self) -> StreamSlot:
        """Take a free slot for a new export (``can_open`` first: ``RuntimeError`` if none)."""
        if not self._free:
            raise RuntimeError("no free progress slot")
        slot = self._free.pop()
        self._serial += 1
        row = self.tensor[slot]
        row.zero_()
        row[0] = self._serial
        return StreamSlot(slot, self._serial)

    def publish(self, ref: StreamSlot, layer: int, checksum: int) -> None:
        """Layer ``layer`` is final: its checksum, then the ready count (layers in order)."""
        row = self.tensor[ref.slot]
        if int(row[0]) != ref.serial or int(row[1]) != layer:
            raise RuntimeError(f"layer {layer} published out of order on slot {ref}")
        row[2 + layer] = to_signed(checksum)
        row[1] = layer + 1

    def close(self, ref: StreamSlot) -> None:
        row = self.tensor[ref.slot]
        if int(row[0]) == ref.serial:
            row[0] = 0
            self._free.append(ref.slot)


def parse_row(values: list[int], ref: StreamSlot, transfer_id: str) -> LayerProgress:
    """A row as read by a sink; ``LeaseExpired`` if the slot no longer belongs to the export."""
    if values[0] != ref.serial:
        raise LeaseExpired(f"the export {transfer_id} ended before all its layers were ready")
    return LayerProgress(int(values[1]), tuple(to_unsigned(v) for v in values[2:]))
