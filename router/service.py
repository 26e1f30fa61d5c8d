"""The gRPC servicer: ``splitserve.v1.Splitserve`` over a ``Dispatcher``.

Converts protos to the router's typed inputs and back; every error becomes a
status through ``router.errors.status_for``, and nothing else here decides codes.
Every handler ends its call with a status, whatever is raised inside it: a stray
``CancelledError`` (one its caller did not ask for: a call inside the cluster cut
off) is answered like any error, since grpc.aio would end the call without one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from splitserve.proto import splitserve_pb2 as pb
from splitserve.proto import splitserve_pb2_grpc as pb_grpc
from splitserve.router.dispatch import Dispatcher
from splitserve.router.errors import status_for
from splitserve.router.events import FinalEvent, GenerateInput, TokenEvent
from splitserve.router.registry import WorkerRecord
from splitserve.router.roles import Role
from splitserve.router.tools import (
    OutputFormat,
    ToolChoice,
    ToolParser,
    parse,
    template_messages,
    tool_choice,
    with_forced_call,
)
from splitserve.router.trace import RequestTrace
from splitserve.wire.background import cancelled_by_caller
from splitserve.wire.chat import ChatTemplating
from splitserve.wire.decode import DecodeStats
from splitserve.wire.defaults import DEFAULTED
from splitserve.wire.errors import InvalidRequest, PreconditionFailed
from splitserve.wire.outputs import TopLogprobs
from splitserve.wire.prefill import PrefillStats
from splitserve.wire.routers import RouterInfo
from splitserve.wire.sampling import FinishReason, SamplingParams, StructuredOutput

log = logging.getLogger(__name__)

# what a request's bytes decode to when they are not its message (router.server's
# MalformedRequestInterceptor decodes them so; Generate refuses it itself)
MALFORMED = object()


def malformed(method: str) -> str:
    return f"the request is not a valid splitserve.v1.{method}Request message (protobuf wire format)"


_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}


def sampling_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    """Proto sampling fields -> ``SamplingParams``; the fields left unset
    (``unset_fields``) are defaulted by the dispatcher, as for HTTP."""
    given = {f: getattr(sp, f) for f in DEFAULTED if sp.HasField(f)}
    return SamplingParams(
        **given,
        seed=sp.seed if sp.HasField("seed") else None,
        stop=list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs,
        top_logprobs=sp.top_logprobs,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        skip_special_tokens=not sp.keep_special_tokens,
        bad_words=list(sp.bad_words),
        structured=StructuredOutput(sp.structured.kind, sp.structured.spec)
        if sp.HasField("structured")
        else None,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        logit_bias=dict(sp.logit_bias),
        min_tokens=sp.min_tokens,
        allowed_token_ids=list(sp.allowed_token_ids) or None,
        n=sp.n or 1,
        prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
        speculate=sp.speculate if sp.HasField("speculate") else True,
    )


def unset_fields(sp: pb.SamplingParams) -> frozenset[str]:
    return frozenset(f for f in DEFAULTED if not sp.HasField(f))


def _input_of(msg) -> tuple[str | list[int] | None, list[dict[str, Any]] | None]:
    kind = msg.WhichOneof("input")
    if kind == "prompt":
        return msg.prompt, None
    if kind == "token_ids":
        return list(msg.token_ids.ids), None
    if kind == "messages":
        return None, template_messages([_message(m) for m in msg.messages.messages], str)
    raise InvalidRequest("the request has no input: set prompt, token_ids or messages")


def _message(m: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        out["tool_calls"] = _json(m.tool_calls_json, "a message's tool_calls_json", list)
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _json(text: str, what: str, kind: type) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        raise InvalidRequest(f"{what} is not JSON") from None
    if not isinstance(value, kind):
        raise InvalidRequest(f"{what} must be a JSON {'list' if kind is list else 'object'}")
    return value


def _chat(
    request: pb.GenerateRequest, params: SamplingParams
) -> tuple[ChatTemplating, ToolChoice, SamplingParams]:
    """A chat request's rendering (``ChatOptions``), its tool choice, and ``params`` with
    the structured output a forced call needs (``router.tools``)."""
    o = request.chat
    tools = _json(o.tools_json, "chat.tools_json", list) if o.tools_json else None
    choice_value = json.loads(o.tool_choice_json) if o.tool_choice_json else None
    choice = tool_choice(tools, choice_value)
    if choice.forced:
        params = with_forced_call(params, tools, choice, not o.single_tool_call)
    variables = (
        _json(o.chat_template_kwargs_json, "chat.chat_template_kwargs_json", dict)
        if (o.chat_template_kwargs_json)
        else {}
    )
    shown = tools if tools and choice.mode != "none" else None
    return ChatTemplating(shown, o.chat_template or None, variables), choice, params


def generate_input(
    request: pb.GenerateRequest, time_remaining: float | None
) -> tuple[GenerateInput, ToolChoice]:
    """The request as the dispatcher takes it, and how its output may call tools."""
    prompt, messages = _input_of(request)
    timeouts = [t for t in (time_remaining, request.timeout_ms / 1000 if request.timeout_ms else None) if t]
    params, templating, choice = sampling_from_proto(request.sampling), None, ToolChoice("none")
    if request.HasField("chat"):
        if messages is None:
            raise InvalidRequest("chat options (tools, template) need chat messages")
        templating, choice, params = _chat(request, params)
    inp = GenerateInput(
        params=params,
        unset=unset_fields(request.sampling),
        prompt=prompt,
        messages=messages,
        templating=templating,
        model=request.model,
        request_id=request.request_id,
        timeout_s=min(timeouts) if timeouts else None,
    )
    return inp, choice


def _top_proto(best: TopLogprobs) -> pb.TopLogprobs:
    return pb.TopLogprobs(token_ids=[t for t, _ in best], logprobs=[lp for _, lp in best])


def _token_response(request_id: str, e: TokenEvent) -> pb.GenerateResponse:
    """``e`` as the message a client gets; built in place, the optional parts only when
    present (this runs once per token batch of every stream)."""
    out = pb.GenerateResponse(request_id=request_id)
    t = out.token
    t.token_ids.extend(e.token_ids)
    t.text = e.text
    t.times_ms.extend(e.times_ms)
    t.index = e.index
    if e.logprobs:
        t.logprobs.extend(e.logprobs)
    if e.top_logprobs:
        t.top_logprobs.extend(_top_proto(best) for best in e.top_logprobs)
    if e.prompt_logprobs:
        t.prompt_logprobs.extend(
            pb.PromptLogprob(logprob=lp, top=_top_proto(best)) for lp, best in e.prompt_logprobs
        )
    return out


def _final_proto(e: FinalEvent) -> pb.Final:
    return pb.Final(
        finish_reason=_FINISH.get(e.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        usage=pb.Usage(
            prompt_tokens=e.prompt_tokens,
            completion_tokens=e.completion_tokens,
            cached_prompt_tokens=e.cached_prompt_tokens,
            draft_tokens=e.draft_tokens,
            accepted_draft_tokens=e.accepted_draft_tokens,
        ),
        timing=pb.Timing(
            queue_ms=e.queue_ms,
            prefill_ms=e.prefill_ms,
            transfer_ms=e.transfer_ms,
            decode_ms=e.decode_ms,
            kv_pull_ms=e.kv_pull_ms,
            ttft_ms=e.ttft_ms,
            e2e_ms=e.e2e_ms,
        ),
        prefill_worker=e.prefill_worker,
        decode_worker=e.decode_worker,
        index=e.index,
    )


async def _answer(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with ``error``'s status and sentence (``status_for``). A cancellation
    of the call itself (its client left) is raised again: nobody is left to answer.
    An abort already under way passes through."""
    if isinstance(error, grpc.aio.AbortError) or (
        isinstance(error, asyncio.CancelledError) and cancelled_by_caller()
    ):
        raise error
    await context.abort(*status_for(error))


