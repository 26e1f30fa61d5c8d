"""splitserve.prefill_worker: the prefill actor (engine + KV source).

The records (``api``) load without torch; ``PrefillWorker`` is imported on
first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.prefill_worker.api import (
    PrefillResult,
    PrefillStats,
    PrefillTask,
    PrefillWorkerInfo,
    PrefillWorkerSpec,
)

if TYPE_CHECKING:
    from splitserve.prefill_worker.worker import PrefillWorker


def __getattr__(name: str):
    if name == "PrefillWorker":
        from splitserve.prefill_worker.worker import PrefillWorker

        return PrefillWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PrefillResult",
    "PrefillStats",
    "PrefillTask",
    "PrefillWorker",
    "PrefillWorkerInfo",
    "PrefillWorkerSpec",
]
