"""The router's gRPC server without workers (no Ray): TLS, health, the SDK's
unary calls, and a clear UNAVAILABLE when no worker can take a request."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading

import grpc
import pytest

from splitserve.client import Client, InvalidArgument, NotFound, Unavailable
from splitserve.client.errors import FailedPrecondition, ServerError
from splitserve.router.dispatch import Dispatcher
from splitserve.router.registry import WorkerRegistry
from splitserve.router.server import RouterServer
from splitserve.wire.errors import PreconditionFailed
from splitserve.wire.validation import RequestValidator
from tests.unit.router.fakes import FakeDecode, FakePrefill, expected_tokens
from tests.waiting import wait_until


class _Loop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _server(
    credentials=None, api_keys=None, stats_interval_s: float = 0.5, upgrade=None
) -> tuple[_Loop, RouterServer]:
    validator = RequestValidator("tiny", vocab_size=100, max_model_len=64, max_kv_tokens=1024, tokenizer=None)
    dispatcher = Dispatcher(WorkerRegistry(), validator, served_model="tiny")
    loop = _Loop()
    server = RouterServer(
        dispatcher,
        "disaggregated",
        "127.0.0.1",
        0,
        stats_interval_s=stats_interval_s,
        credentials=credentials,
        api_keys=api_keys,
        upgrade=upgrade,
    )
    loop.run(server.start())
    return loop, server


@pytest.fixture()
def plain():
    loop, server = _server()
    yield server
    loop.run(server.stop(0))
    loop.close()


def test_unary_calls_and_errors_without_workers(plain):
    with Client(plain.address, retries=0, timeout=10) as c:
        assert not c.health()  # no pool has a routable worker
        (model,) = c.list_models()
        assert (model.id, model.max_model_len, model.vocab_size) == ("tiny", 64, 100)
        with pytest.raises(InvalidArgument, match="tokenizer"):
            c.tokenize("hello")
        with pytest.raises(InvalidArgument, match="tokenizer"):
            c.detokenize([1, 2])
        with pytest.raises(InvalidArgument, match=r"token ids must be integers in \[0, 100\)"):
            c.detokenize([1, 100])
        with pytest.raises(NotFound, match="unknown model 'other'; this server serves 'tiny'"):
            c.detokenize([1], model="other")
        with pytest.raises(InvalidArgument, match="context"):
            c.generate(list(range(70)))
        with pytest.raises(Unavailable, match="no decode worker"):
            c.generate([1, 2, 3], temperature=0, max_tokens=2)
        assert c.cluster_status().inflight_requests == 0


async def _call(fn, *args):
    return fn(*args)


def test_health_follows_the_pools_and_turns_not_serving_on_stop():
    """SERVING once a decode worker is routable (it prefills while no prefill worker
    is), NOT_SERVING while none is, and from the moment the server stops (before it
    drains)."""
    loop, server = _server(stats_interval_s=0.05)
    registry = server.dispatcher.registry
    with Client(server.address, retries=0) as c:
        assert not c.health()
        fake = FakePrefill("p0")
        registry.add(fake.worker_id, "prefill", fake, 16)
        loop.run(registry.activate(fake.worker_id))
        assert not c.health()  # a prefill worker alone cannot serve
        fake = FakeDecode("d0")
        registry.add(fake.worker_id, "decode", fake, 16)
        loop.run(registry.activate(fake.worker_id))
        wait_until(c.health, "health did not turn SERVING with a decode worker routable")
        loop.run(_call(registry.remove, "p0"))
        assert c.health()  # the decode worker prefills now
        loop.run(_call(registry.remove, "d0"))  # on the loop that owns the registry
        wait_until(lambda: not c.health(), "health stayed SERVING with no decode worker")
        fake = FakeDecode("d1")
        registry.add(fake.worker_id, "decode", fake, 16)
        loop.run(registry.activate(fake.worker_id))
        wait_until(c.health, "health did not come back with a decode worker")
        loop.run(server.stop(0))
        assert not c.health()
    loop.close()


def self_signed(tmp_path) -> tuple:
    """A key and certificate for localhost (skips the test without openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


def test_tls(tmp_path):
    key, cert = self_signed(tmp_path)
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    loop, server = _server(creds)
    try:
        with Client(server.address, root_certificates=cert.read_bytes(), retries=0, timeout=10) as c:
            assert c.list_models()[0].id == "tiny"
        with Client(server.address, retries=0, timeout=3) as insecure, pytest.raises(Unavailable):
            insecure.list_models()
    finally:
        loop.run(server.stop(0))
        loop.close()


def test_openai_http_errors_without_workers():
    import json
    import urllib.error
    import urllib.request

    from splitserve.router.openai.server import OpenAIServer

    loop, server = _server()
    http = OpenAIServer(server.dispatcher, "127.0.0.1", 0)
    loop.run(http.start())
    base = f"http://127.0.0.1:{http.port}"

    def post(path, body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(base + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
            assert json.loads(r.read())["data"][0]["id"] == "tiny"
        cases = [
            ("/v1/completions", b"{not json", 400, "not valid JSON"),
            ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
            ("/v1/completions", {"prompt": [1, 2], "best_of": 2}, 400, "`best_of`"),
            ("/v1/completions", {"prompt": [1, 2], "frequency_penalty": 5}, 400, "frequency_penalty"),
            ("/v1/completions", {"prompt": [1, 2], "suffix": "x"}, 400, "`suffix`"),
            ("/v1/completions", {"prompt": [1, 2], "model": "other"}, 404, "unknown model"),
            ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2}, 503, "no decode worker"),
            ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stream": True}, 503, "no decode worker"),
        ]
        for path, body, status, needle in cases:
            got, payload = post(path, body)
            assert got == status and needle in payload["error"]["message"], (body, got, payload)
    finally:
        loop.run(http.stop())
        loop.run(server.stop(0))
        loop.close()


def test_status_names_each_workers_node_or_says_it_waits_for_one_and_lists_given_up_workers():
    from splitserve.router.registry import NodePlacement

    loop, server = _server()
    registry = server.dispatcher.registry
    try:
        registry.add("prefill-0", "prefill", FakePrefill("prefill-0"), 16)
        registry.add("decode-0", "decode", FakeDecode("decode-0"), 16)
        registry.placed("decode-0", NodePlacement("n-decode", "splitserve_decode"))
        registry.add("prefill-1", "prefill", FakePrefill("prefill-1"), 16)
        registry.give_up("prefill-1", "prefill", "Ray cannot place prefill-1: it needs splitserve_prefill")
        with Client(server.address, retries=0, timeout=10) as c:
            status = c.cluster_status()
        shown = {w.worker_id: w for p in status.pools for w in p.workers}
        assert set(shown) == {"prefill-0", "decode-0"}  # a given-up worker is no member
        (gone,) = status.given_up
        assert (gone.worker_id, gone.role) == ("prefill-1", "prefill") and "splitserve_prefill" in gone.reason
        assert (shown["prefill-0"].waiting_for_node, shown["prefill-0"].node_id) == (True, "")
        decode = shown["decode-0"]
        assert (decode.waiting_for_node, decode.node_id, decode.node_type) == (
            False,
            "n-decode",
            "splitserve_decode",
        )
    finally:
        loop.run(server.stop(0))
        loop.close()


def _cancelled_at_start(task):
    """What a start looks like when grpc.aio cancels it under the caller: the decode
    worker's token stream broke and the inbox closed the channel with the call in flight."""
    raise asyncio.CancelledError()


@pytest.mark.parametrize("healthy_beside", [True, False])
def test_a_start_cancelled_under_a_request_resumes_it_or_ends_it_with_a_status(healthy_beside):
    """Nobody cancelled the request: a ``CancelledError`` from its decode worker's start
    is that worker lost. Beside a healthy worker the request resumes there and completes;
    alone it ends UNAVAILABLE. Either way the call ends well before the client's own
    deadline (before the fix, it stayed open until then)."""
    loop, server = _server()
    registry = server.dispatcher.registry
    fakes = [FakeDecode("d0", fail=_cancelled_at_start)] + ([FakeDecode("d1")] if healthy_beside else [])
    try:
        for fake in fakes:
            registry.add(fake.worker_id, "decode", fake, 16)
            loop.run(registry.activate(fake.worker_id))
        with Client(server.address, retries=0, timeout=60) as c:
            if healthy_beside:
                out = c.generate([1, 2, 3], max_tokens=6, temperature=0)
                assert out.token_ids == expected_tokens([1, 2, 3], 6) and out.final.decode_worker == "d1"
            else:
                with pytest.raises(Unavailable, match="decode worker d0"):
                    c.generate([1, 2, 3], max_tokens=6, temperature=0)
        assert len(fakes[0].calls) == 1
    finally:
        loop.run(server.stop(0))
        loop.close()


def test_an_error_raised_inside_an_rpc_reaches_the_client_as_its_own_status_and_sentence():
    raised: list[BaseException] = []

    async def upgrade(config_yaml: str, model: str, pace: int):
        raise raised[-1]

    loop, server = _server(upgrade=upgrade)
    try:
        with Client(server.address, retries=0, timeout=60) as c:
            raised.append(PreconditionFailed("no room for a decode worker: it needs {CPU: 1}, 0 free"))
            with pytest.raises(FailedPrecondition, match=r"no room for a decode worker: it needs \{CPU: 1\}"):
                c.upgrade("pools: {}")
            raised.append(RuntimeError("Ray cannot place prefill-1: it needs 1 x {CPU: 1.0} on one node"))
            with pytest.raises(ServerError, match=r"RuntimeError\): Ray cannot place prefill-1"):
                c.upgrade("pools: {}")
            raised.append(asyncio.CancelledError())  # a stray one: still a status, never an open call
            with pytest.raises(Unavailable, match="cut off"):
                c.upgrade("pools: {}")
    finally:
        loop.run(server.stop(0))
        loop.close()


def test_draining_the_only_decode_worker_is_refused_at_once_and_changes_nothing():
    loop, server = _server()
    registry = server.dispatcher.registry
    try:
        for wid in ("d0", "d1"):
            registry.add(wid, "decode", FakeDecode(wid), 16)
        loop.run(registry.activate("d0"))
        with Client(server.address, retries=0, timeout=60) as c:
            with pytest.raises(FailedPrecondition, match="d0 is the only routable decode worker"):
                c.drain("d0", timeout_s=30)
            assert registry.get("d0").routable  # not drained
            loop.run(registry.activate("d1"))
            drained = c.drain("d0", timeout_s=30)  # d1 serves on: d0 drains, nothing to move
            assert (drained.moved, drained.left) == (0, 0) and not registry.get("d0").routable
    finally:
        loop.run(server.stop(0))
        loop.close()
