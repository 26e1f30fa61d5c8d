"""The tensor-parallel process group: one process per rank, collectives through
``torch.distributed`` (NCCL for GPU tensors, gloo for CPU tensors and for the
small control messages the driver rank broadcasts each step).

``TPGroup.single()`` is the group of one: every collective is the identity and
``torch.distributed`` is never touched, so TP=1 costs nothing.

A collective that fails (a rank died: its peers see the connection close) raises
``GroupBroken``, and so does every collective after it, at once: a broken group
never waits on a rank that is gone.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from splitserve.wire.errors import GroupBroken
from splitserve.wire.tp import TPInit


class TPGroup:
    """This process's place in its tensor-parallel group and the collectives the model needs."""

    def __init__(self, rank: int, size: int, device_group: Any = None, cpu_group: Any = None):
        self.rank, self.size = rank, size
        self._device_group = device_group
        self._cpu_group = cpu_group
        self.broken: str = ""  # why a collective failed; the group is unusable from then on

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1)

    @classmethod
    def join(cls, init: TPInit, device: torch.device) -> TPGroup:
        """Initialise ``torch.distributed`` for this rank and return its group.
        Blocks until every rank has joined (or ``timeout_s`` passes)."""
        if init.size == 1:
            return cls.single()
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=init.timeout_s)
        dist.init_process_group(
            backend, init_method=init.init_method, rank=init.rank, world_size=init.size, timeout=timeout
        )
        cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        return cls(init.rank, init.size, dist.group.WORLD, cpu_group)

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules and samples; the other ranks follow its steps."""
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        if self.size > 1:
            self._collective(dist.all_reduce, t, group=self._device_group)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``t`` (equal shapes) along the last dimension, in rank order."""
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._collective(dist.all_gather, parts, t.contiguous(), group=self._device_group)
        return torch.cat(parts, dim=-1)

    def all_to_all_rows(
        self, t: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Send rows of ``t`` to every rank: the first ``send_counts[0]`` to rank 0, the
        next ``send_counts[1]`` to rank 1, ...; returns the rows received, in source rank
        order, and how many came from each rank (``recv_counts``, exchanged first when not
        given). Every rank calls it, whether it sends rows or none."""
        if self.size == 1:
            return t, list(send_counts)
        if recv_counts is None:
            counts = torch.tensor(send_counts, dtype=torch.long, device=t.device)
            got = torch.empty_like(counts)
            self._collective(dist.all_to_all_single, got, counts, group=self._device_group)
            recv_counts = got.tolist()
        out = t.new_empty((sum(recv_counts), *t.shape[1:]))
        self._collective(
            dist.all_to_all_single, out, t.contiguous(), recv_counts, send_counts, group=self._device_group
        )
        return out, recv_counts

    def all_gather_rows(self, t: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's rows of ``t`` (``counts[r]`` on rank r, known to every rank),
        concatenated in rank order, on every rank."""
        if self.size == 1:
            return t
        most = max(counts)
        padded = t.new_zeros((most, *t.shape[1:]))
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._collective(dist.all_gather, parts, padded, group=self._device_group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    def broadcast_object(self, obj: Any = None) -> Any:
        """The driver's ``obj`` on every rank (pickled; for small control messages)."""
        if self.size == 1:
            return obj
        box = [obj]
        self._collective(dist.broadcast_object_list, box, src=0, group=self._cpu_group)
        return box[0]

    def gather_object(self, obj: Any = None) -> list[Any] | None:
        """Every rank's ``obj`` on the driver, in rank order (None on the other ranks)."""
        if self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_driver else None
        self._collective(dist.gather_object, obj, out, dst=0, group=self._cpu_group)
        return out

    def min_int(self, n: int) -> int:
        """The smallest of every rank's ``n``, on every rank."""
        if self.size == 1:
            return n
        every = self.gather_object(n)
        return self.broadcast_object(min(every) if every is not None else None)

    def _collective(self, fn, *args, **kwargs) -> None:
        if self.broken:
            raise GroupBroken(f"tensor-parallel rank {self.rank} has lost its group: {self.broken}")
        try:
            fn(*args, **kwargs)
        except RuntimeError as e:  # gloo/NCCL: a peer closed its connection, or timed out
            self.broken = str(e).splitlines()[0] if str(e) else e.__class__.__name__
            raise GroupBroken(f"tensor-parallel rank {self.rank} has lost its group: {self.broken}") from e

    def shard_range(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of ``n`` items split evenly (``n`` divisible by size)."""
        if n % self.size:
            raise ValueError(f"{n} does not split evenly over {self.size} tensor-parallel ranks")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def destroy(self) -> None:
        """Leave the group and drop this object's references to its process groups.
        gloo's transport threads may outlive this (torch keeps the device) until the
        process exits; a process that must exit cleanly right after can end with
        ``os._exit`` (see ``tests/integration/tp_ranks.py``)."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self._device_group = self._cpu_group = None
