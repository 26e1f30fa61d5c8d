"""What every worker hosting a TP group shares, prefill or decode: joining the group
from a worker's process, and the heartbeat that keeps idle ranks in it.

Ranks above 0 wait in ``Engine.follow`` for rank 0's next broadcast; a wait
longer than the group's collective timeout fails, so an idle rank 0 broadcasts
a ``Heartbeat`` every quarter of that timeout (``Heartbeats.tick`` on its
engine thread), and the followers ignore it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.tp_init import TPInit


@dataclass(frozen=True)
class Heartbeat:
    """Rank 0 is alive and idle (a message the followers ignore)."""


def join_group(
    tp: TPInit | None,
    device: torch.device,
    cpu_ids: tuple[int, ...] | None = None,
    torch_threads: int | None = None,
) -> TPGroup:
    """Pin this process to ``cpu_ids`` and size torch's threads, then join the TP group
    ``tp`` says (blocks until every rank has joined); ``tp`` None: the group of one."""
    if cpu_ids:
        os.sched_setaffinity(0, cpu_ids)
    if torch_threads:
        torch.set_num_threads(torch_threads)
    if tp is None:
        return TPGroup.single()
    return TPGroup.join(tp, device)


class Heartbeats:
    """Rank 0's side: ``tick`` broadcasts a ``Heartbeat`` when a quarter of the group's
    timeout passed since the last one (a no-op in a group of one)."""

    def __init__(self, group: TPGroup, tp: TPInit | None):
        self.group = group
        self.interval_s = tp.timeout_s / 4 if tp is not None and group.size > 1 else None
        self._last = time.monotonic()

    def tick(self) -> None:
        if self.interval_s is not None and time.monotonic() - self._last > self.interval_s:
            self.group.broadcast_object(Heartbeat())
            self._last = time.monotonic()
