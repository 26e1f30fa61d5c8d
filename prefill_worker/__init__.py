"""splitserve.prefill_worker: the prefill actor (engine + KV source)."""

from splitserve.prefill_worker.api import (
    PrefillResult,
    PrefillStats,
    PrefillTask,
    PrefillWorkerInfo,
    PrefillWorkerSpec,
)
from splitserve.prefill_worker.worker import PrefillWorker

__all__ = [
    "PrefillResult",
    "PrefillStats",
    "PrefillTask",
    "PrefillWorker",
    "PrefillWorkerInfo",
    "PrefillWorkerSpec",
]
