"""splitserve.prefill_worker: the prefill actor (engine + KV source).

The records (``api``) load without torch; ``PrefillWorker`` is imported on
first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.engine.lazy import lazy_attributes
from splitserve.prefill_worker.api import (
    KVStreaming,
    PrefillResult,
    PrefillStats,
    PrefillTask,
    PrefillWorkerInfo,
    PrefillWorkerSpec,
)

if TYPE_CHECKING:
    from splitserve.prefill_worker.worker import PrefillWorker


__getattr__ = lazy_attributes(__name__, {"PrefillWorker": "worker"})


__all__ = [
    "KVStreaming",
    "PrefillResult",
    "PrefillStats",
    "PrefillTask",
    "PrefillWorker",
    "PrefillWorkerInfo",
    "PrefillWorkerSpec",
]
