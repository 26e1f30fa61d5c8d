"""An engine loop in a process of its own (``EngineProcess``): what a colocated
decode worker runs with ``engine_process`` set, so that none of the worker's other
threads (Ray's, the event loop that answers calls and makes text, the token server)
shares the engine's interpreter and its GIL.

The worker holds an ``EngineProcess`` where it would hold an ``EngineLoop`` and uses
it the same way (``build``, ``start``, ``submit``, ``taken``, ``thread_times``,
``stop``, ``error``), with ``on_outputs`` and ``on_error`` called on a thread of the
worker's process. ``build`` returns the engine's ``EngineFacts``, not the engine.
The engine process runs a paced ``EngineLoop`` fed over a socket pair, with pickled tuples::

    worker process                                    engine process
    submit(command)  --("call", n, command)-->         EngineLoop.submit(command)
    its future        <--("done", n, ok, value)--       (answered on the engine thread)
    on_outputs(outs)  <--("outputs", outs)--            each step's token ids
    taken()           --("taken",)-->                   EngineLoop.taken()
    thread_times()    --("times", n)-->                 ("done", n, True, ThreadTimes)
    on_error(error)   <--("failed", error)--            the loop stopped on an error
    stop()            --("stop",)-->                    the loop stops; the process exits

The engine process exits when its end of the socket closes, so a worker that dies,
even by SIGKILL, takes its engine with it. If the engine process exits while the
worker still wants it, every call in flight and every later one fails with
``EngineStopped`` and ``on_error`` runs, as when an ``EngineLoop`` stops on an error.

Only an engine of which its worker needs nothing but commands runs this way: a
group of one process (no TP or EP group) whose KV no other worker pulls, fills or
lends (colocated). A worker that moves KV keeps its engine on a thread of its own
process (``engine.loop``), where its transfer library registers the KV cache.
"""

from __future__ import annotations

import logging
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from splitserve.engine.facts import EngineFacts
from splitserve.wire.config import EngineConfig
from splitserve.wire.engine_commands import EngineCommand
from splitserve.wire.errors import EngineStopped
from splitserve.wire.outputs import RequestOutput, ThreadTimes

log = logging.getLogger(__name__)
TIMES_TIMEOUT_S = 10.0  # thread_times waits this long for the engine process's answer
STOP_TIMEOUT_S = 10.0  # how long an engine process may take to exit when told to (killed after)


