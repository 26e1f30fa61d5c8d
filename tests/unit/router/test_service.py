"""gRPC parity: the proto carries every sampling field the HTTP front door honours,
and the same request through either door becomes the same ``SamplingParams`` and the
same set of fields left to the server's defaults."""

from __future__ import annotations

import pytest

from splitserve.client import InvalidArgument
from splitserve.client.types import build_request
from splitserve.proto import splitserve_pb2 as pb
from splitserve.router.openai_requests import CompletionRequest
from splitserve.router.service import generate_input

FIELDS = dict(
    max_tokens=9,
    temperature=0.5,
    top_k=4,
    top_p=0.75,
    seed=3,
    stop=["zz"],
    stop_token_ids=[3, 4],
    ignore_eos=True,
    min_p=0.25,
    repetition_penalty=1.5,
    frequency_penalty=0.5,
    presence_penalty=-0.5,
    logit_bias={12: 3.0, 7: -100.0},
    min_tokens=2,
    allowed_token_ids=[1, 2, 3],
    include_stop_str_in_output=True,
    skip_special_tokens=False,
    bad_words=["nope"],
)
STRUCTURED = ("json_schema", '{"type": "object"}')


def test_the_same_request_through_either_door_samples_the_same():
    request = build_request([5, 6], None, logprobs=True, top_logprobs=3, structured=STRUCTURED, **FIELDS)
    grpc_in = generate_input(request, None)
    http = CompletionRequest(prompt=[5, 6], logprobs=3, response_format={"type": "json_object"}, **FIELDS)
    assert grpc_in.params == http.params()
    assert grpc_in.unset == http.unset() == frozenset()
    bare_grpc = generate_input(build_request([5, 6], None), None)
    bare_http = CompletionRequest(prompt=[5, 6])
    assert bare_grpc.params == bare_http.params() and bare_grpc.unset == bare_http.unset()


def test_the_sdk_refuses_a_value_the_proto_cannot_hold():
    with pytest.raises(InvalidArgument, match="min_tokens"):
        build_request([1], None, min_tokens=-1)
    with pytest.raises(InvalidArgument, match="token ids"):
        build_request([1], None, allowed_token_ids=[-3])
    assert isinstance(build_request([1], None), pb.GenerateRequest)
