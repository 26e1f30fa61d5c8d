"""splitserve's public surface, as ``from vllm import LLM, SamplingParams``::

    from splitserve import Engine, EngineConfig, SamplingParams   # the engine, in-process
    from splitserve import Client, AsyncClient                    # the gRPC SDK, to a cluster

Names load when first used (``__getattr__``): ``import splitserve`` loads nothing,
and taking the client loads no torch. Everything else is in the subpackages
(``splitserve.client``, ``splitserve.cluster``, ``splitserve.wire``, ...).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.client import AsyncClient, Client
    from splitserve.engine.engine import Engine
    from splitserve.wire.config import EngineConfig
    from splitserve.wire.sampling import SamplingParams

# name -> the module that defines it
_WHERE = {
    "Engine": "splitserve.engine.engine",
    "EngineConfig": "splitserve.wire.config",
    "SamplingParams": "splitserve.wire.sampling",
    "Client": "splitserve.client",
    "AsyncClient": "splitserve.client",
}

__all__ = ["AsyncClient", "Client", "Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
