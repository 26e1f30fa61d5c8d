"""Tensor parallelism: the process group (``group``), the sharded layers
(``layers``) and the plain-data ``TPInit`` (imported without torch)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {"TPGroup": "group", "TPInit": "tp_init", "check_tp_compatible": "layers", "shard_model": "layers"}

if TYPE_CHECKING:
    from splitserve.engine.parallel.group import TPGroup
    from splitserve.engine.parallel.layers import check_tp_compatible, shard_model
    from splitserve.engine.parallel.tp_init import TPInit


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "TPGroup",
    "TPInit",
    "check_tp_compatible",
    "shard_model",
]
