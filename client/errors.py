"""Typed exceptions for gRPC statuses, so callers catch meaning, not codes."""

from __future__ import annotations

import grpc


class SplitserveClientError(Exception):
    """A call failed; ``code`` is the gRPC status, ``details`` the server's sentence."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgument(SplitserveClientError):
    """The request was malformed or out of range; fix it before retrying."""


class ResourceExhausted(SplitserveClientError):
    """The server is at capacity; retry later."""


class DeadlineExceeded(SplitserveClientError):
    """The request did not finish before its deadline."""


class Unavailable(SplitserveClientError):
    """The server or a worker could not be reached; retrying may succeed."""


class Cancelled(SplitserveClientError):
    """The call was cancelled."""


class NotFound(SplitserveClientError):
    """The request named something the server does not have."""


class Unauthenticated(SplitserveClientError):
    """No API key, or one the server does not accept (``api_key=`` / ``SPLITSERVE_API_KEY``)."""


class FailedPrecondition(SplitserveClientError):
    """The operation cannot proceed as the cluster stands (e.g. no room to start a
    worker); nothing was changed, and the message says what it needs."""


class ServerError(SplitserveClientError):
    """An internal server error or another unexpected status."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
}


def from_rpc_error(e: grpc.RpcError) -> SplitserveClientError:
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    return _BY_CODE.get(code, ServerError)(code, details or "")
