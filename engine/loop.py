"""Drive an ``Engine`` from one dedicated thread while other threads feed it.

The engine is not thread-safe, and a worker has other things to do (an asyncio
loop answering calls, a transfer thread). ``EngineLoop`` owns the engine on
its own thread; everything else reaches the engine through ``call``::

    loop thread, forever:
        run every queued call(fn)          # add_request, abort, import_request, ...
        step() if the engine has work      # one model step
        on_outputs(outputs)                # the worker routes deltas to requests
        on_tick()                          # leases, deadlines, transfer progress
        if idle: wait up to idle_s for a call

``on_tick`` runs at least every ``idle_s`` even when idle, which a NIXL source
needs (its progress is driven by polling). Callbacks run on the loop thread and
may use the engine directly.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from splitserve.engine.engine import Engine
from splitserve.engine.errors import EngineStopped
from splitserve.engine.outputs import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_tick: Callable[[], None] = lambda: None,
        idle_s: float = 0.005,
        name: str = "engine-loop",
        on_error: Callable[[BaseException], None] | None = None,
    ):
        """``on_error`` runs on the loop thread if a step or callback raises, or a call
        raises ``EngineStopped``, and the loop stops (after which every ``call`` fails at
        once)."""
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_tick = on_tick
        self._on_error = on_error
        self._idle_s = idle_s
        self._calls: queue.SimpleQueue[tuple[Callable[[Engine], object], Future] | None] = queue.SimpleQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None  # set when a step failed and the loop stopped

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def call(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the loop thread before the next step; the future
        holds its result or exception. Fails at once if the loop has stopped."""
        fut: Future[T] = Future()
        if self._stopping or not self._thread.is_alive():
            fut.set_exception(EngineStopped(f"the engine loop has stopped ({self.error or 'shut down'})"))
            return fut
        self._calls.put((fn, fut))
        return fut

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._calls.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- the loop thread ----------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                busy = self.engine.has_unfinished()
                self._run_calls(block=not busy)
                if self._stopping:
                    break
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    if outputs:
                        self._on_outputs(outputs)
                self._on_tick()
        except BaseException as e:  # a bug in the engine or a callback: stop loudly, fail callers
            log.exception("engine loop failed; this worker stops serving")
            self.error = e
            self._stopping = True
            if self._on_error is not None:
                try:
                    self._on_error(e)
                except Exception:
                    log.exception("the engine loop's error callback failed")
        finally:
            self._fail_pending()

    def _run_calls(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=self._idle_s) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except EngineStopped as e:  # e.g. its TP group broke: the caller learns, the loop stops
                    fut.set_exception(e)
                    raise
                except Exception as e:  # delivered to the caller, e.g. InvalidRequest
                    fut.set_exception(e)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
        self._stopping = True

    def _fail_pending(self) -> None:
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(EngineStopped("the engine loop has stopped"))
