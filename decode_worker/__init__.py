"""splitserve.decode_worker: the decode actor (engine + KV sink, continuous batching,
streaming), ``worker.DecodeWorker``.

Its records (spec, task, token batches, stats) are in ``splitserve.wire.decode``."""
