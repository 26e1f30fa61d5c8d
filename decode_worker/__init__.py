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
from splitserve.engine.lazy import lazy_attributes

if TYPE_CHECKING:
    from splitserve.decode_worker.worker import DecodeWorker


__getattr__ = lazy_attributes(__name__, {"DecodeWorker": "worker"})


__all__ = ["DecodeStats", "DecodeTask", "DecodeWorker", "DecodeWorkerInfo", "DecodeWorkerSpec", "TokenBatch"]
