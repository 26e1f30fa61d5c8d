"""Generated gRPC requests through a real engine: the real gRPC server and
dispatcher in front of a real colocated ``DecodeWorker`` running SmolLM2 in this
process (``InProcessDecodeClient``, no Ray). Two kinds of example: the front
doors' own (``tests.unit.router.test_fuzz_front_doors``: malformed protobuf,
mostly refused at the door) and ``runnable_requests`` (a real prompt, few tokens,
every sampling field set or not, at its extremes or plausible, with structured
outputs, logprobs, bias, allowed tokens, bad words and ``n``: mostly run by the
engine). Properties: every answer is a whole valid stream or ``INVALID_ARGUMENT``
with a sentence; the worker's engine loop never stops (no worker restart); a
greedy request afterwards equals the engine's own output.

``SPLITSERVE_FUZZ_REAL_EXAMPLES`` sets the number of examples (CI: 60; the
issue's run: 10,000, quoted in its note)."""

from __future__ import annotations

import collections
import os

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.client import Client
from splitserve.decode_worker.in_process import InProcessDecodeClient
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.engine.engine import Engine
from splitserve.proto import splitserve_pb2 as pb
from splitserve.proto import splitserve_pb2_grpc as pb_grpc
from splitserve.router.dispatch import Dispatcher
from splitserve.router.registry import WorkerRegistry
from splitserve.router.server import RouterServer
from splitserve.wire.config import EngineConfig
from splitserve.wire.decode import DecodeWorkerSpec
from tests.unit.router.test_fuzz_front_doors import FUZZ as FRONT_DOOR_FUZZ
from tests.unit.router.test_fuzz_front_doors import generate_requests
from tests.unit.router.test_server import _Loop

pytestmark = [pytest.mark.slow, pytest.mark.needs_smollm2]

EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_REAL_EXAMPLES", "60"))
FUZZ = settings(FRONT_DOOR_FUZZ, max_examples=EXAMPLES)  # the front doors' settings, more or fewer
OUTCOMES: collections.Counter[str] = collections.Counter()  # what the examples above got
# a context of 512 tokens: a chat that leaves max_tokens unset gets the rest of it (vLLM's
# default), which must end well within a call's deadline on a loaded 2-core machine
ENGINE = EngineConfig(
    model="smollm2", dtype="float32", kv_cache_memory_mib=128, max_num_batched_tokens=512, max_model_len=512
)


VOCAB = 49152  # SmolLM2's
u32 = st.integers(0, 2**32 - 1)
# each float field: plausible values, or 0, the smallest and largest float32s, NaN and infinities
EXTREME_FLOATS = st.sampled_from([0.0, 1e-45, 1e-30, 3.4028234e38, -3.4028234e38, float("nan")])
EXTREME_FLOATS |= st.sampled_from([float("inf"), float("-inf")])


def _rarely(extreme, plausible):
    """``plausible`` 9 times in 10, else ``extreme`` (so that most requests run)."""
    return st.integers(0, 9).flatmap(lambda k: extreme if k == 0 else plausible)


def _float(low: float, high: float):
    return _rarely(EXTREME_FLOATS, st.floats(low, high, width=32))


STRUCTURED = [
    ("json_schema", '{"type": "object"}'),
    ("json_schema", '{"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}'),
    ("regex", "[a-z]+"),
    ("regex", "[0-9]{2,4}"),
    ("choice", '["yes", "no"]'),
    ("grammar", 'start: "a" | "b" "c"'),
]