def _answered(handler):
    """A unary handler that ends with a status whatever it raises (``_answer``)."""

    @functools.wraps(handler)
    async def run(self, request, context):
        try:
            return await handler(self, request, context)
        except (Exception, asyncio.CancelledError) as e:
            await _answer(context, e)

    return run


Routers = Callable[[], Awaitable[list[RouterInfo]]]
# a rolling upgrade (config YAML or "", model or "", pace) -> its report (cluster.upgrade):
# started and removed worker ids, and the new workers' revisions
Upgrade = Callable[[str, str, int], Awaitable[Any]]


class SplitserveService(pb_grpc.SplitserveServicer):
    def __init__(
        self,
        dispatcher: Dispatcher,
        mode: str,
        tool_parser: ToolParser = "hermes",
        routers: Routers | None = None,
        upgrade: Upgrade | None = None,
    ):
        self.dispatcher = dispatcher
        self.mode = mode
        self.tool_parser = tool_parser  # how "auto" tool calls are read from the output
        self.routers = routers  # the cluster's routers, this one first, for ClusterStatus
        self.upgrade = upgrade  # runs Upgrade (the router that owns the pools), or None

    async def Generate(self, request, context):
        """The request's tokens; a request with tools gets the calls read from each
        sequence's whole text in its ``Final`` (the text streams as it comes)."""
        if request is MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed("Generate"))
        rid = request.request_id or uuid.uuid4().hex
        try:
            inp, choice = generate_input(request, context.time_remaining())
            inp = dataclasses.replace(inp, request_id=rid)
            fmt = OutputFormat(choice, self.tool_parser) if choice.mode != "none" else None
            texts: collections.defaultdict[int, list[str]] = collections.defaultdict(list)
            # closed here, whatever ends the call: a call cancelled while this handler waits
            # on its own yield would otherwise leave the request in flight (its id taken,
            # its workers busy) until the event loop finalizes the generator
            async with contextlib.aclosing(self.dispatcher.generate(inp)) as events:
                async for event in events:
                    if isinstance(event, TokenEvent):
                        if fmt is not None:  # the calls are read from the whole text at the end
                            texts[event.index].append(event.text)
                        yield _token_response(rid, event)
                    else:
                        final = _final_proto(event)
                        if fmt is not None:
                            calls = parse("".join(texts[event.index]), fmt).calls
                            final.tool_calls.extend(
                                pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls
                            )
                        yield pb.GenerateResponse(request_id=rid, final=final)
        except (Exception, asyncio.CancelledError) as e:
            await _answer(context, e)

    @_answered
    async def Tokenize(self, request, context):
        self.dispatcher.check_model(request.model)
        ids = self.dispatcher.validator.encode(*_input_of(request))
        return pb.TokenizeResponse(token_ids=ids, max_model_len=self.dispatcher.validator.max_model_len)

    @_answered
    async def Detokenize(self, request, context):
        self.dispatcher.check_model(request.model)
        text = self.dispatcher.validator.decode(list(request.token_ids))
        return pb.DetokenizeResponse(text=text)

    @_answered
    async def ListModels(self, request, context):
        v, name = self.dispatcher.validator, self.dispatcher.served_model
        names = (name, *self.dispatcher.adapters)  # the base, then its LoRA adapters
        models = [pb.ModelInfo(id=n, max_model_len=v.max_model_len, vocab_size=v.vocab_size) for n in names]
        return pb.ListModelsResponse(models=models)

    @_answered
    async def Drain(self, request, context):
        """Drain a decode or colocated worker and move its requests off (``move_off``)."""
        d, wid = self.dispatcher, request.worker_id
        w = d.registry.get(wid)
        if w is None or w.role == Role.PREFILL:
            raise InvalidRequest(f"no decode or colocated worker {wid!r}: see splitserve status")
        others = [o for o in d.registry.routable(w.role) if o is not w]
        if w.routable and not others:  # checked before anything changes
            raise PreconditionFailed(
                f"{wid} is the only routable {w.role} worker: drained, it would leave no worker to "
                f"serve new requests and none to move its {len(w.decoding)} request(s) to; start "
                "another first (nothing was changed)"
            )
        d.registry.drain(wid)
        moved = await d.moves.move_off(wid, request.by or "kv", request.timeout_s or DRAIN_TIMEOUT_S)
        return pb.DrainResponse(moved=moved, left=d.moves.on_worker(wid))

    @_answered
    async def Upgrade(self, request, context):
        """Replace every worker by one of the new config or model, a few at a time."""
        if self.upgrade is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "this router runs no pools: ask the cluster's first router"
            )
        report = await self.upgrade(request.config_yaml, request.model, request.pace or 1)
        revisions = sorted(set(report.revisions.values()))
        return pb.UpgradeResponse(started=report.started, removed=report.removed, revisions=revisions)

    @_answered
    async def ClusterStatus(self, request, context):
        d = self.dispatcher
        registry = d.registry
        await registry.poll()  # fresh figures for whoever asks
        pools = []
        for role in Role:
            workers = registry.workers(role)
            if workers:
                routable = sum(w.routable for w in workers)
                pools.append(
                    pb.PoolStatus(role=role, replicas=routable, workers=[_worker_status(w) for w in workers])
                )
        placements = [
            pb.PlacementCount(placement=placement.value, reason=reason.value, count=n)
            for (placement, reason), n in sorted(d.decider.counts.items(), key=lambda kv: -kv[1])
        ]
        routers = await self.routers() if self.routers is not None else []
        return pb.ClusterStatusResponse(
            routers=[_router_status(r) for r in routers],
            answered_by=routers[0].index if routers else 0,
            mode=self.mode,
            model=d.served_model,
            pools=pools,
            inflight_requests=d.num_inflight,
            placements=placements,
            handover_ms=d.decider.handover_s * 1000,
            given_up=[
                pb.GivenUpWorker(worker_id=g.worker_id, role=g.role, reason=g.reason, at=g.at)
                for g in registry.given_up
            ],
            traces=[_trace_proto(t) for t in d.traces.latest(request.traces)],
            transfer_failures=[
                pb.TransferFailureCount(error=error, action=action, count=n)
                for (error, action), n in sorted(d.transfer_failures.items())
            ],
        )


