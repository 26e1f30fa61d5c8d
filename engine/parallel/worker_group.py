"""What every worker hosting a TP group shares, prefill or decode: joining the group
from a worker's process, and the heartbeat that keeps idle ranks in it.

Ranks above 0 wait in ``Engine.follow`` for rank 0's next broadcast; a wait
longer than the group's collective timeout fails, so an idle rank 0 broadcasts
a ``Heartbeat`` every quarter of that timeout (``Heartbeats.tick`` on its
engine thread), and the followers ignore it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from splitserve.engine.parallel.group import TPGroup
from splitserve.wire.tp import TPInit

log = logging.getLogger(__name__)


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


class RankFollower:
    """The thread of rank r > 0: builds the rank's engine (``build``) on itself, the
    thread that will step it (engine/loop.py says why), and, once ``start`` is called
    (the rank has set up what ``on_message`` uses), follows rank 0's steps
    (``Engine.follow``, other messages to ``on_message``) until rank 0 stops the group
    or the group breaks; ``on_exit`` runs on it last, to close what the rank holds.
    The constructor returns once the engine is built (``engine``), or raises what the
    build raised."""

    def __init__(
        self,
        build: Callable[[], Any],
        on_message: Callable[[Any], None],
        on_exit: Callable[[], None],
        name: str,
    ):
        built: Future = Future()
        self._on_message, self._on_exit = on_message, on_exit
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(build, built), name=name, daemon=True)
        self._thread.start()
        self.engine = built.result()

    def start(self) -> None:
        self._go.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self, build: Callable[[], Any], built: Future) -> None:
        try:
            engine = build()
        except BaseException as e:  # the constructor raises it
            built.set_exception(e)
            return
        built.set_result(engine)
        self._go.wait()
        try:
            engine.follow(self._on_message)
        except Exception:
            log.exception("%s lost its TP group", self._thread.name)
        finally:
            self._on_exit()


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
