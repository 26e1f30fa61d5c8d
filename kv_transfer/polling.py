"""The thread that keeps a worker's KV source moving.

A NIXL source only makes progress when it is polled, and a decode worker's pull
must not wait for a prefill step to end (a 512-token chunk takes over a second
on one CPU core). So ``SourcePoller`` polls the source on a thread of its own
every millisecond, under the lock the worker's engine thread also takes to
export, release and confirm; the lease ends the source reports wait in a queue
until the engine thread takes them (``ended``, on its tick) and releases the
blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

from splitserve.kv_transfer.source import KVSource
from splitserve.wire.kv import LeaseEnd

log = logging.getLogger(__name__)

IDLE_CHECK_S = 1.0  # an idle poller looks again this often, woken or not


class SourcePoller:
    def __init__(
        self,
        source: KVSource,
        lock: threading.Lock,
        name: str,
        interval_s: float = 0.001,
        idle_when_empty: bool = False,
    ):
        """``idle_when_empty``: while the source holds no export, sleep until ``wake``
        (called after an export) instead of polling every ``interval_s`` (a decode
        worker's source, which exports only the requests it moves away)."""
        self._source = source
        self._lock = lock
        self._interval_s = interval_s
        self._idle_when_empty = idle_when_empty
        self._wake = threading.Event()
        self._ended: queue.SimpleQueue[LeaseEnd] = queue.SimpleQueue()  # poller -> engine thread
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def ended(self) -> Iterator[LeaseEnd]:
        """The lease ends reported since the last call (any one thread takes them)."""
        while not self._ended.empty():
            yield self._ended.get_nowait()

    def wake(self) -> None:
        """The source holds an export now: poll it (``idle_when_empty``)."""
        self._wake.set()

    def stop(self) -> None:
        """Stop polling (waits up to 5 s for the thread)."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stopping.is_set():
            if self._idle_when_empty:
                self._wake.clear()
                if not self._source.holds_exports:
                    self._wake.wait(IDLE_CHECK_S)
                    continue
            try:
                with self._lock:
                    ended = self._source.poll()
            except Exception:  # keep polling: a stuck source would stall every pull
                log.exception("polling the KV source failed")
                ended = []
            for end in ended:
                self._ended.put(end)
            time.sleep(self._interval_s)
