"""One mapping from exceptions to gRPC codes (router) and back to types (client)."""

import asyncio

import grpc
import pytest

from splitserve.client import errors as client_errors
from splitserve.router.errors import status_for
from splitserve.wire.errors import (
    DeadlineExceeded,
    EngineStopped,
    IntegrityError,
    InvalidRequest,
    Overloaded,
    PeerLost,
    PreconditionFailed,
    PrefillLost,
    UnknownRequest,
    WorkerLost,
)


@pytest.mark.parametrize(
    "exc, code, client_cls",
    [
        (
            InvalidRequest("the prompt is empty"),
            grpc.StatusCode.INVALID_ARGUMENT,
            client_errors.InvalidArgument,
        ),
        (Overloaded("full"), grpc.StatusCode.RESOURCE_EXHAUSTED, client_errors.ResourceExhausted),
        (DeadlineExceeded("late"), grpc.StatusCode.DEADLINE_EXCEEDED, client_errors.DeadlineExceeded),
        (WorkerLost("gone"), grpc.StatusCode.UNAVAILABLE, client_errors.Unavailable),
        (PrefillLost("gone first"), grpc.StatusCode.UNAVAILABLE, client_errors.Unavailable),
        (EngineStopped("a TP rank was lost"), grpc.StatusCode.UNAVAILABLE, client_errors.Unavailable),
        (IntegrityError("bad bytes"), grpc.StatusCode.UNAVAILABLE, client_errors.Unavailable),
        (PeerLost("restarted"), grpc.StatusCode.UNAVAILABLE, client_errors.Unavailable),
        (UnknownRequest("r1"), grpc.StatusCode.NOT_FOUND, client_errors.NotFound),
        (
            PreconditionFailed("no room"),
            grpc.StatusCode.FAILED_PRECONDITION,
            client_errors.FailedPrecondition,
        ),
        (ZeroDivisionError("bug"), grpc.StatusCode.INTERNAL, client_errors.ServerError),
    ],
)
def test_status_and_client_type(exc, code, client_cls):
    got_code, message = status_for(exc)
    assert got_code == code
    if code != grpc.StatusCode.INTERNAL:
        assert message == str(exc)
    else:  # its type and its own sentence, never "see the server log" alone
        assert message == f"internal error ({type(exc).__name__}): {exc}"

    class FakeRpcError(grpc.RpcError):
        def code(self):
            return got_code

        def details(self):
            return message

    err = client_errors.from_rpc_error(FakeRpcError())
    assert type(err) is client_cls and err.details == message


def test_a_stray_cancellation_is_unavailable_with_a_sentence():
    code, message = status_for(asyncio.CancelledError())
    assert code == grpc.StatusCode.UNAVAILABLE and "cut off" in message and "retry" in message
