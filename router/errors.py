"""Errors the router raises, and the one place errors become gRPC statuses.

Worker calls go through Ray, which wraps what a worker raised; ``unwrap`` turns
that back into splitserve's own exception (or ``WorkerLost`` when the worker
process itself is gone), so the mapping below sees one hierarchy.
"""

from __future__ import annotations

import logging

import grpc
import ray.exceptions

from splitserve.engine.errors import (
    DeadlineExceeded,
    EngineStopped,
    InvalidRequest,
    Overloaded,
    SplitserveError,
    UnknownRequest,
)
from splitserve.kv_transfer.errors import KVTransferError

log = logging.getLogger(__name__)


class WorkerLost(SplitserveError):
    """A worker died or became unreachable while it held a request."""


class WorkerStopped(WorkerLost):
    """A worker's process answers but its engine has stopped (a bug, a broken TP group):
    it will not serve again, and Ray will not restart a process that is alive. Its pool
    replaces it."""


def unwrap(exc: BaseException) -> BaseException:
    """The exception a worker raised, from Ray's wrapper; ``WorkerLost`` for a dead actor,
    ``WorkerStopped`` for one whose engine stopped."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        exc = exc.cause if exc.cause is not None else exc
    if isinstance(exc, EngineStopped):
        return WorkerStopped(str(exc))
    if isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError):
        return WorkerLost(f"a worker was lost: {exc.__class__.__name__}")
    return exc


_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (WorkerLost, grpc.StatusCode.UNAVAILABLE),
    (KVTransferError, grpc.StatusCode.UNAVAILABLE),
    (UnknownRequest, grpc.StatusCode.NOT_FOUND),
]


def code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code a client gets for ``exc``."""
    exc = unwrap(exc)
    return next((code for cls, code in _CODES if isinstance(exc, cls)), grpc.StatusCode.INTERNAL)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and message a client gets for ``exc``."""
    code = code_for(exc)
    if code != grpc.StatusCode.INTERNAL:
        return code, str(unwrap(exc))
    log.error("internal error", exc_info=exc)
    return code, f"internal error ({unwrap(exc).__class__.__name__}); see the server log"


_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_status_for(exc: BaseException) -> tuple[int, str, str]:
    """HTTP status, the gRPC code's name (as the error type) and the message for ``exc``."""
    code, message = status_for(exc)
    return _HTTP.get(code, 500), code.name.lower(), message
