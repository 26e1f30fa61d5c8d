"""Fuzzing both front doors with hypothesis: generated and malformed ``Generate``
requests (structured protobuf with extreme values, invalid UTF-8, huge stop
lists, token ids out of range, and raw bytes) on the real gRPC server, random
JSON and raw bodies on the real OpenAI HTTP server, while a client keeps sending
good requests. Every response is a valid result or ``INVALID_ARGUMENT`` / 400
with a sentence; the good requests all get their exact outputs; the servers
answer normally afterwards.

The router runs over fake workers (``tests.unit.router.fakes``: the part under test is the
front doors, not the workers). ``SPLITSERVE_FUZZ_EXAMPLES`` sets the number of
examples per test (CI: 150; the issue's 10,000-request run: 2,500 per test)."""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.client import Client
from splitserve.proto import splitserve_pb2 as pb
from splitserve.proto import splitserve_pb2_grpc as pb_grpc
from splitserve.router.dispatch import Dispatcher
from splitserve.router.openai import schema as api_schema
from splitserve.router.openai.server import OpenAIServer
from splitserve.router.registry import WorkerRegistry
from splitserve.router.server import RouterServer
from tests.unit.router.fakes import VALIDATOR, FakeDecode, FakePrefill, expected_tokens
from tests.unit.router.test_server import _Loop
from tests.waiting import wait_until

EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples on every run (CI), however many
    database=None,  # nothing written into the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
VOCAB = 1000  # the fakes' validator


class Doors:
    """The real gRPC and HTTP servers over one dispatcher, and a client sending good
    requests all along (``good_failures`` collects anything wrong with them)."""

    def __init__(self):
        self.loop = _Loop()
        registry = WorkerRegistry()

        async def setup():
            for role, fake in (("prefill", FakePrefill("p0")), ("decode", FakeDecode("d0"))):
                registry.add(fake.worker_id, role, fake, 16)
                await registry.activate(fake.worker_id)

        self.loop.run(setup())
        self.dispatcher = Dispatcher(registry, VALIDATOR, "tiny")
        self.grpc = RouterServer(self.dispatcher, "disaggregated", "127.0.0.1", 0)
        self.loop.run(self.grpc.start())
        self.http = OpenAIServer(self.dispatcher, "127.0.0.1", 0)
        self.loop.run(self.http.start())
        self.base = f"http://127.0.0.1:{self.http.port}"
        self.channel = grpc.insecure_channel(self.grpc.address)
        self.stub = pb_grpc.SplitserveStub(self.channel)
        self.good_sent, self.good_failures = 0, []
        self._stop = threading.Event()
        self._good = threading.Thread(target=self._send_good)
        self._good.start()

    def _send_good(self) -> None:
        with Client(self.grpc.address, retries=0, timeout=60) as c:
            i = 0
            while not self._stop.is_set():
                i += 1
                prompt = [1 + (i * 7 + j) % (VOCAB - 1) for j in range(1 + i % 50)]
                try:
                    out = c.generate(prompt, temperature=0, max_tokens=1 + i % 12)
                    if out.token_ids != expected_tokens(prompt, 1 + i % 12):
                        self.good_failures.append(f"request {i}: wrong tokens")
                except Exception as e:  # any failure of a good request is a finding
                    self.good_failures.append(f"request {i}: {e!r}")
                self.good_sent += 1

    def stop_good(self) -> None:
        self._stop.set()
        self._good.join(60)

    def close(self) -> None:
        self.stop_good()
        self.channel.close()
        self.loop.run(self.http.stop())
        self.loop.run(self.grpc.stop(0))
        self.loop.close()


@pytest.fixture(scope="module")
def doors():
    d = Doors()
    yield d
    d.close()
    assert d.good_sent > 0 and d.good_failures == []


# ---- gRPC ----------------------------------------------------------------------------
u32 = st.integers(0, 2**32 - 1)
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
texts = st.text(max_size=64)  # any unicode, lone surrogates excluded (protobuf cannot hold them)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(model=draw(st.sampled_from(["", "tiny", "other"]) | texts))
    kind = draw(st.sampled_from(["prompt", "token_ids", "messages", "none"]))
    if kind == "prompt":
        req.prompt = draw(st.text(max_size=300))
    elif kind == "token_ids":
        ids = draw(st.lists(st.integers(0, VOCAB + 5) | u32, max_size=400))
        req.token_ids.ids.extend(ids)
    elif kind == "messages":
        for _ in range(draw(st.integers(0, 3))):
            req.messages.messages.add(
                role=draw(st.sampled_from(["user", "system"]) | texts), content=draw(texts)
            )
    sp = req.sampling
    if draw(st.booleans()):
        sp.max_tokens = draw(st.integers(0, 20) | u32)
    if draw(st.booleans()):
        sp.temperature = draw(floats)
    if draw(st.booleans()):
        sp.top_k = draw(u32)
    if draw(st.booleans()):
        sp.top_p = draw(floats)
    if draw(st.booleans()):
        sp.seed = draw(st.integers(0, 2**64 - 1))
    sp.stop.extend(
        draw(st.lists(texts, max_size=3) | st.lists(st.just("x" * 100), min_size=1000, max_size=1000))
    )
    sp.stop_token_ids.extend(draw(st.lists(u32, max_size=5)))
    sp.ignore_eos, sp.logprobs = draw(st.booleans()), draw(st.booleans())
    req.request_id = draw(st.just("") | texts)
    if draw(st.booleans()):
        req.timeout_ms = draw(u32)
    return req


