"""Tensor parallelism: the process group (``group``) and the sharded layers (``layers``)."""

from splitserve.engine.parallel.group import TPGroup, TPInit
from splitserve.engine.parallel.layers import check_tp_compatible, shard_model

__all__ = ["TPGroup", "TPInit", "check_tp_compatible", "shard_model"]
