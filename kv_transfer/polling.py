"""The thread that keeps a prefill worker's KV source moving.

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


class SourcePoller:
    def __init__(self, source: KVSource, lock: threading.Lock, name: str, interval_s: float = 0.001):
        self._source = source
        self._lock = lock
        self._interval_s = interval_s
        self._ended: queue.SimpleQueue[LeaseEnd] = queue.SimpleQueue()  # poller -> engine thread
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def ended(self) -> Iterator[LeaseEnd]:
        """The lease ends reported since the last call (any one thread takes them)."""
        while not self._ended.empty():
            yield self._ended.get_nowait()

    def stop(self) -> None:
        """Stop polling (waits up to 5 s for the thread)."""
        self._stopping.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                with self._lock:
                    ended = self._source.poll()
            except Exception:  # keep polling: a stuck source would stall every pull
                log.exception("polling the KV source failed")
                ended = []
            for end in ended:
                self._ended.put(end)
            time.sleep(self._interval_s)