def check_generate(doors: Doors, data: bytes) -> str:
    """Send raw request bytes to Generate; the answer is a whole valid stream ("ok"), or
    INVALID_ARGUMENT with a sentence ("invalid"; NOT_FOUND for a model it does not serve)."""
    call = doors.channel.unary_stream(
        "/splitserve.v1.Splitserve/Generate",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    responses = []
    try:
        for resp in call(data, timeout=60):
            responses.append(resp)
    except grpc.RpcError as e:
        unknown = e.code() == grpc.StatusCode.NOT_FOUND and e.details().startswith("unknown model")
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT or unknown, (e.code(), e.details())
        assert len(e.details()) > 10 and not responses, e.details()
        return "invalid"
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds.count("final") == 1 and kinds[-1] == "final", kinds
    sent = sum(len(r.token.token_ids) for r in responses[:-1])
    assert responses[-1].final.usage.completion_tokens == sent
    return "ok"


@FUZZ
@given(request=generate_requests())
def test_grpc_generate_with_generated_requests(doors, request):
    check_generate(doors, request.SerializeToString())


@FUZZ
@given(data=st.binary(max_size=512))
def test_grpc_generate_with_raw_bytes(doors, data):
    check_generate(doors, data)


def test_grpc_invalid_utf8_in_a_string_field_is_invalid_argument(doors):
    broken = pb.GenerateRequest(prompt="ab").SerializeToString().replace(b"ab", b"\xff\xfe")
    call = doors.channel.unary_stream("/splitserve.v1.Splitserve/Generate", request_serializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as e:
        list(call(broken, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid splitserve.v1.GenerateRequest" in e.value.details()


# ---- HTTP ----------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(texts, inner, max_size=5),
    max_leaves=20,
)
# every field OpenAI or vLLM defines (router.openai.schema), the tokenize endpoints' and two unknown
FIELD_NAMES = sorted({f.name for f in api_schema.FIELDS} | {"tokens", "temprature", "frobnicate"})
fields = st.sampled_from(FIELD_NAMES)
plausible = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.lists(st.integers(-5, VOCAB + 5), max_size=50) | texts,
        "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": texts}), max_size=2),
        "max_tokens": st.integers(-3, 30) | st.integers(-(2**40), 2**40),
        "temperature": st.floats(allow_nan=True, allow_infinity=True) | st.none(),
        "stream": st.booleans(),
        "stop": texts | st.lists(texts, max_size=4),
        "n": st.integers(-1, 3),
    },
)
bodies = (
    st.dictionaries(fields, json_values, max_size=8).map(lambda d: json.dumps(d).encode())
    | plausible.map(lambda d: json.dumps(d).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=300)
)


def post(doors: Doors, path: str, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(doors.base + path, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@FUZZ
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]), body=bodies
)
def test_http_with_random_bodies(doors, path, body):
    status, raw = post(doors, path, body)
    if status == 400 or (status == 404 and b"unknown model" in raw):
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and len(error["message"]) > 10, error
        return
    assert status == 200, (status, raw[:300])
    if raw.startswith(b"data:"):  # a stream: events, then [DONE]
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    elif path.startswith("/v1"):
        assert json.loads(raw)["choices"], raw[:300]
    else:
        assert set(json.loads(raw)) in ({"tokens", "count", "max_model_len"}, {"prompt"}), raw[:300]


def test_the_doors_still_serve_after_the_fuzzing(doors):
    doors.stop_good()
    with Client(doors.grpc.address, retries=0, timeout=30) as c:
        assert c.generate([5, 6, 7], temperature=0, max_tokens=4).token_ids == expected_tokens([5, 6, 7], 4)
    status, raw = post(doors, "/v1/completions", json.dumps({"prompt": [5, 6, 7], "max_tokens": 4}).encode())
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4
    # the fuzzed requests' ends are being recorded
    wait_until(lambda: doors.dispatcher.num_inflight == 0, "every fuzzed request ended", 30, 0.05)
