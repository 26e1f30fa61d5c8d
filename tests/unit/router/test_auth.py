"""API keys on both front doors (``router.auth``), on the real gRPC and HTTP servers
without workers (no Ray): refused calls end with UNAUTHENTICATED / 401 and a
sentence before the router does any work; health stays open; keys rotate
without a restart; no key reaches a log or the status; HTTPS."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client import Client, Unauthenticated, Unavailable
from splitserve.router.auth import ApiKeys, bearer_token, read_keys
from splitserve.router.openai.server import OpenAIServer, server_ssl_context
from tests.unit.router.test_server import _server, self_signed
from tests.waiting import wait_until

KEY, OTHER = "sk-test-4f9a1c", "sk-test-other-77"


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)


def keys_file(tmp_path, *lines: str):
    path = tmp_path / "keys"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def test_the_keys_file(tmp_path):
    keys = ApiKeys(keys_file(tmp_path, "# ops team", "", f"  {KEY}  ", OTHER))
    assert len(keys) == 2
    assert keys.check(KEY) and keys.check(OTHER)
    for bad in (None, "", KEY[:-1], KEY + "x", "# ops team", KEY.upper()):
        assert not keys.check(bad)
    with pytest.raises(ValueError, match="cannot read the API keys file"):
        read_keys(tmp_path / "missing")
    with pytest.raises(ValueError, match="holds no key"):
        read_keys(keys_file(tmp_path, "# nothing yet", ""))


def test_bearer_token_parsing():
    assert bearer_token(f"Bearer {KEY}") == KEY
    assert bearer_token(f"bearer  {KEY} ") == KEY
    for value in (None, "", KEY, f"Basic {KEY}", "Bearer", "Bearer "):
        assert bearer_token(value) is None


def test_reload_takes_a_changed_file_and_keeps_the_keys_when_it_cannot_read_it(tmp_path):
    path = keys_file(tmp_path, KEY)
    keys = ApiKeys(path)
    path.write_text(f"{OTHER}\n")
    keys.reload_if_changed()
    assert keys.check(OTHER) and not keys.check(KEY)
    path.unlink()
    assert not keys.reload()  # unreadable: the keys in use stay
    assert keys.check(OTHER)
    path.write_text("# revoked everyone\n")
    assert keys.reload()  # a file with no key locks everyone out, as it says
    assert not keys.check(OTHER)


def test_grpc_refuses_a_call_without_a_valid_key_before_any_work(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    loop, server = _server(api_keys=ApiKeys(keys_file(tmp_path, KEY)))
    try:
        with Client(server.address, retries=0, timeout=10) as anonymous:
            # health checking stays open: an answer (NOT_SERVING: no workers), not UNAUTHENTICATED
            stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))
            answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(Unauthenticated, match="requires an API key"):
                anonymous.list_models()
            with pytest.raises(Unauthenticated, match="requires an API key"):
                anonymous.generate([1, 2, 3], temperature=0, max_tokens=2)
        with Client(server.address, retries=0, timeout=10, api_key=OTHER) as wrong:
            with pytest.raises(Unauthenticated, match="not valid"):
                wrong.generate([1, 2, 3], max_tokens=2)
            with pytest.raises(Unauthenticated, match="not valid"):
                wrong.cluster_status()
        # nothing was admitted, validated or traced for the refused calls
        assert server.dispatcher.admitted == 0 and server.dispatcher.traces.latest(10) == []

        with Client(server.address, retries=0, timeout=10, api_key=KEY) as good:
            assert good.list_models()[0].id == "tiny"
            with pytest.raises(Unavailable, match="no decode worker"):  # past the door, to dispatch
                good.generate([1, 2, 3], max_tokens=2)
            status = good.cluster_status(traces=5)
        assert server.dispatcher.admitted == 1
        assert KEY not in str(status) and OTHER not in str(status)
    finally:
        loop.run(server.stop(0))
        loop.close()
    assert KEY not in caplog.text and OTHER not in caplog.text


def test_the_sdk_reads_the_key_from_the_environment(tmp_path, monkeypatch):
    loop, server = _server(api_keys=ApiKeys(keys_file(tmp_path, KEY)))
    try:
        monkeypatch.setenv("SPLITSERVE_API_KEY", KEY)
        with Client(server.address, retries=0, timeout=10) as c:
            assert c.list_models()[0].id == "tiny"
    finally:
        loop.run(server.stop(0))
        loop.close()


def test_a_key_rotated_in_the_file_takes_effect_without_a_restart(tmp_path):
    path = keys_file(tmp_path, KEY)
    keys = ApiKeys(path, poll_s=0.05)
    loop, server = _server(api_keys=keys)
    watcher = asyncio.run_coroutine_threadsafe(keys.watch(), loop.loop)
    try:

        def accepted(key: str) -> bool:
            with Client(server.address, retries=0, timeout=10, api_key=key) as c:
                try:
                    c.list_models()
                    return True
                except Unauthenticated:
                    return False

        assert accepted(KEY) and not accepted(OTHER)
        path.write_text(f"{OTHER}\n")
        wait_until(lambda: accepted(OTHER), "the new key was never accepted", 30)
        assert not accepted(KEY)
    finally:
        watcher.cancel()
        loop.run(server.stop(0))
        loop.close()


def _http(url: str, key: str | None = None, context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=10, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_needs_the_key_on_v1_and_the_openai_client_works_with_it(tmp_path):
    openai = pytest.importorskip("openai")
    loop, server = _server()
    http = OpenAIServer(server.dispatcher, "127.0.0.1", 0, api_keys=ApiKeys(keys_file(tmp_path, KEY)))
    loop.run(http.start())
    base = f"http://127.0.0.1:{http.port}"
    try:
        assert _http(base + "/health")[0] == 503  # open (no 401), and no worker behind this router
        code, body = _http(base + "/v1/models")
        assert code == 401 and "requires an API key" in body["error"]["message"]
        code, body = _http(base + "/v1/models", key=OTHER)
        assert code == 401 and body["error"]["code"] == "invalid_api_key"
        assert _http(base + "/v1/models", key=KEY)[1]["data"][0]["id"] == "tiny"
        assert _http(base + "/version")[0] == 200
        for path in ("/tokenize", "/detokenize"):
            assert _http(base + path)[0] == 401

        refused = openai.OpenAI(base_url=base + "/v1", api_key=OTHER, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            refused.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2)
        assert server.dispatcher.admitted == 0
        allowed = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        assert [m.id for m in allowed.models.list()] == ["tiny"]
    finally:
        loop.run(http.stop())
        loop.run(server.stop(0))
        loop.close()


def test_https(tmp_path):
    key, cert = self_signed(tmp_path)
    loop, server = _server()
    context = server_ssl_context(str(cert), str(key))
    http = OpenAIServer(server.dispatcher, "127.0.0.1", 0, ssl_context=context)
    loop.run(http.start())
    try:
        trusting = ssl.create_default_context(cafile=str(cert))
        assert _http(f"https://127.0.0.1:{http.port}/version", context=trusting)[0] == 200
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # no plain HTTP on the port
            _http(f"http://127.0.0.1:{http.port}/health")
    finally:
        loop.run(http.stop())
        loop.run(server.stop(0))
        loop.close()
