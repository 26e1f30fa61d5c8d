"""One leased pull: KV that another worker exported under a lease, pulled into blocks
this worker allocated, verified, then confirmed to that worker, or else released
there. The one way KV comes into a worker from another: a prefilled request's
handover and a live migration (``decode_worker.handover``, ``decode_worker.migration``),
a pre-copy ahead of a move (``decode_worker.precopy``) and a prefix borrowed by a
prefill worker (``prefill_worker.borrow``) all run it, and its clean-up rules are
written here once.

Its states, and what the lender (the worker holding the export) holds in each::

    state       entered when                                  the lender holds
    ASKED       made: the export exists, or was asked for      the export, unconfirmed
    LINKED      this worker holds the lender's handshakes      the export, unconfirmed
    PULLING     the pull began (bytes land in the blocks       the export, unconfirmed
                until it ends, whatever it ends with)
    CONFIRMED   the pull ended whole within the lease, and     nothing (its lease ends)
                the confirmations not delivered by the
                backend were sent (not awaited)
    ENDED       ``end`` ran                                    nothing

``pull`` fails, and the pull is not confirmed, when the bytes do not arrive whole
(``KVTransferError``: corrupt, timed out, the lender gone) or the lease ran out
before the pull ended (``LeaseExpired``: the lender may have reused its blocks).

``end`` is what every caller runs once it is done with the pull, however it ended
(success, an error, a cancellation), in this order, and nothing else frees these:

1. a pull in flight is awaited (its bytes may still be landing in the blocks);
2. the caller's ``free`` runs: the blocks are freed in its engine (a caller that
   keeps them, the pull confirmed, passes nothing);
3. an export not confirmed is released on the lender (``abort(export_id)``, not
   awaited): no block stays held there until its lease ends.

On the worker's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from splitserve.wire.errors import LeaseExpired, SplitserveError
from splitserve.wire.kv import Confirmation, KVHandoff


class Lender(Protocol):
    """The worker holding an export (a prefill worker, or a decode worker a request
    moves from): what a leased pull asks of it. ``KVPuller.link`` also reads its
    ``info()`` for its handshakes."""

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None: ...

    async def abort(self, request_id: str) -> Any: ...


class Puller(Protocol):
    """What moves the bytes (``kv_transfer.puller.KVPuller``, or a fake in tests)."""

    async def link(self, source: Any, handoff: KVHandoff) -> None: ...

    async def pull(
        self, handoff: KVHandoff, blocks: list[int], timeout: float
    ) -> tuple[list[Confirmation], float]: ...


class LeaseState(enum.Enum):
    ASKED = "asked"
    LINKED = "linked"
    PULLING = "pulling"
    CONFIRMED = "confirmed"
    ENDED = "ended"


# the states in which the lender holds an export this worker has not confirmed
UNCONFIRMED = frozenset({LeaseState.ASKED, LeaseState.LINKED, LeaseState.PULLING})


@dataclass(frozen=True)
class Pulled:
    """A pull that ended whole: ``pulled_s``, its own time; ``waited_s``, the part of it
    spent waiting for a streamed source's layers to be computed."""

    pulled_s: float
    waited_s: float


class LeasedPull:
    """One export's pull into this worker, from ASKED to CONFIRMED or ENDED (the module
    docstring). ``what`` names it in errors ("request r1", "the prefix of r1")."""

    def __init__(
        self,
        puller: Puller,
        lender: Lender,
        export_id: str,
        background: Callable[[Coroutine], None],
        what: str,
    ):
        """``export_id``: what the lender holds the export under (``abort`` releases it);
        ``background``: runs a call to the lender without awaiting it."""
        self.lender = lender
        self.export_id = export_id
        self.what = what
        self._puller = puller
        self._background = background
        self._state = LeaseState.ASKED
        self._pull: asyncio.Future | None = None  # from PULLING on

    @property
    def state(self) -> LeaseState:
        return self._state

    @property
    def unconfirmed(self) -> bool:
        """Whether the lender holds an export this worker has not confirmed."""
        return self._state in UNCONFIRMED

    async def link(self, handoff: KVHandoff) -> None:
        """Hold the lender's handshakes for ``handoff`` (``PeerLost``: it is gone, or
        restarted since it exported)."""
        self._require(LeaseState.ASKED, "link")
        await self._puller.link(self.lender, handoff)
        self._state = LeaseState.LINKED

    async def pull(self, handoff: KVHandoff, blocks: list[int], timeout: float) -> Pulled:
        """Pull ``handoff``'s KV into ``blocks``, within ``timeout`` and the lease, verified;
        once it ended whole within the lease, confirm it. Cancelled, the pull in flight
        runs on (``end`` awaits it)."""
        self._require(LeaseState.LINKED, "pull")
        self._state = LeaseState.PULLING
        timeout = max(0.001, min(timeout, handoff.remaining_lease()))
        t0 = time.perf_counter()
        self._pull = asyncio.ensure_future(self._puller.pull(handoff, blocks, timeout))
        confirmations, waited = await asyncio.shield(self._pull)
        pulled_s = time.perf_counter() - t0
        if handoff.remaining_lease() <= 0:
            raise LeaseExpired(f"the KV lease of {self.what} ran out before its pull ended")
        undelivered = tuple(c for c in confirmations if not c.delivered)
        if undelivered:
            self._background(self.lender.confirm(undelivered))
        self._state = LeaseState.CONFIRMED
        return Pulled(pulled_s, waited)

    async def end(self, free: Callable[[], Awaitable[Any] | None] | None = None) -> None:
        """ENDED, in the module docstring's order: a pull in flight awaited (whatever it
        ends with), ``free`` run (awaited if it returns an awaitable), an unconfirmed
        export released. If ``free`` raises (or ``end`` is cancelled while freeing), the
        export is still released and the error passes on. Idempotent: a second call does
        nothing."""
        if self._state is LeaseState.ENDED:
            return
        release, self._state = self.unconfirmed, LeaseState.ENDED
        try:
            if self._pull is not None:
                with contextlib.suppress(BaseException):
                    await self._pull
            if free is not None:
                freeing = free()
                if freeing is not None:
                    await freeing
        finally:  # whatever freeing the blocks here met, the lender's are released
            if release:
                self._background(self.lender.abort(self.export_id))

    def _require(self, state: LeaseState, step: str) -> None:
        if self._state is not state:
            raise RuntimeError(f"leased pull of {self.what}: {step} in state {self._state.name}")


def why_failed(error: BaseException) -> tuple[str, BaseException | None]:
    """How a caller that falls back after a failed pull logs it: the error's class and
    message, and the error itself where its traceback is worth logging (not one of
    splitserve's own errors, nor a timeout)."""
    why = f"{error.__class__.__name__}: {error}" if str(error) else error.__class__.__name__
    expected = isinstance(error, SplitserveError | TimeoutError)
    return why, None if expected else error