class EngineProcess:
    """An ``EngineLoop`` in a child process, driven from this one (module docstring)."""

    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_error: Callable[[BaseException], None],
        torch_threads: int | None = None,
    ):
        """``on_outputs`` and ``on_error`` run on this process's reader thread; its loop is
        paced (``EngineLoop``): the worker calls ``taken`` once per ``on_outputs``. The
        engine process inherits this process's environment and CPU affinity, and sizes
        torch's threads to ``torch_threads``."""
        self._setup = (worker_id, config, torch_threads)
        self._on_outputs, self._on_error = on_outputs, on_error
        self.error: BaseException | None = None  # why the engine stopped, once it has
        self._lock = threading.Lock()  # the sends, the futures and the two flags below
        self._futures: dict[int, Future] = {}
        self._next = 0
        self._closed = False  # the engine process is gone: calls fail at once
        self._stopping = False  # stop() was called: its exit is no error
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._facts: EngineFacts | None = None

    def build(self) -> EngineFacts:
        """Start the engine process and build the engine there; its facts once built (or
        raise what the build raised, or ``EngineStopped`` if the process died building).
        It runs no steps until ``start``. Like ``EngineLoop.build`` it waits for the build
        without a deadline (a model load takes what it takes)."""
        if self._facts is not None:
            return self._facts
        mine, theirs = socket.socketpair()
        fd = theirs.fileno()
        code = f"from splitserve.engine.process import serve; serve({fd})"
        self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(fd,))
        theirs.close()
        self._conn = Connection(mine.detach())
        try:
            self._conn.send(self._setup)
            ok, value = self._conn.recv()
        except (EOFError, OSError):  # it died building (e.g. out of memory)
            ok, value = False, None
        if not ok:
            self._closed = True
            self._conn.close()
            try:
                self._proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            raise value or EngineStopped(f"the engine process exited while building ({self._exit_code()})")
        self._facts = value
        name = f"{self._setup[0]}-engine-outputs"
        self._reader = threading.Thread(target=self._read, name=name, daemon=True)
        self._reader.start()
        return value

    def start(self) -> EngineProcess:
        """Build the engine if ``build`` has not, then start stepping it."""
        self.build()
        self._send(("start",))
        return self

    def submit(self, command: EngineCommand) -> Future:
        """Run ``command`` on the engine's thread, in its process, before its next step;
        the future holds its result or error (``EngineStopped`` once the process is gone)."""
        future: Future = Future()
        with self._lock:
            if self._closed or self._stopping or self._conn is None:
                future.set_exception(
                    EngineStopped(f"the engine process has stopped ({self.error or 'shut down'})")
                )
                return future
            n, self._next = self._next, self._next + 1
            self._futures[n] = future
            try:
                self._conn.send(("call", n, command))
            except Exception as e:  # a command that does not pickle, or the socket closed
                del self._futures[n]
                future.set_exception(e if not isinstance(e, OSError) else EngineStopped(str(e)))
        return future

    def taken(self) -> None:
        """A paced loop's consumer took one ``on_outputs`` hand-over (any thread)."""
        self._send(("taken",))

    def thread_times(self) -> ThreadTimes:
        """Where the engine process's loop thread spent its time (``EngineLoop.thread_times``);
        zeros once the process is gone."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                return ThreadTimes(0.0, 0.0, 0.0, 0.0, 0.0)
            n, self._next = self._next, self._next + 1
            self._futures[n] = future
            try:
                self._conn.send(("times", n))
            except OSError:  # the process is gone
                del self._futures[n]
                return ThreadTimes(0.0, 0.0, 0.0, 0.0, 0.0)
        try:
            return future.result(TIMES_TIMEOUT_S)
        except Exception:
            return ThreadTimes(0.0, 0.0, 0.0, 0.0, 0.0)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the engine and wait up to ``timeout`` for its process to exit (killed after)."""
        with self._lock:
            self._stopping = True
        self._send(("stop",))
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("engine process %s did not stop in %.0f s; killing it", self._proc.pid, timeout)
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None and threading.current_thread() is not self._reader:
            self._reader.join(timeout)
        if self._conn is not None:
            self._conn.close()

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before ``build``)."""
        return self._proc.pid if self._proc is not None else None

    # ---- this process's reader thread --------------------------------------------------
    def _send(self, message: tuple) -> None:
        with self._lock:
            if self._closed or self._conn is None:
                return
            try:
                self._conn.send(message)
            except OSError:  # the process is gone: the reader fails what waits
                pass

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "outputs":
                    self._hand(self._on_outputs, message[1])
                elif kind == "done":
                    _, n, ok, value = message
                    with self._lock:
                        future = self._futures.pop(n, None)
                    if future is not None:
                        future.set_result(value) if ok else future.set_exception(value)
                elif kind == "failed":
                    self.error = message[1]
                    self._hand(self._on_error, message[1])
        except (EOFError, OSError):  # the engine process exited
            pass
        finally:
            self._close()

    def _close(self) -> None:
        with self._lock:
            self._closed = True
            futures, self._futures = self._futures, {}
            stopping = self._stopping
        reason = self.error or f"its process exited ({self._exit_code()})"
        stopped = EngineStopped(f"the engine of {self._setup[0]} has stopped: {reason}")
        for future in futures.values():
            future.set_exception(stopped)
        if not stopping and self.error is None:
            self.error = stopped
            self._hand(self._on_error, stopped)

    def _exit_code(self) -> str:
        code = self._proc.poll() if self._proc is not None else None
        return "still running" if code is None else f"exit code {code}"

    @staticmethod
    def _hand(callback: Callable[[Any], None], value: Any) -> None:
        try:
            callback(value)
        except Exception:
            log.exception("an engine process callback failed")


# ---- the engine process ---------------------------------------------------------------------
def serve(fd: int) -> None:
    """The engine process's main: build the engine the worker's first message describes,
    then run what the worker sends until it says stop or its socket closes."""
    import torch

    from splitserve.engine.loop import EngineLoop

    conn = Connection(fd)
    worker_id, config, torch_threads = conn.recv()
    if torch_threads:
        torch.set_num_threads(torch_threads)
    sends = threading.Lock()

    def send(message: tuple) -> None:
        """Raises what pickling raised (nothing was sent then)."""
        with sends:
            try:
                conn.send(message)
            except OSError:  # the worker is gone: the read below ends
                pass

    def answer(n: int, future: Future) -> None:  # the engine thread
        error = future.exception()
        if error is None:
            try:
                send(("done", n, True, future.result()))
                return
            except Exception as e:  # a result that does not pickle: its caller hears why
                error = e
        send(("done", n, False, _portable(error)))

    loop = EngineLoop.for_worker(
        worker_id,
        config,
        None,
        lambda outputs: send(("outputs", outputs)),
        lambda: None,
        lambda error: send(("failed", _portable(error))),
        paced=True,
    )
    try:
        engine = loop.build()
    except BaseException as e:
        send((False, _portable(e)))
        return
    send((True, EngineFacts.of(engine)))
    try:
        while True:
            message = conn.recv()
            kind = message[0]
            if kind == "call":
                loop.submit(message[2]).add_done_callback(lambda f, n=message[1]: answer(n, f))
            elif kind == "taken":
                loop.taken()
            elif kind == "times":
                send(("done", message[1], True, loop.thread_times()))
            elif kind == "start":
                loop.start()
            elif kind == "stop":
                break
    except (EOFError, OSError):  # the worker is gone
        pass
    finally:
        loop.stop()
        conn.close()


def _portable(error: BaseException) -> BaseException:
    """``error`` if it pickles, else a ``RuntimeError`` that says what it was."""
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
