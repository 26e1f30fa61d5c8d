"""Tensor parallelism: the process group (``group``), the sharded layers
(``layers``) and the plain-data ``TPInit`` (imported without torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.engine.lazy import lazy_attributes

_EXPORTS = {"TPGroup": "group", "TPInit": "tp_init", "check_tp_compatible": "layers"}

if TYPE_CHECKING:
    from splitserve.engine.parallel.group import TPGroup
    from splitserve.engine.parallel.layers import check_tp_compatible
    from splitserve.engine.parallel.tp_init import TPInit


__getattr__ = lazy_attributes(__name__, _EXPORTS)


__all__ = [
    "TPGroup",
    "TPInit",
    "check_tp_compatible",
]