DRAIN_TIMEOUT_S = 60.0  # a Drain call's default time to move requests off


def _router_status(r: RouterInfo) -> pb.RouterStatus:
    return pb.RouterStatus(
        index=r.index,
        node_id=r.node_id,
        address=r.address,
        http_address=r.http_address,
        alive=r.alive,
        inflight_requests=r.inflight,
        admitted=r.admitted,
        max_inflight_requests=r.max_inflight,
    )


def _trace_proto(t: RequestTrace) -> pb.RequestTrace:
    return pb.RequestTrace(
        request_id=t.request_id,
        outcome=t.outcome,
        prompt_tokens=t.prompt_tokens,
        cached_prompt_tokens=t.cached_prompt_tokens,
        output_tokens=t.output_tokens,
        prefill_worker=t.prefill_worker,
        decode_worker=t.decode_worker,
        kv_bytes=t.kv_bytes,
        kv_pull_ms=t.kv_pull_s * 1000,
        prefix_pulled_tokens=t.prefix_pulled_tokens,
        prefix_pulled_from=t.prefix_pulled_from,
        prefill_revision=t.prefill_revision,
        decode_revision=t.decode_revision,
        spans=[
            pb.TraceSpan(name=s.name, start=s.start, duration_ms=s.seconds * 1000, worker=s.worker)
            for s in t.spans
        ],
        marks=[pb.TraceMark(name=m.name, at=m.at, worker=m.worker, detail=m.detail) for m in t.marks],
    )


