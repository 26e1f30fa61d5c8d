"""splitserve.engine: the inference engine every worker runs (no Ray, no gRPC).

Names are imported on first use (PEP 562), so a process that needs only the
plain-data types (``SamplingParams``, ``FinishReason``, the errors,
``RequestValidator``, ``KVLayout``; a router, a client) never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.engine.lazy import lazy_attributes

_EXPORTS = {
    "CompletionOutput": "outputs",
    "DeadlineExceeded": "errors",
    "Engine": "engine",
    "EngineConfig": "config",
    "EngineLoop": "loop",
    "EngineStats": "outputs",
    "EngineStopped": "errors",
    "FinishReason": "sequence",
    "InvalidRequest": "errors",
    "KVLayout": "kv_layout",
    "ModelLoadError": "errors",
    "Overloaded": "errors",
    "PrefilledRequest": "outputs",
    "RequestOutput": "outputs",
    "RequestValidator": "validation",
    "SamplingParams": "sampling_params",
    "SplitserveError": "errors",
    "UnknownRequest": "errors",
}

if TYPE_CHECKING:
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.errors import (
        DeadlineExceeded,
        EngineStopped,
        InvalidRequest,
        ModelLoadError,
        Overloaded,
        SplitserveError,
        UnknownRequest,
    )
    from splitserve.engine.kv_layout import KVLayout
    from splitserve.engine.loop import EngineLoop
    from splitserve.engine.outputs import CompletionOutput, EngineStats, PrefilledRequest, RequestOutput
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.engine.sequence import FinishReason
    from splitserve.engine.validation import RequestValidator


__getattr__ = lazy_attributes(__name__, _EXPORTS)


__all__ = [
    "CompletionOutput",
    "DeadlineExceeded",
    "Engine",
    "EngineConfig",
    "EngineLoop",
    "EngineStats",
    "EngineStopped",
    "FinishReason",
    "InvalidRequest",
    "KVLayout",
    "ModelLoadError",
    "Overloaded",
    "PrefilledRequest",
    "RequestOutput",
    "RequestValidator",
    "SamplingParams",
    "SplitserveError",
    "UnknownRequest",
]
