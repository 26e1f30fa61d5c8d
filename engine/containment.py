"""A request can only fail itself: how an engine step keeps one sequence's fault
from stopping the engine or changing another sequence's tokens.

Two kinds of fault, two places::

    a sequence's own part of a step           the sampler (engine.sampler: a row that
    (sampling, grammar, detokenisation,  -->  raises is found by sampling row by row) and
    stop strings, logprobs)                   Engine._advance: that sequence ends with a
                                              SequenceFailed, the others go on

    the model step itself (the forward        Containment.run below:
    pass, prompt logprobs)               -->    1. run it again, same sequences (the
                                                   scheduler admits nothing new meanwhile)
                                                2. run each sequence alone; one that still
                                                   fails ends with SequenceFailed("forward")
                                                3. every sequence failing alone, or steps
                                                   blaming everything MAX_BLAMED_STEPS times
                                                   in a row: the engine is at fault, raise

Running a step again rewrites the same KV slots with the same values (no token
counts moved before the step succeeded), so a retry and the one-by-one runs are
exact: the other sequences' tokens are those of an undisturbed step (greedy and
seeded sampling do not depend on the batch).

Under tensor (or expert) parallelism a model step is a collective: a rank that
raised inside it leaves the others waiting in theirs, so the group cannot run
it again; a forward failure there stops the worker as before (its router
resumes its requests elsewhere). Every other containment holds in a group as
on one rank: only the driver samples, and a sequence it fails is gone from the
next step it broadcasts, so the ranks never disagree.

A layer observer (a prefill worker streaming KV layer by layer) saw the failed
step begin: it is told ``step_failed`` (``LayerExporter`` releases that step's
streamed exports, so a reader already pulling one fails fast and its router
recomputes the request) and the retries run without it; a prompt completed by
the retry is exported whole after the step.

No torch here: the runner does the work.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from splitserve.engine.scheduler import ScheduledSeq
from splitserve.wire.errors import SequenceFailed
from splitserve.wire.outputs import LayerObserver, PromptLogprob, TopLogprobs

log = logging.getLogger(__name__)

# consecutive steps whose every sequence failed alone before the engine is blamed
MAX_BLAMED_STEPS = 3

_PARTS = {
    "grammar": "its structured output's grammar refused the token chosen for it",
    "detokenization": "turning its tokens into text (or checking its stop strings) failed",
    "logprobs": "computing its logprobs failed",
    "kv_cache": "recording its computed KV in the cache failed",
    "sampling": "sampling its next token failed",
    "forward": "the model failed on this request",
}


@dataclass
class Ran:
    """One scheduled sequence's result of a step: its sampled rows (none when this chunk
    samples nothing; one per position of a speculative draft and one more with one,
    ``speculative.verify``: a later row that could not be sampled is None) or why it
    failed (its first row could not be sampled, or its step raised)."""

    entry: ScheduledSeq
    tokens: list[int | None] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[TopLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    error: SequenceFailed | None = None


def contained(part: str, error: BaseException) -> SequenceFailed:
    """``error``, raised by ``part`` of one sequence's step, as that sequence's failure."""
    if isinstance(error, SequenceFailed):
        return error
    return SequenceFailed(part, f"{_PARTS[part]} ({type(error).__name__}: {error})")


class Runner(Protocol):
    """What containment needs of ``engine.model_runner.ModelRunner``."""

    def execute(self, scheduled: list[ScheduledSeq], on_layer: Callable[[int], None] | None = None): ...


class Containment:
    """Runs an engine's steps (``run``), containing a failed model step. One per engine,
    on its thread."""

    def __init__(self, runner: Runner, group_size: int, observer: Callable[[], LayerObserver | None]):
        self.runner = runner
        self.group_size = group_size
        self._observer = observer
        self.retried = 0  # model steps that failed once and were run again
        self.narrowed = 0  # model steps that failed twice and were run sequence by sequence
        self._blamed_in_a_row = 0

    def run(
        self,
        scheduled: list[ScheduledSeq],
        hook: Callable[[list[ScheduledSeq]], Callable[[int], None] | None],
    ) -> list[Ran]:
        """Every scheduled sequence's result of one step, in packed order (``hook`` gives
        the layer callback of a first attempt). Raises what the model raised when no
        sequence can be blamed (see the module docstring)."""
        try:
            ran = self._execute(scheduled, hook(scheduled))
        except Exception as first:
            if self.group_size > 1:
                raise  # a collective half run: the group cannot run it again
            return self._contain(scheduled, first)
        self._blamed_in_a_row = 0
        return ran

    def _contain(self, scheduled: list[ScheduledSeq], first: Exception) -> list[Ran]:
        observer = self._observer()
        if observer is not None:
            observer.step_failed()
        self.retried += 1
        log.warning("a step of %d sequences failed (%r); running it again", len(scheduled), first)
        try:
            ran = self._execute(scheduled, None)
        except Exception as e:
            log.warning("the step failed again (%r); running its sequences one by one", e)
        else:
            self._blamed_in_a_row = 0
            return ran
        self.narrowed += 1
        ran, blamed = [], 0
        for entry in scheduled:
            try:
                ran += self._execute([entry], None)
            except Exception as e:
                ran.append(Ran(entry, error=contained("forward", e)))
                blamed += 1
        if blamed < len(scheduled):
            self._blamed_in_a_row = 0
            return ran
        self._blamed_in_a_row += 1
        if len(scheduled) > 1 or self._blamed_in_a_row >= MAX_BLAMED_STEPS:
            raise first  # every sequence fails alone: the engine, not a request, is at fault
        return ran

    def _execute(self, scheduled: list[ScheduledSeq], on_layer: Callable[[int], None] | None) -> list[Ran]:
        """One model step over ``scheduled`` (no sequence's counts change here)."""
        ordered, result, prompt_logprobs = self.runner.execute(scheduled, on_layer)
        out, k = [], 0
        for entry in ordered:
            ran = Ran(entry, prompt_logprobs=list(prompt_logprobs.get(entry.seq.request_id, ())))
            if entry.samples:
                rows = range(k, k + 1 + len(entry.draft))
                ran.tokens = [None if i in result.failed else result.token_ids[i] for i in rows]
                ran.logprobs = [result.logprobs[i] for i in rows]
                ran.tops = [result.top_logprobs[i] for i in rows]
                ran.error = result.failed.get(k)
                k += len(rows)
            out.append(ran)
        return out