def _worker_status(w: WorkerRecord) -> pb.WorkerStatus:
    out = pb.WorkerStatus(
        worker_id=w.worker_id,
        role=w.role,
        alive=w.alive and not w.error,
        error=w.error,
        state=w.state.value,
        router_active=w.active,
        prefill_tokens_per_s=w.prefill_tokens_per_s,
        prefix_blocks=len(w.prefix.hashes),
        waiting_for_node=w.waiting_for_node,
        restarts=w.restarts,
    )
    if w.node is not None:
        out.node_id, out.node_type = w.node.node_id, w.node.node_type
    if w.info is not None:
        v = w.info.validator
        out.kv_cache_tokens, out.max_model_len = v.max_kv_tokens, v.max_model_len
        out.max_concurrency = v.max_kv_tokens / v.max_model_len
        out.kv_bytes_per_token = w.info.kv_bytes_per_token
        out.revision = w.revision
    s = w.stats
    if s is not None:
        e = s.engine
        out.running, out.waiting = e.num_running, e.num_waiting
        out.queued_prompt_tokens = e.num_pending_prompt_tokens
        out.kv_blocks_total, out.kv_blocks_used = e.num_blocks, e.num_used_blocks
        out.preemptions = e.num_preemptions
        out.sequence_errors.update(dict(e.sequence_errors))
        out.lora_adapters.update(dict(e.lora_adapters))
        sp = e.speculation
        out.speculation.CopyFrom(
            pb.Speculation(
                method=sp.method,
                draft_tokens=sp.proposed_tokens,
                accepted_tokens=sp.accepted_tokens,
                drafts=sp.verified_steps,
            )
        )
        out.expert_tokens.extend(e.expert_tokens_recent)
        out.expert_window_s, out.expert_ranks = e.expert_window_s, e.expert_ranks
        t = e.host_tier
        out.prefix_reuse.CopyFrom(
            pb.PrefixReuse(
                device_tokens=e.prefix_hit_tokens,
                host_tokens=e.tier_hit_tokens,
                import_held_tokens=e.import_held_tokens,
                import_moved_tokens=e.import_moved_tokens,
                host_capacity_blocks=t.capacity_blocks,
                host_held_blocks=t.held_blocks,
                host_saved_blocks=t.saved,
                host_reloaded_blocks=t.reloaded,
                host_dropped_blocks=t.dropped,
                host_corrupt_blocks=t.corrupt,
                pulled_tokens=e.prefix_pulled_tokens,
                lent_tokens=e.prefix_lent_tokens,
            )
        )
    if isinstance(s, PrefillStats):
        out.kv_exports_held = len(s.exports)
        out.prefix_reuse.pulls, out.prefix_reuse.pull_failures = s.prefix_pulls, s.prefix_pull_failures
    if isinstance(s, DecodeStats):
        out.waiting_for_blocks, out.pulling = s.num_waiting_for_blocks, s.num_pulling
    return out
