"""Transfer backends; import them through ``splitserve.kv_transfer.get_backend``."""
