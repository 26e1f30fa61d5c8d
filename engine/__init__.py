"""splitserve.engine: the inference engine every worker runs (no Ray, no gRPC)."""

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
from splitserve.engine.kv_cache import KVLayout
from splitserve.engine.loop import EngineLoop
from splitserve.engine.outputs import CompletionOutput, EngineStats, PrefilledRequest, RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import FinishReason
from splitserve.engine.validation import RequestValidator

__all__ = [
    "CompletionOutput",
    "DeadlineExceeded",
    "EngineStopped",
    "Engine",
    "EngineConfig",
    "EngineLoop",
    "EngineStats",
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
