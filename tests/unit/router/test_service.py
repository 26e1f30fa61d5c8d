"""gRPC parity: the proto carries every sampling field the HTTP front door honours,
and the same request through either door becomes the same ``SamplingParams`` and the
same set of fields left to the server's defaults."""

from __future__ import annotations

import pytest

from splitserve.client import InvalidArgument
from splitserve.client.types import build_request
from splitserve.proto import splitserve_pb2 as pb
from splitserve.router.openai.protocol import ChatRequest, CompletionRequest
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
    n=2,
)
STRUCTURED = ("json_schema", '{"type": "object"}')


def test_the_same_request_through_either_door_samples_the_same():
    request = build_request(
        [5, 6], None, logprobs=True, top_logprobs=3, prompt_logprobs=3, structured=STRUCTURED, **FIELDS
    )
    grpc_in, _ = generate_input(request, None)
    http = CompletionRequest(
        prompt=[5, 6], logprobs=3, echo=True, response_format={"type": "json_object"}, **FIELDS
    )
    assert grpc_in.params == http.params()
    assert grpc_in.unset == http.unset() == frozenset()
    bare_grpc, _ = generate_input(build_request([5, 6], None), None)
    bare_http = CompletionRequest(prompt=[5, 6])
    assert bare_grpc.params == bare_http.params() and bare_grpc.unset == bare_http.unset()


def test_the_sdk_refuses_a_value_the_proto_cannot_hold():
    with pytest.raises(InvalidArgument, match="min_tokens"):
        build_request([1], None, min_tokens=-1)
    with pytest.raises(InvalidArgument, match="token ids"):
        build_request([1], None, allowed_token_ids=[-3])
    assert isinstance(build_request([1], None), pb.GenerateRequest)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    "choice", [None, "none", "required", {"type": "function", "function": {"name": "f"}}]
)
def test_a_chat_with_tools_through_either_door_is_rendered_and_held_the_same(choice):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    options = dict(tools=TOOLS, tool_choice=choice, chat_template="{{ messages }}")
    options["chat_template_kwargs"] = {"enable_thinking": False}
    grpc_in, grpc_choice = generate_input(
        build_request(None, messages, parallel_tool_calls=False, **options), None
    )
    http = ChatRequest(messages=messages, parallel_tool_calls=False, **options)
    assert grpc_in.messages == http.template_messages()
    assert grpc_in.templating == http.templating()
    assert grpc_in.params == http.params() and grpc_choice == http.choice()
