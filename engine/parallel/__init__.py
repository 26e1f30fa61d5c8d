"""Tensor parallelism: the process group (``group``) and the sharded layers
(``layers``); how a rank joins its group is the plain-data ``wire.tp.TPInit``."""
