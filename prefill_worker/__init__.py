"""splitserve.prefill_worker: the prefill actor (engine + KV source), ``worker.PrefillWorker``.

Its records (spec, task, result, stats) are in ``splitserve.wire.prefill``."""
