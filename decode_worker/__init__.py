"""splitserve.decode_worker: the decode actor (engine + KV sink, continuous batching, streaming).

The records (``api``) load without torch; ``DecodeWorker`` is imported on
first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.decode_worker.api import (
    DecodeStats,
    DecodeTask,
    DecodeWorkerInfo,
    DecodeWorkerSpec,
    TokenBatch,
)

if TYPE_CHECKING:
    from splitserve.decode_worker.worker import DecodeWorker


def __getattr__(name: str):
    if name == "DecodeWorker":
        from splitserve.decode_worker.worker import DecodeWorker

        return DecodeWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DecodeStats", "DecodeTask", "DecodeWorker", "DecodeWorkerInfo", "DecodeWorkerSpec", "TokenBatch"]
