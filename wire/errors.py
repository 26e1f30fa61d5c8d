"""The exception hierarchy shared by every splitserve layer.

Every layer raises them and they cross process boundaries (a worker's error
reaches the router pickled), so they live with the other wire records; the
router maps them to gRPC status codes in one place.

- ``SplitserveError``: base of everything splitserve raises on purpose.
- ``InvalidRequest`` (also a ``ValueError``): the caller's input is wrong; the
  message is a sentence a user can act on. Raising it never leaves state behind.
- ``SequenceFailed``: one sequence's own step failed inside a running engine (its
  grammar, sampling, detokenisation, ...); it ended alone, everything else goes
  on. ``Unsampleable``, one of them and an ``InvalidRequest`` too: the request's
  constraints left no token to sample.
- ``RequestCrashesWorkers``: a request was on two workers that died; it is ended
  rather than tried on a third.
- ``ModelLoadError``: weights or a config could not be loaded or are unsupported.
- ``Overloaded``: a resource is exhausted right now (KV blocks, queue space).
- ``PreconditionFailed``: an operation cannot proceed as the cluster stands.
- ``UnknownRequest``: an operation named a request the engine does not hold.
- ``DeadlineExceeded``: a request ran past its deadline and was aborted.
- ``EngineStopped``: the engine's loop stopped; its worker serves nothing more.
  ``GroupBroken``, one of them: a collective of its tensor-parallel group failed.
- ``WorkerLost``: a worker died or became unreachable while it held a request
  (``WorkerStopped``: it answers, but its engine stopped; ``WorkerUnreachable``: a
  request's start on it failed, so the request never ran there).
- ``PrefillLost``: the prefill worker a decode worker took a request's prompt to
  was lost before it handed any KV over (the request may prefill elsewhere);
  ``PrefillUnreachable``, one of them: it was lost before it took the request.
- ``KVTransferError`` and its subclasses: a KV transfer produced no usable KV.
"""

from __future__ import annotations


class SplitserveError(Exception):
    """Base class of errors splitserve raises deliberately."""


class InvalidRequest(SplitserveError, ValueError):
    """A request (prompt, sampling parameters, ...) is malformed or out of range."""


class UnknownModel(InvalidRequest):
    """A request named a model (or a LoRA adapter) this server does not serve: NOT_FOUND
    (HTTP 404), as vLLM and OpenAI answer it."""


class SequenceFailed(SplitserveError):
    """One sequence failed inside a running engine and ended alone with this error; the
    engine and every other sequence in its batch went on, their tokens unchanged.
    ``kind`` names the part that failed (``SEQUENCE_ERROR_KINDS``); the message is a
    sentence for the user. Tokens sent before it stand."""

    def __init__(self, kind: str, message: str):
        if kind not in SEQUENCE_ERROR_KINDS:
            raise ValueError(f"unknown sequence error kind {kind!r}")
        super().__init__(kind, message)  # both in args: the error pickles across processes
        self.kind = kind

    def __str__(self) -> str:
        return str(self.args[1])


# what ``SequenceFailed.kind`` may be: where in a step the sequence failed
SEQUENCE_ERROR_KINDS = (
    "sampling",
    "unsampleable",
    "grammar",
    "detokenization",
    "logprobs",
    "kv_cache",
    "forward",
    "lora",
)


class Unsampleable(SequenceFailed, InvalidRequest):
    """The request's constraints (its grammar, allowed tokens, bad words, bias, filters)
    left no token that may be sampled: the request, not the engine, is at fault."""

    def __init__(self, message: str):
        super().__init__("unsampleable", message)

    def __reduce__(self):
        return (type(self), (self.args[1],))


class RequestCrashesWorkers(SplitserveError):
    """A request was held by two workers that were lost while it ran: it is ended instead
    of being tried on a third (each retry could take another worker down)."""


class ModelLoadError(SplitserveError):
    """A model could not be loaded, or uses a feature the engine does not support."""


