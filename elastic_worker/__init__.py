"""A worker whose role (prefill, decode, or both) is what it does now, not what it was
built as: ``elastic_worker.worker``."""
