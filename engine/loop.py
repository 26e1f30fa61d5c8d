"""Drive an ``Engine`` from one dedicated thread while other threads feed it.

The engine is not thread-safe, and a worker has other things to do (an asyncio
loop answering calls, a transfer thread). ``EngineLoop`` owns the engine on
its own thread; everything else reaches the engine through ``submit`` (a command
record, ``wire.engine_commands``) or ``call`` (a function of the engine, for the
worker's own parts that run on this thread: its KV source, its export ledger)::

    loop thread, forever:
        run every queued call(fn)          # add_request, abort, import_request, ...
        step_tokens() if the engine has work   # one model step: token ids, no text
        on_outputs(outputs)                # the worker makes text (engine.text), routes deltas
        on_tick()                          # leases, deadlines, transfer progress
        if idle: wait up to idle_s for a call

``on_tick`` runs at least every ``idle_s`` even when idle, which a NIXL source
needs (its progress is driven by polling). Callbacks run on the loop thread and
may use the engine directly.

A ``paced`` loop's consumer takes the outputs on another thread (a worker makes their
text there: ``engine.text``) and says so with ``taken()`` once per ``on_outputs``; the
loop starts a step only once every hand-over but the last was taken, so the step that
makes one batch of outputs overlaps the making of the previous one's text, and what
the consumer asked on taking a batch (an abort at a stop string) runs before the step
after next: a request ends within one step of the output that ended it.

Workers give the loop a function that builds their engine, not an engine: it
runs on the loop thread, so the thread that steps the engine is the one that
first ran torch's parallel regions. libgomp (torch's OpenMP on Linux) keeps a
team of helper threads for every thread that has run one, and once the process
holds more such threads than cores, every team's helpers sleep between regions
instead of spinning. An engine built on the actor's thread and stepped on this
one ran its decode steps 1.5-1.9x slower with 2 threads on 2 cores (its helper
thread idle half the time); built here, as fast as on a main thread.
"""

from __future__ import annotations

