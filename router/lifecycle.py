"""One request in the router, from admission to its end: ``RequestLifecycle``.

Its phases, and the transitions between them (each a method; nothing else
writes its state)::

    ADMITTED --place(dw, source)--> PREFILLING     the task is with decode worker dw,
                                                   prefilled on source (a prefill
                                                   worker) or on dw itself
    PREFILLING --batch with the first token--> HANDING_OVER  (prefilled on a source)
                                           --> DECODING      (prefilled on dw)
    HANDING_OVER --batch with the pull's figures--> DECODING
    DECODING --begin_move(dw)--> MOVING   its decode worker is asked to let it go for dw
    MOVING --moved(record), its stream there ended, migrate()--> MOVING on dw (pulling its KV)
           --batch with the pull's figures--> DECODING
           --cancel_move(error)--> DECODING  (the old worker did not let it go: it goes on there)
    any of them --batch with a finish reason--> FINISHED

    retry_prefill(source)  PREFILLING -> PREFILLING: the source was lost before it
                           handed any KV over; another one (or dw) prefills
    recompute()            -> PREFILLING: the KV handover failed; dw prefills the
                           prompt and the tokens already sent
    resume(dw)             -> PREFILLING: the decode worker was lost; another one
                           prefills the prompt and the tokens already sent and
                           goes on after them
    redirect(dw, source)   -> PREFILLING: the task's start on its decode worker
                           failed (it never ran there): the same work on dw
    migrate()              MOVING -> MOVING on dw: live migration; dw pulls the KV the
                           old decode worker exported and decodes on after its tokens
                           (nothing computed again; a failed pull is a recompute); one
                           moved by recompute goes to PREFILLING on dw

Each transition returns the ``DecodeTask`` to send next. Its moments are marked
as they happen (the marks ``router.trace`` names); ``trace`` is the request as
it ends. Owned by the one ``Dispatcher.generate`` call serving the request.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import time

from splitserve.router.events import FinalEvent, TokenEvent
from splitserve.router.registry import WorkerRecord
from splitserve.router.trace import Mark, RequestTrace
from splitserve.wire.decode import DecodeTask, MovedRequest, PreCopy, TokenBatch
from splitserve.wire.errors import DeadlineExceeded
from splitserve.wire.prefill import PrefixPull
from splitserve.wire.sampling import FinishReason, SamplingParams


class Phase(enum.Enum):
    ADMITTED = "admitted"  # accepted; nothing sent yet
    PREFILLING = "prefilling"  # a decode worker has it; its prompt is being prefilled
    HANDING_OVER = "handing_over"  # first token passed on; its KV moves to the decode worker
    DECODING = "decoding"
    MOVING = "moving"  # live migration: its KV moves from one decode worker to another
    FINISHED = "finished"  # its last event was made


class RequestLifecycle:
    def __init__(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None
    ):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.accepted = time.time()
        self._accepted_mono = time.monotonic()
        self.timeout_s = timeout_s
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._phase = Phase.ADMITTED
        self._decode: WorkerRecord | None = None  # the decode worker the task is with
        self._source: WorkerRecord | None = None  # the prefill worker it prefills on, if any
        self._pull: PrefixPull | None = None  # where a source may copy the prompt's prefix from
        self._sent: list[int] = []  # token ids passed on so far
        self._prompt_logprobs_sent = False  # the prompt's logprobs passed on (a resume sends them again)
        self._token_times: list[float] = []  # when each was sampled (worker clocks)
        self._marks: list[Mark] = [Mark("admitted", self.accepted)]
        self._first_marked: dict[str, float] = {"admitted": self.accepted}  # name -> its first mark's time
        self._first_passed_at: float | None = None  # time.monotonic() when the first token went out
        self._prefill_worker = ""  # the prefill worker that made the first token
        self._handoff_bytes = 0  # the source's KV, pulled once the pull is reported
        self._kv_bytes = 0
        self._kv_streamed = False
        self._ended_in_prefill = False  # it finished at the first token of its source
        self._kv_pull_s = 0.0
        self._cached = 0
        self._drafts: dict[str, tuple[int, int]] = {}  # decode worker -> (proposed, kept) there
        self._prefix_pulled = 0  # prompt tokens its prefill worker copied from another
        self._prefix_pulled_from = ""
        self._prefill_revision = ""  # the revision of the prefill worker that made the first token
        # while MOVING: (the decode worker it moves to, what the old one exported), once known
        self._move: asyncio.Future | None = None
        self._move_to: WorkerRecord | None = None
        self._moved_from: WorkerRecord | None = None  # holds its exported KV until the pull ended
        self._placed_on: set[str] = set()  # every decode worker it was given to (ids)

    # ---- reads -----------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def decode_worker(self) -> WorkerRecord | None:
        return self._decode

    @property
    def source(self) -> WorkerRecord | None:
        """The prefill worker the current task prefills on (None: the decode worker does)."""
        return self._source

    @property
    def first_token_passed(self) -> bool:
        """The one flag for "the first token has been passed on"."""
        return self._first_passed_at is not None

    def was_on(self, w: WorkerRecord) -> bool:
        """Whether ``w`` was given this request before (it may still hold a leftover of
        it: a start whose answer was lost, an export, an abort not yet done there)."""
        return w.worker_id in self._placed_on

    @property
    def num_sent(self) -> int:
        return len(self._sent)

    def marked(self, name: str) -> float | None:
        return self._first_marked.get(name)

    def remaining(self) -> float | None:
        """Seconds left before the deadline (at least 1 ms), or None without one."""
        return None if self._deadline is None else max(0.001, self._deadline - time.monotonic())

    def watch(self) -> DeadlineWatch:
        """What bounds this request's waits on a worker by its deadline (``DeadlineWatch``)."""
        sentence = f"request {self.request_id} did not finish within {self.timeout_s or 0:.3g} s"
        return DeadlineWatch(self._deadline, sentence)

    # ---- transitions -------------------------------------------------------------------------
    def fork(self, request_id: str, params: SamplingParams) -> RequestLifecycle:
        """Another sequence of this request's prompt (``n`` > 1): a lifecycle of its own,
        ADMITTED, under ``request_id`` with ``params``, and this one's deadline."""
        other = RequestLifecycle(request_id, self.prompt_ids, params, self.timeout_s)
        other._deadline = self._deadline
        return other

    def place(
        self, decode: WorkerRecord, source: WorkerRecord | None, pull: PrefixPull | None = None
    ) -> DecodeTask:
        """ADMITTED -> PREFILLING on ``decode``, prefilled on ``source`` (None: ``decode``),
        which may copy the prompt's prefix as ``pull`` says (here and on a retry, unless
        the source is the holder itself)."""
        self._expect(Phase.ADMITTED)
        self._decode, self._phase, self._pull = decode, Phase.PREFILLING, pull
        self._placed_on.add(decode.worker_id)
        self._mark("placed", worker=decode.worker_id)
        return self._prefill_on(source)

    def retry_prefill(self, source: WorkerRecord | None) -> DecodeTask:
        """The source was lost before it handed any KV over: prefill on ``source`` instead
        (None: on the decode worker)."""
        self._expect(Phase.PREFILLING)
        return self._prefill_on(source)

    def pre_copy(self, timeout_s: float) -> PreCopy:
        """While DECODING, before a move: what the decode worker it is to move to copies
        ahead from the one it runs on (``PreCopy``: its tokens passed on so far), within
        ``timeout_s``. No transition: it decodes on meanwhile."""
        self._expect(Phase.DECODING)
        old = self._decode
        return PreCopy(
            self.request_id,
            self.prompt_ids,
            list(self._sent),
            self.params,
            old.client.peer(),
            old.worker_id,
            timeout_s,
        )

    def begin_move(self, to: WorkerRecord) -> None:
        """DECODING -> MOVING: its decode worker is being asked to suspend it and export its
        KV for ``to`` (``router.moves.Moves.migrate``); ``moved`` or ``cancel_move`` says how it went."""
        self._expect(Phase.DECODING)
        self._phase, self._move = Phase.MOVING, asyncio.get_running_loop().create_future()
        self._move_to = to

    def moved(self, moved: MovedRequest) -> None:
        """The old decode worker exported it (its stream there ends after its tokens)."""
        if self._move is not None and not self._move.done():
            self._move.set_result(moved)

    def cancel_move(self, error: Exception) -> None:
        """MOVING -> DECODING: the old worker did not move it (it goes on there, or ended;
        a ``migrate`` already waiting raises ``error``)."""
        move = self._move
        if self._phase is not Phase.MOVING or move is None or move.done():
            return
        self._phase, self._move = Phase.DECODING, None
        move.set_exception(error)
        move.exception()  # retrieved: nobody may be waiting

    @property
    def moving(self) -> bool:
        return self._phase is Phase.MOVING

    @property
    def moved_from(self) -> WorkerRecord | None:
        """While a move's pull has not ended: the decode worker holding the KV it exported."""
        return self._moved_from

    async def migrate(self) -> DecodeTask:
        """Its stream on the old decode worker ended marked ``moved``: the task that has the
        new one pull its KV and decode on after every token sent (all the old one made)."""
        self._expect(Phase.MOVING)
        moved: MovedRequest = await asyncio.shield(self._move)
        if moved.output_token_ids != self._sent:
            raise RuntimeError(
                f"request {self.request_id} moved with {len(moved.output_token_ids)} tokens, "
                f"{len(self._sent)} passed on"
            )
        self._mark("moved", worker=self._move_to.worker_id)
        if moved.handoff is None:  # by recompute: the new worker prefills the prompt and those tokens
            return self._continue_on(self._move_to)
        old, self._decode = self._decode, self._move_to
        self._placed_on.add(self._decode.worker_id)
        self._moved_from = old
        return DecodeTask(
            self.request_id,
            self.prompt_ids,
            self.params,
            self.remaining(),
            moved=moved,
            moved_from=old.client.peer(),
        )

    def recompute(self, error: BaseException) -> DecodeTask:
        """The KV handover failed with ``error``: the decode worker prefills the prompt and
        the tokens already sent itself. The mark names the pair and the error."""
        self._expect(Phase.PREFILLING, Phase.HANDING_OVER, Phase.MOVING)
        self._mark("kv_recompute", worker=self._decode.worker_id, detail=self.transfer_failure(error))
        return self._continue_on(self._decode)

    def resume(self, decode: WorkerRecord) -> DecodeTask:
        """The decode worker was lost: ``decode`` prefills the prompt and the tokens already
        sent, and goes on after them (seeded sampling included) as if nothing had happened."""
        self._expect(Phase.PREFILLING, Phase.HANDING_OVER, Phase.DECODING, Phase.MOVING)
        self._mark("resumed", worker=decode.worker_id)
        return self._continue_on(decode)

    def redirect(self, decode: WorkerRecord, source: WorkerRecord | None) -> DecodeTask:
        """Its task's start on the decode worker failed (``WorkerUnreachable``: it never ran
        there): the same work on ``decode``. Before any token was passed on it prefills on
        ``source`` (None: on ``decode``), which was never asked either; after, or in a move,
        ``decode`` prefills the prompt and the tokens sent and goes on (as ``resume``)."""
        self._expect(Phase.PREFILLING, Phase.MOVING)
        self._mark("redirected", worker=decode.worker_id)
        if self._sent or self._phase is Phase.MOVING:
            return self._continue_on(decode)
        self._decode = decode
        self._placed_on.add(decode.worker_id)
        return self._prefill_on(source)

    def on_batch(self, batch: TokenBatch) -> list[TokenEvent | FinalEvent]:
        """A batch from the decode worker: what to pass on, the phase it moves to."""
        self._expect(Phase.PREFILLING, Phase.HANDING_OVER, Phase.DECODING, Phase.MOVING)
        worker = self._decode.worker_id
        events: list[TokenEvent | FinalEvent] = []
        p = batch.prefilled
        if p is not None:
            self._prefill_worker, self._prefill_revision = p.worker_id, p.revision
            self._kv_streamed, self._handoff_bytes = p.streamed, p.kv_bytes
            self._prefix_pulled, self._prefix_pulled_from = p.pulled_tokens, p.pulled_from
            if p.scheduled_at is not None:
                self._mark("prefill_started", p.scheduled_at, p.worker_id)
            if p.exported_at is not None:
                self._mark("kv_exported", p.exported_at, worker)
        self._cached = max(self._cached, batch.num_cached_tokens)
        if batch.draft_tokens:  # counts on this worker so far
            self._drafts[worker] = (batch.draft_tokens, batch.accepted_draft_tokens)
        if batch.token_ids or batch.text:
            first = not self.first_token_passed
            events.append(self._tokens(batch))
            if first:
                self._first_passed_at = time.monotonic()
                self._mark("first_token")
                self._phase = Phase.HANDING_OVER if self._source is not None else Phase.DECODING
            elif not self.marked("first_decode_token"):
                self._mark("first_decode_token", worker=worker)
        if batch.started_at is not None:
            if not self.marked("prefill_started"):
                self._mark("prefill_started", batch.started_at, worker)
            elif self.first_token_passed and not self.marked("decode_admitted"):
                self._mark("decode_admitted", batch.started_at, worker)
        if batch.transfer_s is not None and self._phase is Phase.MOVING:
            if self._decode is self._move_to:  # the new worker pulled it: moved
                self._phase, self._move, self._moved_from = Phase.DECODING, None, None
                self._mark("move_pulled", worker=worker)
        elif batch.transfer_s is not None:
            self._kv_pull_s, self._kv_bytes = batch.transfer_s, self._handoff_bytes
            self._phase = Phase.DECODING
        if batch.finish_reason is not None:
            events.append(self._final(batch.finish_reason))
        return events

    def handover_s(self, batch: TokenBatch) -> float | None:
        """Seconds from the first token to ``batch``, if it reports the pull (the decider's
        handover cost)."""
        if batch.transfer_s is None or self._first_passed_at is None:
            return None
        return time.monotonic() - self._first_passed_at

    def trace(self, outcome: str, ok: bool) -> RequestTrace:
        """The request's trace, as it ends now with ``outcome``."""
        finished = () if self.marked("finished") else (Mark("finished", self._now()),)
        decoded = self._decode is not None and not self._ended_in_prefill
        return RequestTrace(
            request_id=self.request_id,
            outcome=outcome,
            ok=ok,
            prompt_tokens=len(self.prompt_ids),
            cached_prompt_tokens=self._cached,
            output_tokens=len(self._sent),
            prefill_worker=self._prefill_worker,
            decode_worker=self._decode.worker_id if decoded else "",
            kv_bytes=self._kv_bytes,
            kv_pull_s=self._kv_pull_s,
            marks=(*self._marks, *finished),
            token_times=tuple(self._token_times),
            kv_streamed=self._kv_streamed,
            prefix_pulled_tokens=self._prefix_pulled,
            prefix_pulled_from=self._prefix_pulled_from,
            prefill_revision=self._prefill_revision,
            decode_revision=self._decode.revision if decoded else "",
            adapter=self.params.adapter or "",
        )

    # ---- internals ---------------------------------------------------------------------------
    def _expect(self, *phases: Phase) -> None:
        if self._phase not in phases:
            raise RuntimeError(f"request {self.request_id} is {self._phase.value}, not {phases[0].value}")

    def _prefill_on(self, source: WorkerRecord | None) -> DecodeTask:
        self._source = source
        if source is not None:
            self._mark("prefill_sent", worker=source.worker_id)
        pull = self._pull
        if source is None or (pull is not None and pull.holder_id == source.worker_id):
            pull = None
        return DecodeTask(
            self.request_id,
            self.prompt_ids,
            self.params,
            self.remaining(),
            source=source.client if source is not None else None,
            prefix_from=pull,
        )

    def _continue_on(self, decode: WorkerRecord) -> DecodeTask:
        self._decode, self._source, self._phase, self._move = decode, None, Phase.PREFILLING, None
        self._placed_on.add(decode.worker_id)
        self._moved_from = None
        if not self._sent:  # nothing passed on yet: a fresh local prefill
            self._prefill_worker, self._prefill_revision = "", ""
            self._prefix_pulled, self._prefix_pulled_from = 0, ""
        return DecodeTask(self.request_id, self.prompt_ids, self.params, self.remaining(), list(self._sent))

    def _now(self) -> float:
        """The wall-clock time now, as the monotonic clock counts from ``accepted``: the
        router's own marks keep their true intervals even when the wall clock is stepped."""
        return self.accepted + (time.monotonic() - self._accepted_mono)

    def transfer_failure(self, error: BaseException) -> str:
        """A failed KV transfer of this request as a sentence naming the worker it came from
        (the prefill worker, or the decode worker a move left) and the one it went to."""
        lender = self._moved_from if self.moving else self._source
        came = f"from {lender.worker_id} " if lender is not None else ""
        return f"the KV {came}to {self._decode.worker_id} failed: {type(error).__name__}: {error}"

    def _mark(self, name: str, at: float | None = None, worker: str = "", detail: str = "") -> None:
        mark = Mark(name, self._now() if at is None else at, worker, detail)
        self._marks.append(mark)
        self._first_marked.setdefault(name, mark.at)

    def _tokens(self, batch: TokenBatch) -> TokenEvent:
        self._sent.extend(batch.token_ids)
        self._token_times.extend(batch.token_times)
        ms = [max(0.0, (t - self.accepted) * 1000) for t in batch.token_times]
        prompt_logprobs = None
        if batch.prompt_logprobs is not None and not self._prompt_logprobs_sent:  # a resume sends them again
            prompt_logprobs, self._prompt_logprobs_sent = batch.prompt_logprobs, True
        return TokenEvent(
            list(batch.token_ids),
            batch.text,
            list(batch.logprobs),
            ms,
            len(self.prompt_ids),
            list(batch.top_logprobs),
            prompt_logprobs,
        )

    def _final(self, reason: FinishReason) -> FinalEvent:
        self._ended_in_prefill = self._source is not None and self._phase != Phase.DECODING
        self._mark("finished")
        self._phase = Phase.FINISHED
        trace = self.trace(reason.value, True)
        phases = trace.phases_s()
        return FinalEvent(
            finish_reason=reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self._sent),
            cached_prompt_tokens=self._cached,
            queue_ms=phases["queue"] * 1000,
            prefill_ms=phases["prefill"] * 1000,
            transfer_ms=phases["kv_transfer"] * 1000,
            decode_ms=phases["decode"] * 1000,
            kv_pull_ms=self._kv_pull_s * 1000,
            ttft_ms=(trace.ttft_s or trace.e2e_s) * 1000,
            e2e_ms=trace.e2e_s * 1000,
            prefill_worker=self._prefill_worker,
            decode_worker=trace.decode_worker,
            draft_tokens=sum(d for d, _ in self._drafts.values()),
            accepted_draft_tokens=sum(a for _, a in self._drafts.values()),
        )


class DeadlineWatch:
    """Bounds one task's waits (``wait``) by a deadline (``time.monotonic()``; None: no
    bound) with one timer for all of them: ``asyncio.timeout`` per wait would cost a
    timer per token batch of every stream. Past the deadline a wait ends with
    ``DeadlineExceeded`` (the awaited call is cancelled), and so does any wait after it.
    Use as a context manager in the task that waits; leaving it drops the timer."""

    def __init__(self, deadline: float | None, sentence: str):
        self._sentence = sentence
        self._task = asyncio.current_task()
        self._waiting = self._expired = False
        self._timer = None
        if deadline is not None:  # the loop's clock is time.monotonic()
            self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def __enter__(self) -> DeadlineWatch:
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        self._expired = True
        if self._waiting:  # else the next wait raises
            self._task.cancel()

    async def wait(self, awaitable):
        if self._expired:
            if inspect.iscoroutine(awaitable):
                awaitable.close()  # never awaited: no warning
            raise DeadlineExceeded(self._sentence)
        self._waiting = True
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self._expired and self._task.uncancel() == 0:  # ours, not the caller's
                raise DeadlineExceeded(self._sentence) from None
            raise
        finally:
            self._waiting = False
