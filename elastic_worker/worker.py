"""An elastic worker: one engine, loaded once, that serves as a prefill worker, a
decode worker, or both at once, and so changes role without reloading weights.

It is the two halves the cluster already runs, over one engine loop::

    ElasticWorker
      engine loop (one Engine, one thread)  <- outputs, ticks and errors go to both halves
      .prefill  PrefillWorker   prefills prompts for decode workers and exports their KV
                                (its KV source), lends cached prefixes
      .decode   DecodeWorker    takes KV from prefill workers (its sink), decodes, streams;
                                prefills short prompts itself; moves running requests
                                (its mover) and takes moved ones

Each half keeps its own requests and leases (a prefill export, a decode stream) and
ignores the other's outputs; the engine refuses an id already in use, so one
request id is never in both. Which half the router sends work to is its role
(``router.roles``): a worker switching role stops getting the old role's new work,
finishes (or moves) what it holds in it, and takes the new role's; the engine and
its caches stay as they are, so the switch costs seconds, not a model load.

TP=1 only (a TP group's ranks would each need both halves' peers). No Ray here:
``cluster`` wraps it as it wraps the others.
"""

from __future__ import annotations

from splitserve.decode_worker.worker import DecodeWorker
from splitserve.engine.engine import Engine
from splitserve.engine.loop import EngineLoop
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.wire.decode import DecodeWorkerSpec
from splitserve.wire.outputs import RequestOutput
from splitserve.wire.prefill import PrefillWorkerSpec


class ElasticWorker:
    def __init__(self, prefill: PrefillWorkerSpec, decode: DecodeWorkerSpec):
        """Both specs name the same worker and engine; TP=1, with a transfer backend
        (the decode half takes KV from elsewhere). Raises ``ValueError`` otherwise."""
        if prefill.worker_id != decode.worker_id or prefill.engine != decode.engine:
            raise ValueError("an elastic worker's halves are one worker with one engine")
        if prefill.tp is not None or decode.tp is not None or decode.engine.ep_size > 1:
            raise ValueError("an elastic worker is one process (TP=1, no expert parallelism)")
        if decode.backend is None:
            raise ValueError("an elastic worker's decode half takes KV from elsewhere: it needs a backend")
        self.worker_id = decode.worker_id
        # the engine is built on the loop's thread, the one that steps it (engine/loop.py says why)
        self.loop = EngineLoop(
            lambda: Engine(decode.engine),
            self._on_outputs,
            self._tick,
            name=f"{self.worker_id}-engine",
            on_error=self._on_error,
        )
        self.engine = self.loop.build()
        self.prefill = PrefillWorker(prefill, loop=self.loop)
        self.decode = DecodeWorker(decode, loop=self.loop)
        self.decode.start_engine()  # the loop steps from here on

    def shutdown(self) -> None:
        self.decode.shutdown()
        self.prefill.shutdown()

    # ---- the engine loop thread ------------------------------------------------------
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self.prefill.on_outputs(outputs)
        self.decode.on_outputs(outputs)

    def _tick(self) -> None:
        self.prefill.tick()
        self.decode.tick()

    def _on_error(self, error: BaseException) -> None:
        self.prefill.on_error(error)
        self.decode.on_error(error)