class Overloaded(SplitserveError):
    """A resource (KV blocks, queue space) is exhausted right now; retry later."""


class LoRASlotsBusy(Overloaded):
    """Every LoRA slot holds an adapter running requests still use, and this request's
    adapter is in none (``engine.lora_requests``): it waits, and a request under
    another adapter (or none) may go first."""


class PreconditionFailed(SplitserveError):
    """An operation cannot proceed as the cluster stands (no room to start a worker, a
    role it would leave with none); nothing was changed. The message says what it needs,
    what is there, and what to change."""


class UnknownRequest(SplitserveError, KeyError):
    """An operation named a request id the engine does not hold."""

    def __str__(self) -> str:  # KeyError would print the repr of its argument
        return str(self.args[0]) if self.args else ""


class DeadlineExceeded(SplitserveError):
    """A request ran past its deadline; it was aborted and its blocks freed."""


class EngineStopped(SplitserveError):
    """The engine's loop has stopped (a failed step, a lost tensor-parallel rank, or a
    shutdown): the worker serves nothing more; callers treat it as a lost worker."""


class GroupBroken(EngineStopped):
    """A collective of the tensor-parallel group failed (a rank is gone): the group can
    compute nothing more, so its worker stops like any other whose engine stopped."""


class WorkerLost(SplitserveError):
    """A worker died or became unreachable while it held a request."""


class WorkerUnreachable(WorkerLost):
    """A request could not be started on a worker (it is dead, restarting, its engine has
    stopped, or its connection broke before the start was answered): the request never
    ran there and holds nothing there, so this is no loss the request was present at.
    The router takes that worker out of routing and starts the request elsewhere."""


class WorkerStopped(WorkerLost):
    """A worker's process answers but its engine has stopped (a bug, a broken TP group):
    it will not serve again, and Ray will not restart a process that is alive. Its pool
    replaces it."""


class PrefillLost(SplitserveError):
    """A decode worker's prefill worker was lost (or stopped) before it handed over any of
    the request's KV: nothing of the request is held anywhere, and it may be prefilled
    on another prefill worker. Not a ``WorkerLost``: the decode worker is alive."""


class PrefillUnreachable(PrefillLost):
    """The prefill worker was lost before it took the request (its stream failed before
    ``PrefillAccepted``: dead, restarting, unreachable): the request never ran there,
    so this is no loss it was present at. The router takes that worker out of routing."""


# The KV transfer layer's errors: each one means the same thing to the caller: this
# transfer produced no usable KV; free the blocks allocated for it and retry
# elsewhere or fail the request. The subclass says why, for logs and metrics.


class KVTransferError(SplitserveError):
    """A KV transfer failed; the destination blocks hold nothing usable."""


class IncompatiblePeer(KVTransferError):
    """The two sides disagree on protocol version, backend, model, dtype, block size, layout or TP."""


class TransferTimeout(KVTransferError):
    """The transfer did not finish within its deadline (the peer may be stalled or gone)."""


class PeerLost(KVTransferError):
    """The source worker is gone or restarted: its blocks can no longer be read."""


class IntegrityError(KVTransferError):
    """The bytes received do not match the checksum the source computed at export."""


class LeaseExpired(KVTransferError):
    """The source's lease on the blocks ran out, so it may have reused them."""


class AdapterMismatch(KVTransferError):
    """The KV came computed under another LoRA adapter (or other weights of one of the
    same name, or the base model) than the one the request runs under here."""


class MeaningMismatch(KVTransferError):
    """The KV received is not what the prompt computes here (``engine.meaning``): the
    right bytes in the wrong place (a block table, a layer or head mapping, scales, a
    prefix credited to other tokens), which the checksums cannot see. The engine that
    raises it sets ``check``: the failed ``wire.kv.MeaningCheck`` (layer, position, error)."""

    check = None  # the MeaningCheck, set where it is raised
