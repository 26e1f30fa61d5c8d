"""``TPInit``: how one rank joins its tensor-parallel group (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPInit:
    """How a rank joins its group (plain data: it is passed to each rank's process)."""

    rank: int
    size: int
    init_method: str  # e.g. "tcp://127.0.0.1:29500" (rank 0 listens there)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is not in a group of size {self.size}")
