"""The SDK over several routers: ``Client([a, b])`` sends calls round-robin to the
routers that are up, and a call that one router refuses with ``UNAVAILABLE`` before
its first response is retried on the other. The routers here are real gRPC servers
that stream a few tokens and count the calls they got (this tests the SDK)."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from splitserve.client import Client
from splitserve.client.client import channel_target
from splitserve.proto import splitserve_pb2 as pb
from splitserve.proto import splitserve_pb2_grpc as pb_grpc


class Router(pb_grpc.SplitserveServicer):
    def __init__(self, up: bool = True):
        self.up, self.calls = up, 0

    def Generate(self, request, context):
        self.calls += 1
        if not self.up:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this router is going away")
        for i in range(request.sampling.max_tokens):
            yield pb.GenerateResponse(request_id=request.request_id, token=pb.Token(token_ids=[i], text="x"))
        final = pb.Final(finish_reason=pb.FINISH_REASON_LENGTH)
        yield pb.GenerateResponse(request_id=request.request_id, final=final)


@pytest.fixture
def routers():
    made = []
    for _ in range(2):
        router, server = Router(), grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_SplitserveServicer_to_server(router, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        made.append((router, server, f"127.0.0.1:{port}"))
    yield made
    for _, server, _ in made:
        server.stop(None)


def test_calls_go_round_robin_over_the_routers(routers):
    with Client([address for *_, address in routers], timeout=30) as c:
        for _ in range(10):
            assert c.generate([1, 2], max_tokens=3, temperature=0).token_ids == [0, 1, 2]
    calls = [router.calls for router, *_ in routers]
    assert sum(calls) == 10 and min(calls) >= 3, calls


def test_a_call_one_router_refuses_before_any_token_is_retried_on_the_other(routers):
    (down, *_), (up, *_) = routers
    down.up = False
    with Client([address for *_, address in routers], timeout=30, retries=3, backoff_s=0.05) as c:
        for _ in range(6):
            assert c.generate([1, 2], max_tokens=3, temperature=0).token_ids == [0, 1, 2]
    assert up.calls == 6 and down.calls >= 1


def test_targets_resolve_to_one_static_list():
    assert channel_target("dns:///routers:50051") == "dns:///routers:50051"
    assert channel_target(["127.0.0.1:1", "localhost:2"]) == "ipv4:127.0.0.1:1,127.0.0.1:2"
    with pytest.raises(ValueError, match="host:port"):
        channel_target(["127.0.0.1"])