@st.composite
def runnable_requests(draw) -> pb.GenerateRequest:
    """A real question with any sampling fields: most of them run through the engine."""
    req = pb.GenerateRequest()
    req.messages.messages.add(role="user", content=draw(st.sampled_from(["Hi!", "Name a color.", "Count."])))
    sp = req.sampling
    sp.max_tokens = draw(_rarely(st.sampled_from([0, 2**32 - 1]), st.integers(1, 6)))
    for name, low, high in (
        ("temperature", 0.0, 3.0),
        ("top_p", 0.25, 1.0),
        ("min_p", 0.0, 1.0),
        ("repetition_penalty", 0.5, 2.0),
        ("frequency_penalty", -2.0, 2.0),
        ("presence_penalty", -2.0, 2.0),
    ):
        if draw(st.booleans()):
            setattr(sp, name, draw(_float(low, high)))
    if draw(st.booleans()):
        sp.top_k = draw(_rarely(st.sampled_from([VOCAB, 2**32 - 1]), st.integers(0, 50)))
    if draw(st.booleans()):
        sp.seed = draw(st.integers(0, 10) | st.just(2**64 - 1))
    sp.logprobs = draw(st.booleans())
    if sp.logprobs and draw(st.booleans()):
        sp.top_logprobs = draw(_rarely(st.just(2**32 - 1), st.integers(0, 20)))
    sp.n = draw(_rarely(st.just(2**32 - 1), st.sampled_from([0, 1, 2, 3])))
    sp.min_tokens = draw(_rarely(st.just(2**32 - 1), st.sampled_from([0, 0, 2])))
    sp.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        for token in draw(st.lists(_rarely(st.just(VOCAB), st.integers(0, VOCAB - 1)), max_size=3)):
            sp.logit_bias[token] = draw(_float(-100.0, 100.0))
    if draw(st.integers(0, 4)) == 0:
        sp.allowed_token_ids.extend(draw(st.lists(st.integers(0, VOCAB + 5), min_size=1, max_size=4)))
    if draw(st.integers(0, 4)) == 0:
        sp.bad_words.extend(draw(st.lists(st.sampled_from(["the", "a", "{", "1", "yes"]), max_size=2)))
    sp.stop.extend(draw(st.lists(st.sampled_from(["\n", ".", "e", "}"]), max_size=2)))
    if draw(st.booleans()):
        kind, spec = draw(st.sampled_from(STRUCTURED))
        sp.structured.kind, sp.structured.spec = kind, spec
    return req


class RealDoor:
    """The gRPC front door over one real colocated worker, in this process."""

    def __init__(self):
        self.worker = DecodeWorker(DecodeWorkerSpec("colocated-0", ENGINE, None, 10.0, 8))
        self.loop = _Loop()
        registry = WorkerRegistry()
        self.client = client = InProcessDecodeClient(self.worker)

        async def setup():
            registry.add("colocated-0", "colocated", client, ENGINE.block_size)
            await registry.activate("colocated-0")

        self.loop.run(setup())
        validator = self.worker.engine.validator
        self.dispatcher = Dispatcher(registry, validator, validator.model, colocated=True)
        self.server = RouterServer(self.dispatcher, "colocated", "127.0.0.1", 0)
        self.loop.run(self.server.start())
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = pb_grpc.SplitserveStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.loop.run(self.server.stop(0.5))
        self.loop.run(self.client.close())
        self.loop.close()
        self.worker.shutdown()


@pytest.fixture(scope="module")
def door():
    d = RealDoor()
    yield d
    d.close()


@FUZZ
@given(request=generate_requests() | runnable_requests())
def test_generated_requests_through_a_real_engine_fail_only_themselves(door, request):
    OUTCOMES[check(door, request)] += 1
    assert door.worker.loop.error is None, "the engine loop stopped"


def check(door: RealDoor, request: pb.GenerateRequest) -> str:
    """Send ``request``; the answer is whole valid streams of its ``n`` sequences ("ok"),
    or ``INVALID_ARGUMENT`` with a sentence ("invalid": at once, or after some tokens
    when the request's own constraints left no token to sample; ``NOT_FOUND`` for a model
    it does not serve), or, for a request
    that set its own ``timeout_ms``, ``DEADLINE_EXCEEDED`` with a sentence."""
    responses = []
    try:
        for resp in door.stub.Generate(request, timeout=600):
            responses.append(resp)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and request.timeout_ms:
            assert len(e.details()) > 10, e.details()  # it asked for so short a deadline
            return "deadline"
        unknown = e.code() == grpc.StatusCode.NOT_FOUND and e.details().startswith("unknown model")
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT or unknown, (e.code(), e.details())
        assert len(e.details()) > 10 and (not responses or "no token can be sampled" in e.details())
        return "invalid"
    n = max(1, request.sampling.n)
    finals = {r.final.index: r.final for r in responses if r.WhichOneof("kind") == "final"}
    assert sorted(finals) == list(range(n)) and responses[-1].WhichOneof("kind") == "final"
    for i, final in finals.items():
        sent = sum(
            len(r.token.token_ids)
            for r in responses
            if r.WhichOneof("kind") == "token" and r.token.index == i
        )
        assert final.usage.completion_tokens == sent
    return "ok"


def test_the_engine_serves_on_unchanged_after_the_fuzz(door):
    """After every generated request above (some ran, some were refused): a greedy
    request equals the engine's own."""
    print(f"generated requests: {dict(OUTCOMES)}")
    assert OUTCOMES["ok"] and OUTCOMES["invalid"], OUTCOMES
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reference = Engine(ENGINE)
    want = reference.generate([reference.tokenizer.apply_chat_template(messages)], None)[0]
    with Client(door.server.address, timeout=120) as c:
        got = c.generate(messages=messages, max_tokens=16, temperature=0)
    assert got.token_ids == want.token_ids[:16] and door.worker.loop.error is None
