"""Fault injection into one request's part of an engine step, for the containment
tests: each helper makes one request's grammar, sampling, detokenisation or model
step raise from its ``at``-th output token on (or once), in a real engine, while
the rest of the batch runs as usual."""

from __future__ import annotations

from splitserve.engine.engine import Engine


class Injected(RuntimeError):
    """The fault the helpers raise (nothing else raises it)."""


def fail_grammar(engine: Engine, request_id: str, at: int) -> None:
    """The request's grammar raises when its ``at``-th output token is appended."""
    seq = engine.requests[request_id].seq
    consume = seq.grammar.consume

    def failing(token_id: int) -> None:
        if seq.num_output_tokens >= at:
            raise Injected("the grammar broke")
        consume(token_id)

    seq.grammar.consume = failing


def fail_detokenizer(engine: Engine, request_id: str, at: int) -> None:
    """Making the request's text (``Engine.step``'s, in-line) raises at its ``at``-th
    output token."""
    texts = engine._texts
    feed = texts.feed

    def failing(out):
        if out.request_id == request_id and out.num_output_tokens >= at:
            raise Injected("the detokenizer broke")
        return feed(out)

    texts.feed = failing


def fail_sampling(engine: Engine, prompt_ids: list[int], at: int) -> None:
    """Sampling any batch that holds the request with these prompt ids raises once it
    has ``at`` output tokens (the sampler then samples row by row: only its row fails)."""
    sampler = engine.runner.sampler
    sample_batch = sampler._sample_batch
    n = len(prompt_ids)

    def failing(logits, rows):
        if any(r.token_ids[:n] == prompt_ids and r.output_index >= at for r in rows if r.token_ids):
            raise Injected("sampling broke")
        return sample_batch(logits, rows)

    sampler._sample_batch = failing


def fail_forward(engine: Engine, request_id: str, times: int | None = None) -> list[int]:
    """Every model step whose batch holds the request raises (``times`` of them, or all);
    returns a list that counts the faults raised."""
    runner = engine.runner
    execute = runner.execute
    raised = []

    def failing(scheduled, on_layer=None):
        if any(s.seq.request_id == request_id for s in scheduled) and (times is None or len(raised) < times):
            raised.append(len(scheduled))
            raise Injected("the model step broke")
        return execute(scheduled, on_layer)

    runner.execute = failing
    return raised
