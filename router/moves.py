"""Moving running requests between decode workers: live migration, and drains by it.

``Moves`` holds every sequence of this router's requests that is on a decode
worker now (its ``RequestLifecycle``, registered by the dispatcher while it
streams it) and moves them: ``migrate`` one (by KV: first the new worker copies
the request's full blocks while the old one decodes on, the pre-copy; then the
lifecycle's MOVING phase: the old worker lets it go, exporting the blocks after
those, its stream there ends marked ``moved``, the dispatcher starts it on the
new worker with what the old one exported), ``move_off`` all
of a worker's (a drain), ``relieve`` a worker whose KV cache is nearly full of
one (before its engine has to preempt a sequence and compute it again). Workers
of one revision only: a request never moves to weights other than those that
began it. ``moved`` counts the moves by why. On the router's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.router.balancer import Prompt, pick_decode
from splitserve.router.lifecycle import Phase, RequestLifecycle
from splitserve.router.registry import WorkerRecord, WorkerRegistry, of_revision
from splitserve.router.roles import Role
from splitserve.wire.background import Background
from splitserve.wire.errors import InvalidRequest, Overloaded, UnknownRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Relief:
    """When ``Moves.relieve`` moves a request off a decode worker: at ``above`` of its KV
    cache in use, to a worker at most ``below`` full once it holds the request."""

    above: float
    below: float


PRECOPY_TIMEOUT_S = 30.0  # bounds a move's pre-copy (the request decodes on meanwhile)
MOVE_OFF_POLL_S = 0.01  # move_off: how often it looks for requests that began to decode
MOVE_OFF_RETRY_S = 0.25  # ... and, when no worker had room, when it tries again


class Moves:
    def __init__(
        self,
        registry: WorkerRegistry,
        decode_role: Callable[[], Role],
        has_room: Callable[[WorkerRecord], bool],
    ):
        """``decode_role``: the role of the workers requests decode on (decode, or
        colocated); ``has_room``: whether a worker may take one more request now."""
        self.registry = registry
        self._decode_role = decode_role
        self._has_room = has_room
        self.lives: dict[str, RequestLifecycle] = {}  # by request (sequence) id; the dispatcher's to write
        self.moved: collections.Counter[str] = collections.Counter()  # moves by why: MOVE_REASONS
        self.precopy = True  # a move by KV copies the full blocks ahead (off: all at the switch)
        self._copying: set[str] = set()  # requests whose KV a move copies ahead now
        self._background = Background()  # aborts of copies no move followed

    async def migrate(
        self, request_id: str, to: str | None = None, by: str = "kv", reason: str = "operator"
    ) -> str:
        """Move decoding request ``request_id`` (one sequence: a fork's own id) to another
        decode worker of its revision, ``to`` or the balancer's choice (live migration):
        the old worker lets it go once its tokens so far are out, and the new one decodes
        on; the client's stream neither repeats nor skips a token. ``by`` "kv": the new
        worker first copies the request's full blocks so far while it decodes on (the
        pre-copy: ``_pre_copy``), then the old worker exports the blocks after those and
        the new one pulls them, nothing is computed again (a failed pull is recomputed
        there); a worker that cannot export (a TP group) moves it as "recompute" does:
        the new worker prefills the prompt and the tokens so far.
        ``reason`` (one of ``MOVE_REASONS``) is what ``moved`` counts it under.
        Returns the worker it moves to, once the old one let it go. Raises
        ``UnknownRequest`` when no such request is decoding, ``InvalidRequest`` when it is
        not decoding now (still prefilling, or moving), ``Overloaded`` when no other
        decode worker of its revision has room."""
        _check_by(by)
        life = self.lives.get(request_id)
        if life is None:
            raise UnknownRequest(f"no request {request_id!r} is on a decode worker")
        if life.phase is not Phase.DECODING or request_id in self._copying:
            phase = "moving" if request_id in self._copying else life.phase.value
            raise InvalidRequest(f"request {request_id} is {phase}: only a decoding request moves")
        old = life.decode_worker
        export = by == "kv" and old.info is not None and bool(old.info.handshakes)
        candidates = [
            w
            for w in of_revision(self.registry.routable(self._decode_role()), old.revision)
            if w is not old and (to is None or w.worker_id == to) and self._has_room(w)
        ]
        prompt = Prompt.of(life.prompt_ids, old.block_size)
        dw = pick_decode(candidates, prompt, len(life.prompt_ids) + life.num_sent + 1)
        if dw is None:
            raise Overloaded(
                f"no decode worker of revision {old.revision or '-'} but {old.worker_id}"
                f"{f' named {to}' if to else ''} can take request {request_id} now"
            )
        from_block = await self._pre_copy(life, dw) if export and self.precopy else 0
        life.begin_move(dw)
        # The old worker's answer settles the move whether or not this caller still waits
        # for it (a Drain call whose client left, a router stopping its relief): a move
        # given up half-way would leave the request MOVING, with nothing to end it.
        asking = asyncio.ensure_future(old.client.move_out(request_id, export, from_block))
        asking.add_done_callback(functools.partial(self._settle, life, reason, dw if from_block else None))
        await asyncio.shield(asking)
        return dw.worker_id

    async def _pre_copy(self, life: RequestLifecycle, dw: WorkerRecord) -> int:
        """Have ``dw`` copy the full blocks of ``life``'s KV so far from the worker it
        decodes on, which goes on decoding meanwhile. Returns the leading blocks ``dw``
        holds now (0: none; a copy that failed is no error, the move copies it all).
        Raises ``InvalidRequest`` (``dw`` holding nothing) if the request ended or went
        elsewhere meanwhile."""
        old, rid = life.decode_worker, life.request_id
        if (len(life.prompt_ids) + life.num_sent - 1) // old.block_size == 0:
            return 0  # not one full block yet
        self._copying.add(rid)
        try:
            held = await dw.client.precopy(life.pre_copy(PRECOPY_TIMEOUT_S))
        except asyncio.CancelledError:  # the caller left: no move (what dw copied is freed)
            self._background.run(dw.client.abort(rid))
            raise
        except Exception as e:  # the new worker is lost or failing: the move finds out
            log.warning("copying %s's KV to %s ahead of its move failed: %s", rid, dw.worker_id, e)
            held = 0
        finally:
            self._copying.discard(rid)
        if (
            life.phase is not Phase.DECODING
            or life.decode_worker is not old
            or self.lives.get(rid) is not life
        ):
            if held:
                self._background.run(dw.client.abort(rid))
            raise InvalidRequest(f"request {rid} ended or moved while its KV was copied ahead")
        return held

    def _settle(
        self, life: RequestLifecycle, reason: str, copied_to: WorkerRecord | None, asking: asyncio.Future
    ) -> None:
        """The old worker answered ``move_out``: the move goes on (``life.moved``), or the
        request goes on decoding there (``cancel_move``: it did not let it go, and the KV
        copied ahead to ``copied_to``, if any, is freed there)."""
        if asking.cancelled() or asking.exception() is not None:
            error = asking.exception() if not asking.cancelled() else None
            life.cancel_move(error or RuntimeError(f"moving request {life.request_id} was cancelled"))
            if copied_to is not None:
                self._background.run(copied_to.client.abort(life.request_id))
        else:
            life.moved(asking.result())
            self.moved[reason] += 1

    def on_worker(self, worker_id: str) -> int:
        """Sequences of this router's requests on decode worker ``worker_id`` now."""
        return sum(
            1
            for life in self.lives.values()
            if life.decode_worker and life.decode_worker.worker_id == worker_id
        )

    async def move_off(self, worker_id: str, by: str = "kv", timeout_s: float = 60.0) -> int:
        """Move every request on decode worker ``worker_id`` to others (a drain by
        migration: the caller drained it in the registry first, so nothing new comes):
        those decoding now at once, those still being prefilled or handed over once they
        decode (``migrate``). A request no other worker has room for now is tried again
        while ``timeout_s`` lasts, then left to finish there. Returns how many moved, once
        none is left on it or the time is up."""
        _check_by(by)  # at once: not once per request, until the time is up
        deadline = time.monotonic() + timeout_s
        moved = 0
        while time.monotonic() < deadline and self.on_worker(worker_id):
            here = [life for life in self.lives.values() if life.decode_worker is not None]
            here = [life for life in here if life.decode_worker.worker_id == worker_id]
            decoding = [life.request_id for life in here if life.phase is Phase.DECODING]
            results = await asyncio.gather(
                *(self.migrate(rid, by=by, reason="drain") for rid in decoding), return_exceptions=True
            )
            moved += sum(not isinstance(r, BaseException) for r in results)
            refused = any(isinstance(r, Overloaded) for r in results)
            await asyncio.sleep(MOVE_OFF_RETRY_S if refused else MOVE_OFF_POLL_S)
        return moved

    async def relieve(self, relief: Relief) -> int:
        """Move one request off each decode worker whose KV cache is at least
        ``relief.above`` full (blocks in use, as last polled, with what was sent since),
        by its KV, to the worker of its revision that ``pick_decode`` prefers among those
        at most ``relief.below`` full once they hold it: the request with the most tokens
        still to come (the most growth taken away), among those decoding now. A worker
        that cannot export its KV (a TP or EP group) is left to preempt: moving by
        recompute costs what preempting does. Returns how many moved (a move that failed
        is not retried here: the next call sees the worker again if it is still full)."""
        moves = []
        for w in self.registry.routable(self._decode_role()):
            if w.info is None or not w.info.handshakes or _fullness(w, 0) < relief.above:
                continue
            here = [life for life in self.lives.values() if life.decode_worker is w]
            decoding = [life for life in here if life.phase is Phase.DECODING]
            if not decoding:
                continue
            life = max(decoding, key=lambda lf: (lf.params.max_tokens - lf.num_sent, lf.num_sent))
            held = len(life.prompt_ids) + life.num_sent
            roomy = [
                d
                for d in of_revision(self.registry.routable(self._decode_role()), w.revision)
                if d is not w and self._has_room(d) and _fullness(d, held) <= relief.below
            ]
            to = pick_decode(roomy, Prompt.of(life.prompt_ids, w.block_size), held + 1)
            if to is not None:
                moves.append(self.migrate(life.request_id, to.worker_id, "kv", "kv_full"))
        results = await asyncio.gather(*moves, return_exceptions=True)
        return sum(not isinstance(r, BaseException) for r in results)


MOVE_REASONS = ("operator", "drain", "kv_full")


def _fullness(w: WorkerRecord, more_tokens: int) -> float:
    """The share of ``w``'s KV cache in use (as last polled, with the router's
    reservations since) were it to take ``more_tokens`` more; 1.0 before it reported."""
    if not w.num_blocks:
        return 1.0
    used = w.num_blocks - w.free_tokens / w.block_size + math.ceil(more_tokens / w.block_size)
    return used / w.num_blocks


def _check_by(by: str) -> None:
    if by not in ("kv", "recompute"):
        raise InvalidRequest(f"a request moves by 'kv' or 'recompute', not {by!r}")
