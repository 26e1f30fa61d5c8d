"""splitserve.engine: the inference engine every worker runs (no Ray, no gRPC)."""

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.errors import (
    InvalidRequest,
    ModelLoadError,
    Overloaded,
    SplitserveError,
    UnknownRequest,
)
from splitserve.engine.kv_cache import KVLayout
from splitserve.engine.outputs import CompletionOutput, PrefilledRequest, RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import FinishReason

__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "InvalidRequest",
    "KVLayout",
    "ModelLoadError",
    "Overloaded",
    "PrefilledRequest",
    "RequestOutput",
    "SamplingParams",
    "SplitserveError",
    "UnknownRequest",
]
