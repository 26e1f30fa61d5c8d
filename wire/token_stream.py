"""The token stream from a decode worker to its consumer, over gRPC.

A router reads one stream per decode worker (``DecodeWorker.stream``: every
engine step's batches of the requests it started there, as one item). Those
items are the cluster's hottest traffic: one per step, every step, on every
decode worker. They go over a plain gRPC stream that the worker serves
(``decode_worker.token_server``), not through Ray: a Ray call or streamed item
costs the receiving process about 1.5 ms of CPU on these machines
(``bench/ray_item_cost``), a gRPC message a tenth of that. So does each request's
``start``, the one call a router makes per request. The rest (``abort``, stats,
``info``) still goes through Ray.

The wire, two methods on one connection per worker and router:

    Stream(outbox id, UTF-8) -> stream of items: a tuple of ``TokenBatch`` each
    Start((outbox id, DecodeTask)) -> None, or the error ``start`` raised (it holds
                                      nothing then)

Messages are pickled, as Ray pickles its calls: the records are the same typed
dataclasses (a task's ``source`` is a Ray actor handle, which pickles), and the two
ends are processes of one cluster that already trust each other's pickles.
"""

from __future__ import annotations

import pickle

from splitserve.wire.decode import TokenBatch

SERVICE = "splitserve.internal.v1.DecodeTokens"
METHOD = f"/{SERVICE}/Stream"
START = f"/{SERVICE}/Start"
# HTTP/2 keepalive both ends agree on: a consumer notices a worker whose machine went
# silent (no FIN, no RST) within about 15 s, as Ray would notice the node.
KEEPALIVE_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # one step's batches, logprobs and all


def encode_outbox(outbox_id: str) -> bytes:
    return outbox_id.encode()


def decode_outbox(data: bytes) -> str:
    return data.decode()


def encode_item(batches: tuple[TokenBatch, ...]) -> bytes:
    return pickle.dumps(batches, protocol=pickle.HIGHEST_PROTOCOL)


def decode_item(data: bytes) -> tuple[TokenBatch, ...]:
    return pickle.loads(data)


def encode(value: object) -> bytes:
    """A ``Start`` request ((outbox id, task)) or answer (None or an exception)."""
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> object:
    return pickle.loads(data)