import atexit
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from splitserve.engine import commands
from splitserve.engine.engine import Engine
from splitserve.engine.parallel.group import TPGroup
from splitserve.wire.config import EngineConfig
from splitserve.wire.engine_commands import EngineCommand
from splitserve.wire.errors import EngineStopped
from splitserve.wire.outputs import RequestOutput, ThreadTimes

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    def __init__(
        self,
        engine: Engine | Callable[[], Engine],
        on_outputs: Callable[[list[RequestOutput]], None],
        on_tick: Callable[[], None] = lambda: None,
        idle_s: float = 0.005,
        name: str = "engine-loop",
        on_error: Callable[[BaseException], None] | None = None,
        paced: bool = False,
    ):
        """``engine``: the engine, or a function that builds it, which ``build`` runs on
        the loop thread (see the module docstring) before ``start`` starts the steps.
        ``on_error`` runs on the loop thread if a step or callback raises, or a call
        raises ``EngineStopped``, and the loop stops (after which every ``call`` fails at
        once). ``paced``: the consumer calls ``taken`` for each ``on_outputs``."""
        self._build = None if isinstance(engine, Engine) else engine
        self.engine: Engine | None = engine if isinstance(engine, Engine) else None
        self._built = threading.Event()
        self._go = threading.Event()  # set by start(): the thread leaves the build and steps
        self._build_error: BaseException | None = None
        self._on_outputs = on_outputs
        self._on_tick = on_tick
        self._on_error = on_error
        self._idle_s = idle_s
        self._calls: queue.SimpleQueue[tuple[Callable[[Engine], object], Future] | None] = queue.SimpleQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None  # set when a step failed and the loop stopped
        self._lenders: dict[str, commands.Lender] = {}  # by name: add_lender
        self._paced = paced
        self._untaken = 0  # hand-overs the consumer has not taken yet (paced)
        self._taking = threading.Condition()
        # where the thread's time goes (thread_times): set and summed on the loop thread
        self._native_id: int | None = None  # set as the loop starts stepping
        self._since, self._sched_base = 0.0, (0.0, 0.0)
        self._waits = _Waits()  # replaced whole, on the loop thread; read by any
        self._froze = False  # start froze the heap (stop lets it go)

    def build(self) -> Engine:
        """Start the loop thread and build the engine there; return it once built (or
        raise what the build raised). The thread takes no calls and runs no steps until
        ``start``, so the caller can finish setting up what its callbacks use."""
        if not self._thread.is_alive() and not self._built.is_set():
            self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        return self.engine

    def start(self) -> EngineLoop:
        """Build the engine if ``build`` has not, then start stepping it. What the process
        holds by then (the engine, and the worker set up around it) is frozen out of the
        cyclic garbage collector's sight until ``stop`` (``_freeze_heap``)."""
        self.build()
        if not self._froze:
            self._froze = True
            _freeze_heap()
        self._go.set()
        return self

    @classmethod
    def for_worker(
        cls,
        worker_id: str,
        config: EngineConfig,
        tp: TPGroup | None,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_tick: Callable[[], None],
        on_error: Callable[[BaseException], None],
        paced: bool = False,
    ) -> EngineLoop:
        """A worker's loop, named after it, whose engine (``config`` on ``tp``) is built
        on the loop's own thread by ``build`` (the module docstring says why)."""
        build = lambda: Engine(config, tp=tp)  # noqa: E731
        return cls(build, on_outputs, on_tick, name=f"{worker_id}-engine", on_error=on_error, paced=paced)

    def submit(self, command: EngineCommand) -> Future:
        """Run ``command`` (``wire.engine_commands``) on the loop thread before the next
        step: what a worker asks of its engine. The future holds its result or error."""
        return self.call(lambda engine: commands.run(engine, command, self._lenders))

    def add_lender(self, name: str, lender: commands.Lender) -> None:
        """Let commands naming ``name`` lend KV through ``lender`` (before ``start``)."""
        self._lenders[name] = lender

    def call(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the loop thread before the next step; the future
        holds its result or exception. Fails at once if the loop has stopped."""
        fut: Future[T] = Future()
        if self._stopping or not self._thread.is_alive():
            fut.set_exception(EngineStopped(f"the engine loop has stopped ({self.error or 'shut down'})"))
            return fut
        self._calls.put((fn, fut))
        return fut

    def taken(self) -> None:
        """A paced loop's consumer took one ``on_outputs`` hand-over (any thread)."""
        with self._taking:
            self._untaken -= 1
            self._taking.notify()

    def thread_times(self) -> ThreadTimes:
        """Where the loop's thread spent its time since it began stepping
        (``wire.outputs.ThreadTimes``; any thread). A wait counts only the time the thread
        slept in it: what it ran or waited for a core meanwhile (ticks, wake-ups) is the
        kernel's part, so no second is counted twice; the parts are read one after
        another, the wall time last, so they add up to at most the wall time."""
        if self._native_id is None:  # not stepping yet
            return ThreadTimes(0.0, 0.0, 0.0, 0.0, 0.0)
        sched = _schedstat(self._native_id)
        on_cpu, runnable = (now - then for now, then in zip(sched, self._sched_base))
        paced, idle = self._waits.slept(time.perf_counter(), sched)
        wall = time.monotonic() - self._since
        return ThreadTimes(wall, on_cpu, runnable, paced, idle)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._calls.put(None)
        self._go.set()  # a loop built and never started ends too
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._froze:
            self._froze = False
            _unfreeze_heap()

    # ---- the loop thread ----------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._build is not None:
                self.engine = self._build()
        except BaseException as e:
            self._build_error = e
            return
        finally:
            self._built.set()
        self._go.wait()
        native_id = threading.get_native_id()  # from here on: the steps' times (thread_times)
        self._since, self._sched_base = time.monotonic(), _schedstat(native_id)
        self._native_id = native_id  # last: thread_times reads the two above once it is set
        try:
            while not self._stopping:
                busy = self.engine.has_unfinished()
                self._await_consumer()
                self._run_calls(block=not busy)
                if self._stopping:
                    break
                if self.engine.has_unfinished():
                    outputs = self.engine.step_tokens()
                    if outputs:
                        if self._paced:
                            with self._taking:
                                self._untaken += 1
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
            self._end_wait()
            self._fail_pending()

    def _await_consumer(self) -> None:
        """Paced: wait until at most the last hand-over is untaken (ticking meanwhile, as
        idle; the loop's stop ends the wait)."""
        if not self._paced:
            return
        while True:
            with self._taking:
                if self._untaken <= 1 or self._stopping:
                    break
                self._begin_wait("paced")
                if self._taking.wait(self._idle_s):
                    continue
            self._on_tick()
        self._end_wait("paced")

    def _begin_wait(self, kind: str) -> None:
        """A wait of ``kind`` ("paced" or "idle") begins, unless one is under way."""
        if self._waits.open is not None and self._waits.open[0] == kind:
            return
        self._end_wait()
        self._waits = _Waits(
            self._waits.paced_s, self._waits.idle_s, (kind, time.perf_counter(), _schedstat(self._native_id))
        )

    def _end_wait(self, kind: str | None = None) -> None:
        """The wait under way ends (only if of ``kind``, when given): its sleep is summed."""
        open_ = self._waits.open
        if open_ is None or (kind is not None and open_[0] != kind):
            return
        self._waits = _Waits(*self._waits.slept(time.perf_counter(), _schedstat(self._native_id)))

    def _run_calls(self, block: bool) -> None:
        """Run the queued calls; ``block``: wait up to ``idle_s`` for the first. An idle
        wait stays open across the loop's idle turns, until a call comes or work does."""
        if block:
            self._begin_wait("idle")
        else:
            self._end_wait("idle")
        try:
            item = self._calls.get(timeout=self._idle_s) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        self._end_wait("idle")
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


_heap_lock = threading.Lock()
_heap_freezes = 0  # loops of this process started and not stopped (each froze the heap)


def _freeze_heap() -> None:
    """Collect, then move every object the process holds into the collector's permanent
    generation (``gc.freeze``). A full collection walks every object tracked and holds the
    GIL throughout, so every thread of the process, the engine's steps included, stands
    still for it: with a small model's engine built (375,000 objects) one took 0.25 s, twice
    in 13 s of offline decoding; 4 ms once frozen (``bench/gc_pause``). Objects made later are collected
    as ever; the last loop's ``stop`` unfreezes, so a process that builds engine after
    engine (a test run) collects the cycles of those it let go, and so does the
    interpreter's exit (some native bindings count what it could not collect as leaks)."""
    global _heap_freezes
    with _heap_lock:
        if _heap_freezes == 0:
            atexit.register(_unfreeze_at_exit)
        _heap_freezes += 1
        gc.collect()
        gc.freeze()


def _unfreeze_heap() -> None:
    global _heap_freezes
    with _heap_lock:
        _heap_freezes -= 1
        if _heap_freezes == 0:
            gc.unfreeze()
            atexit.unregister(_unfreeze_at_exit)


def _unfreeze_at_exit() -> None:
    gc.unfreeze()


@dataclass(frozen=True)
class _Waits:
    """The loop thread's waits (``thread_times``): seconds slept waiting for the consumer
    (``paced_s``) and for work (``idle_s``), and the wait under way, if any: its kind,
    when it began (``perf_counter``) and the thread's ``_schedstat`` then."""

    paced_s: float = 0.0
    idle_s: float = 0.0
    open: tuple[str, float, tuple[float, float]] | None = None

    def slept(self, now: float, sched: tuple[float, float]) -> tuple[float, float]:
        """(paced, idle) seconds, the open wait counted up to ``now`` (``sched`` read
        then): its length less what the thread ran or waited for a core meanwhile."""
        if self.open is None:
            return self.paced_s, self.idle_s
        kind, began, (cpu0, ready0) = self.open
        asleep = max(0.0, now - began - (sched[0] - cpu0) - (sched[1] - ready0))
        if kind == "paced":
            return self.paced_s + asleep, self.idle_s
        return self.paced_s, self.idle_s + asleep


def _schedstat(native_id: int) -> tuple[float, float]:
    """Thread ``native_id``'s (on-CPU, waiting for a core) seconds since it began (Linux's
    ``schedstat``; zeros elsewhere)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            on_cpu, runnable = f.read().split()[:2]
    except OSError:  # not Linux, or the thread ended
        return 0.0, 0.0
    return int(on_cpu) / 1e9, int(runnable) / 1e9
