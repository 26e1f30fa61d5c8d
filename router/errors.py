"""The one place errors become gRPC statuses (and HTTP ones).

Worker clients (``cluster.worker_client``) hand back splitserve's own
exceptions (``WorkerLost`` for a lost worker), so the mapping below sees one
hierarchy.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from splitserve.wire.errors import (
    DeadlineExceeded,
    EngineStopped,
    InvalidRequest,
    KVTransferError,
    Overloaded,
    PreconditionFailed,
    PrefillLost,
    RequestCrashesWorkers,
    SequenceFailed,
    UnknownModel,
    UnknownRequest,
    WorkerLost,
)

log = logging.getLogger(__name__)


_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (UnknownModel, grpc.StatusCode.NOT_FOUND),  # before InvalidRequest, its base
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (WorkerLost, grpc.StatusCode.UNAVAILABLE),
    (PrefillLost, grpc.StatusCode.UNAVAILABLE),
    (EngineStopped, grpc.StatusCode.UNAVAILABLE),
    (KVTransferError, grpc.StatusCode.UNAVAILABLE),
    (UnknownRequest, grpc.StatusCode.NOT_FOUND),
    (PreconditionFailed, grpc.StatusCode.FAILED_PRECONDITION),
    # a stray one: a call inside the cluster cut off under a request that was not cancelled
    (asyncio.CancelledError, grpc.StatusCode.UNAVAILABLE),
]


def code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code a client gets for ``exc``."""
    return next((code for cls, code in _CODES if isinstance(exc, cls)), grpc.StatusCode.INTERNAL)


# INTERNAL, and said as they are: the request's own failure, not a bug
_SAID = (SequenceFailed, RequestCrashesWorkers)
MAX_MESSAGE_CHARS = 1000  # of an unexpected error's sentence (its traceback goes to the log)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and message a client gets for ``exc``: its own sentence,
    always (an unexpected error's too, with its type, its traceback logged here)."""
    code = code_for(exc)
    if isinstance(exc, asyncio.CancelledError):
        return code, "a call inside the cluster was cut off while it served the request; retry"
    if code != grpc.StatusCode.INTERNAL or isinstance(exc, _SAID):
        return code, str(exc)
    log.error("internal error", exc_info=exc)
    sentence = str(exc)[:MAX_MESSAGE_CHARS] or "(no message)"
    return code, f"internal error ({exc.__class__.__name__}): {sentence}"


_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
}


def http_status_for(exc: BaseException) -> tuple[int, str, str]:
    """HTTP status, the gRPC code's name (as the error type) and the message for ``exc``."""
    code, message = status_for(exc)
    return _HTTP.get(code, 500), code.name.lower(), message
