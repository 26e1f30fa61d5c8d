"""Holding one request mid-stream on a live cluster's decode workers, so that a test
moves it (a drain, a migration) while it certainly runs, however fast the workers
decode and however slow the test's own calls are.

``hold(cluster, request_id, at)`` arms every decode worker of ``cluster``: once the
request has ``at`` output tokens there, the worker's engine skips its steps (each
skip waits briefly for the release) while the request is there, its engine commands
still running between them (a move's pre-copy, its ``MoveOut``, an abort, a request
started again: they all run as commands, not steps). The request so waits, with its
first ``at`` tokens out, until the caller releases it (``Hold.release``, or leaving
the ``with``). Skipped steps change no token: a greedy stream's tokens are the same.
A worker that started after ``hold``, or died meanwhile, is not held (or released).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ray

RELEASE_TIMEOUT_S = 60.0


def _arm(request_id: str, at: int):
    """The function that arms a worker (run in its actor: ``__ray_call__``). Made here, so
    that Ray copies it by value: the workers' processes cannot import ``tests``."""

    def arm(worker) -> None:
        import threading

        engine, released = worker.engine, threading.Event()
        step = engine.step_tokens

        def held_step():  # the engine thread's
            state = engine.requests.get(request_id)
            if not released.is_set() and state is not None and state.seq.num_output_tokens >= at:
                released.wait(0.01)  # then the loop runs its commands and ticks, and comes back
                return []
            return step()

        def release() -> None:
            released.set()
            engine.__dict__.pop("step_tokens", None)  # the engine's own again

        engine.step_tokens = held_step
        worker.release_hold = release

    return arm


class Hold:
    def __init__(self, actors: list):
        self._actors = actors

    def release(self) -> None:
        """Let the request go on, on every armed worker still alive (idempotent)."""
        actors, self._actors = self._actors, []
        for actor in actors:
            with contextlib.suppress(ray.exceptions.RayActorError):  # killed by the test
                released = actor.__ray_call__.remote(lambda worker: worker.release_hold())
                ray.get(released, timeout=RELEASE_TIMEOUT_S)


@contextlib.contextmanager
def hold(cluster, request_id: str, at: int) -> Iterator[Hold]:
    """Hold ``request_id`` once it has ``at`` output tokens on a decode worker of
    ``cluster`` (a ``BackgroundCluster``), until ``Hold.release`` or the ``with`` ends."""
    workers = cluster.registry.routable(cluster.dispatcher.decode_role)  # where it may go
    actors = [w.client.actor for w in workers]
    ray.get([a.__ray_call__.remote(_arm(request_id, at)) for a in actors], timeout=RELEASE_TIMEOUT_S)
    h = Hold(actors)
    try:
        yield h
    finally:
        h.release()
