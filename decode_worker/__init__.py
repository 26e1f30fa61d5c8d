"""splitserve.decode_worker: the decode actor (engine + KV sink, continuous batching, streaming)."""

from splitserve.decode_worker.api import (
    DecodeStats,
    DecodeTask,
    DecodeWorkerInfo,
    DecodeWorkerSpec,
    TokenBatch,
)
from splitserve.decode_worker.worker import DecodeWorker

__all__ = ["DecodeStats", "DecodeTask", "DecodeWorker", "DecodeWorkerInfo", "DecodeWorkerSpec", "TokenBatch"]
