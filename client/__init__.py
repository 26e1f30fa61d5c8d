"""splitserve.client: the gRPC client SDK (imports only the proto stubs)."""

from splitserve.client.client import DEFAULT_TARGET, AsyncClient, Client, ModelInfo
from splitserve.client.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServerError,
    SplitserveClientError,
    Unauthenticated,
    Unavailable,
)
from splitserve.client.types import Chunk, Completion, Final

__all__ = [
    "DEFAULT_TARGET",
    "AsyncClient",
    "Cancelled",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "Final",
    "InvalidArgument",
    "ModelInfo",
    "NotFound",
    "ResourceExhausted",
    "ServerError",
    "SplitserveClientError",
    "Unauthenticated",
    "Unavailable",
]
