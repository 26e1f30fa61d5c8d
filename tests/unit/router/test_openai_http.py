"""The OpenAI front door's request schema (``router.openai.schema``) on the real HTTP
server over fake workers: every refused field is a 400 naming it (its neutral
values pass), unknown fields are a 400 listing them unless ignored (then
counted), honoured fields reach the workers as sent, ``docs/api.md`` is the
table, and the endpoints beside the completions (tokenize, detokenize,
version, health)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import urllib.error
import urllib.request

import pytest

import tests.integration.test_cli_serve as cli_serve_tests
import tests.integration.test_cluster_serving as serving_tests
import tests.unit.engine.speculative.test_verification as speculative_tests
import tests.unit.engine.test_correctness as correctness_tests
import tests.unit.engine.test_engine as engine_tests
import tests.unit.engine.test_generation_defaults as defaults_tests
import tests.unit.engine.test_sampler as sampler_tests
import tests.unit.engine.test_smollm2 as smollm2_tests
import tests.unit.engine.test_structured as structured_tests
import tests.unit.engine.test_tokenizer as tokenizer_tests
import tests.unit.router.test_fuzz_front_doors as fuzz_tests
import tests.unit.router.test_server as server_tests
import tests.unit.router.test_tools as tools_tests
from splitserve.router.dispatch import Dispatcher
from splitserve.router.metrics import RouterMetrics
from splitserve.router.openai import schema as api_schema
from splitserve.router.openai.logprobs import LogprobsWriter
from splitserve.router.openai.protocol import ChatRequest, CompletionRequest
from splitserve.router.openai.schema import Endpoint, Status
from splitserve.router.openai.server import OpenAIServer
from splitserve.router.registry import WorkerRegistry
from splitserve.wire.sampling import SamplingParams, StructuredOutput
from tests.unit.router.fakes import VALIDATOR, FakeDecode, FakePrefill
from tests.unit.router.test_server import _Loop

ROOT = pathlib.Path(__file__).resolve().parents[3]
PATH = {Endpoint.CHAT: "/v1/chat/completions", Endpoint.COMPLETIONS: "/v1/completions"}
# a body each endpoint serves without a tokenizer (the fakes' validator has none); chat
# bodies get as far as encoding their messages, which proves the fields passed the schema
BASE = {
    Endpoint.CHAT: {"messages": [{"role": "user", "content": "hi"}]},
    Endpoint.COMPLETIONS: {"prompt": [5, 6]},
}
PASSED = {Endpoint.CHAT: (400, "no tokenizer"), Endpoint.COMPLETIONS: (200, "")}


class Door:
    """The HTTP server over a dispatcher with one fake prefill and one fake decode worker."""

    def __init__(self, ignore_unknown_fields: bool = False, workers: bool = True):
        self.loop = _Loop()
        self.registry = WorkerRegistry()
        self.prefill, self.decode = FakePrefill("p0"), FakeDecode("d0")

        async def setup():
            for role, fake in (("prefill", self.prefill), ("decode", self.decode)):
                self.registry.add(fake.worker_id, role, fake, 16)
                await self.registry.activate(fake.worker_id)

        if workers:
            self.loop.run(setup())
        self.dispatcher = Dispatcher(self.registry, VALIDATOR, "tiny")
        self.metrics = RouterMetrics("tiny", self.registry, list, lambda: 0, dict)
        self.http = OpenAIServer(
            self.dispatcher, "127.0.0.1", 0, self.metrics, ignore_unknown_fields=ignore_unknown_fields
        )
        self.loop.run(self.http.start())
        self.base = f"http://127.0.0.1:{self.http.port}"

    def request(self, path: str, body: dict | None = None) -> tuple[int, dict | str]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read().decode()
                return r.status, raw if raw.startswith("data:") else json.loads(raw)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def close(self) -> None:
        self.loop.run(self.http.stop())
        self.loop.close()


@pytest.fixture(scope="module")
def door():
    d = Door()
    yield d
    d.close()


def _passed(endpoint: Endpoint, status: int, payload) -> bool:
    want_status, needle = PASSED[endpoint]
    return status == want_status and (not needle or needle in payload["error"]["message"])


def test_docs_api_md_is_the_schema():
    assert (ROOT / "docs" / "api.md").read_text() == api_schema.markdown()


@pytest.mark.parametrize("cls", [ChatRequest, CompletionRequest])
def test_each_front_door_model_reads_exactly_the_honoured_fields(cls):
    honoured = {f.name for f in api_schema.fields_of(cls.ENDPOINT).values() if f.status is Status.HONOURED}
    assert set(cls.model_fields) == honoured


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_every_refused_field_is_a_400_naming_it_and_its_neutral_values_pass(door, endpoint):
    refused = [f for f in api_schema.fields_of(endpoint).values() if f.status is Status.REFUSED]
    assert len(refused) > 20
    for f in refused:
        status, payload = door.request(PATH[endpoint], BASE[endpoint] | {f.name: {"not": "neutral"}})
        assert status == 400 and f"`{f.name}`" in payload["error"]["message"], (f.name, status, payload)
        for value in f.neutral:
            status, payload = door.request(PATH[endpoint], BASE[endpoint] | {f.name: value})
            assert _passed(endpoint, status, payload), (f.name, value, status, payload)


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_metadata_fields_are_accepted(door, endpoint):
    for f in api_schema.fields_of(endpoint).values():
        if f.status is Status.METADATA:
            status, payload = door.request(PATH[endpoint], BASE[endpoint] | {f.name: "label"})
            assert _passed(endpoint, status, payload), (f.name, status, payload)


def test_unknown_fields_are_a_400_listing_them(door):
    body = BASE[Endpoint.COMPLETIONS] | {"temprature": 0.5, "frobnicate": 1, "best_of": 3}
    status, payload = door.request("/v1/completions", body)
    message = payload["error"]["message"]
    assert status == 400
    assert "`temprature`" in message and "`frobnicate`" in message and "`best_of`" in message


def test_unknown_fields_are_ignored_and_counted_when_configured():
    door = Door(ignore_unknown_fields=True)
    try:
        status, payload = door.request("/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "a": 1, "b": 2})
        assert status == 200 and payload["usage"]["completion_tokens"] == 3
        assert door.metrics.prom.get_sample_value("splitserve:ignored_fields_total") == 2
        status, payload = door.request("/v1/completions", {"prompt": [5, 6], "a": 1, "best_of": 2})
        assert status == 400 and "`best_of`" in payload["error"]["message"]  # refused fields stay refused
    finally:
        door.close()


def test_honoured_fields_reach_the_workers_as_sent(door):
    before = len(door.prefill.calls)
    body = {
        "prompt": [5, 6, 7],
        "max_tokens": 9,
        "temperature": 0.25,
        "top_p": 0.5,
        "top_k": 7,
        "seed": 11,
        "stop_token_ids": [3, 4],
        "ignore_eos": True,
        "request_id": "mine-1",
        "model": "tiny",
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "logit_bias": {"12": 3.0, "7": -100},
        "min_tokens": 4,
        "allowed_token_ids": [1, 2, 3],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }
    status, payload = door.request("/v1/completions", body)
    assert status == 200 and payload["id"] == "mine-1"
    (task,) = door.prefill.calls[before:]
    p = task.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (9, 0.25, 0.5, 7, 11)
    assert (p.stop_token_ids, p.ignore_eos) == ((3, 4), True)
    assert (p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (0.1, 1.2, 0.5, -0.5)
    assert (p.logit_bias, p.min_tokens, p.allowed_token_ids) == (((7, -100.0), (12, 3.0)), 4, (1, 2, 3))
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (True, False)
    assert payload["usage"]["completion_tokens"] == 9
    status, payload = door.request("/v1/completions", body | {"model": "other"})
    assert status == 404 and "unknown model" in payload["error"]["message"]  # as vLLM and OpenAI


def test_unset_fields_get_the_servers_defaults_and_completions_16_tokens(door):
    before = len(door.prefill.calls)
    status, payload = door.request("/v1/completions", {"prompt": [5, 6, 7]})
    assert status == 200
    (task,) = door.prefill.calls[before:]
    p = task.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (16, 1.0, 1.0, 0)


def test_chat_without_max_tokens_gets_the_rest_of_the_context():
    validator = dataclasses.replace(VALIDATOR, tokenizer=_ElevenTokenChat())
    chat = [{"role": "user", "content": "x"}]
    ids, params = validator.prepare(None, SamplingParams(), chat, {"max_tokens"})
    assert len(ids) == 11 and params.max_tokens == VALIDATOR.max_model_len - 11
    _, params = validator.prepare([1, 2, 3], SamplingParams(), None, {"max_tokens"})
    assert params.max_tokens == 16  # completions: OpenAI's and vLLM's 16
    _, params = validator.prepare([7] * 4089, SamplingParams(), None, {"max_tokens"})
    assert params.max_tokens == 7  # never past the context


class _ElevenTokenChat:
    def encode(self, text):
        return [1]

    def apply_chat_template(self, messages, templating=None):
        return list(range(1, 12))

    def decode(self, ids):
        return ""


def test_streams_carry_usage_when_asked(door):
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True, "stream": True}
    opts = {"include_usage": True, "continuous_usage_stats": True}
    status, raw = door.request("/v1/completions", body | {"stream_options": opts})
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    running = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert running == sorted(running) and running[-1] == 6 and events[-1]["choices"] == []
    assert events[-1]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    status, payload = door.request("/v1/completions", body | {"stream_options": {"bogus": True}})
    assert status == 400 and "bogus" in payload["error"]["message"]


def test_tokenize_detokenize_version_and_models(door):
    status, payload = door.request("/tokenize", {"prompt": [5, 6, 7]})
    assert status == 200 and payload == {"tokens": [5, 6, 7], "count": 3, "max_model_len": 4096}
    status, payload = door.request("/tokenize", {"prompt": "text"})
    assert status == 400 and "tokenizer" in payload["error"]["message"]
    status, payload = door.request("/detokenize", {"tokens": [5, VALIDATOR.vocab_size]})
    assert status == 400 and "token ids" in payload["error"]["message"]
    status, payload = door.request("/tokenize", {"prompt": [1], "extra": 1})
    assert status == 400 and "extra" in payload["error"]["message"]
    status, payload = door.request("/version")
    assert status == 200 and payload["version"]
    status, payload = door.request("/v1/models")
    assert payload["data"][0]["max_model_len"] == 4096


def test_health_is_503_while_no_decode_worker_is_routable():
    """Decode workers alone serve (they prefill when no prefill worker is routable);
    without one the door says which pool is missing."""
    door = Door(workers=False)
    try:
        door.loop.run(_add(door.registry, "prefill", door.prefill))
        status, payload = door.request("/health")
        assert status == 503 and payload["message"] == "no routable worker in the decode pool"
        door.loop.run(_add(door.registry, "decode", door.decode))
        assert door.request("/health") == (200, {"status": "ok"})
        assert door.request("/v1/completions", {"prompt": [5], "max_tokens": 2})[0] == 200
    finally:
        door.close()


async def _add(registry, role, fake):
    registry.add(fake.worker_id, role, fake, 16)
    await registry.activate(fake.worker_id)


# ---- every honoured field has a test that shows it --------------------------------------
HONOURED_BY = {
    "messages": [server_tests, "test_openai_http_errors_without_workers"],
    "prompt": [None, "test_honoured_fields_reach_the_workers_as_sent"],
    "model": [None, "test_honoured_fields_reach_the_workers_as_sent"],
    "stream": [None, "test_streams_carry_usage_when_asked"],
    "stream_options": [None, "test_streams_carry_usage_when_asked"],
    "request_id": [None, "test_honoured_fields_reach_the_workers_as_sent"],
    "max_tokens": [None, "test_chat_without_max_tokens_gets_the_rest_of_the_context"],
    "max_completion_tokens": [None, "test_max_completion_tokens_wins"],
    "stop": [None, "test_stop_is_a_string_or_a_list_of_strings_in_the_params"],
    "stop_token_ids": [None, "test_honoured_fields_reach_the_workers_as_sent"],
    "ignore_eos": [None, "test_honoured_fields_reach_the_workers_as_sent"],
    "temperature": [defaults_tests, "test_the_router_applies_the_models_defaults_to_unset_fields_only"],
    "top_p": [None, "test_honoured_fields_reach_the_workers_as_sent"],
    "top_k": [None, "test_honoured_fields_reach_the_workers_as_sent"],
    "seed": [None, "test_honoured_fields_reach_the_workers_as_sent"],
    # what the engine then does with each: tests/unit/engine/test_sampler.py (against transformers'
    # processors) and test_correctness.py (against transformers' generate)
    "min_p": [sampler_tests, "test_min_p_equals_transformers_warper"],
    "repetition_penalty": [correctness_tests, "test_penalties_and_bias_match_hf_in_a_mixed_batch"],
    "frequency_penalty": [sampler_tests, "test_processing_equals_transformers_per_row_in_a_mixed_batch"],
    "presence_penalty": [sampler_tests, "test_processing_equals_transformers_per_row_in_a_mixed_batch"],
    "logit_bias": [correctness_tests, "test_penalties_and_bias_match_hf_in_a_mixed_batch"],
    "min_tokens": [sampler_tests, "test_processing_equals_transformers_per_row_in_a_mixed_batch"],
    "allowed_token_ids": [sampler_tests, "test_greedy_rows_pick_the_argmax_of_their_processed_logits"],
    "logprobs": [sampler_tests, "test_top_logprobs_are_the_raw_distributions_best"],
    "top_logprobs": [None, "test_logprobs_take_openais_shapes"],
    "include_stop_str_in_output": [smollm2_tests, "test_include_stop_str_in_output_keeps_the_stop_string"],
    "skip_special_tokens": [smollm2_tests, "test_special_tokens_stay_in_the_text_when_asked"],
    "response_format": [structured_tests, "test_every_output_validates_against_its_schema_in_a_mixed_batch"],
    "structured_outputs": [None, "test_structured_output_fields_map_to_one_grammar"],
    "bad_words": [smollm2_tests, "test_bad_words_are_never_generated"],
    "echo": [engine_tests, "test_prompt_logprobs_equal_transformers_log_softmax"],
    # tools and templates: the conversation through `splitserve serve` with the real model, the
    # readings in test_tools, the rendering in test_tokenizer
    "tools": [cli_serve_tests, "_check_tool_conversation"],
    "tool_choice": [cli_serve_tests, "_check_tool_conversation"],
    "parallel_tool_calls": [tools_tests, "test_a_forced_choice_is_a_schema_every_valid_call_meets"],
    "chat_template": [tokenizer_tests, "test_a_requests_template_tools_and_variables_render"],
    "chat_template_kwargs": [tokenizer_tests, "test_a_requests_template_tools_and_variables_render"],
    "reasoning_effort": [tokenizer_tests, "test_a_requests_template_tools_and_variables_render"],
    "include_reasoning": [tools_tests, "test_reasoning_is_split_from_content"],
    "prompt_logprobs": [serving_tests, "test_openai_http_endpoint_with_the_official_client"],
    "n": [serving_tests, "test_n_sequences_are_handed_over_once_and_each_equals_its_derived_seed"],
    "speculate": [speculative_tests, "test_a_request_that_opts_out_is_never_speculated"],
}


def test_stop_is_a_string_or_a_list_of_strings_in_the_params():
    """(The engine's stop-string tests: ``tests/unit/engine/test_engine.py``.)"""
    assert CompletionRequest(prompt=[1], stop="zz").params().stop == ("zz",)
    assert CompletionRequest(prompt=[1], stop=["a", "b"]).params().stop == ("a", "b")


def test_max_completion_tokens_wins():
    body = ChatRequest(messages=[], max_tokens=5, max_completion_tokens=7)
    assert body.params().max_tokens == 7 and "max_tokens" not in body.unset()


def test_every_honoured_field_names_a_test_that_exists():
    honoured = {f.name for f in api_schema.FIELDS if f.status is Status.HONOURED}
    assert set(HONOURED_BY) == honoured
    this = __import__(__name__, fromlist=["_"])
    for module, name in HONOURED_BY.values():
        assert callable(getattr(module or this, name)), name
    assert {f.name for f in api_schema.FIELDS} <= set(fuzz_tests.FIELD_NAMES)  # the fuzz test covers them


def test_logprobs_take_openais_shapes(door):
    """(The values, against transformers: ``test_cluster_serving``'s OpenAI test.)"""
    chat = LogprobsWriter(True, lambda t: f"<{t}>")
    got = chat.write([5, 6], [-0.5, -1.0], [((5, -0.5), (9, -2.0)), ((6, -1.0), (5, -3.0))])
    assert got["content"][0] == {
        "token": "<5>",
        "logprob": -0.5,
        "bytes": list(b"<5>"),
        "top_logprobs": [
            {"token": "<5>", "logprob": -0.5, "bytes": list(b"<5>")},
            {"token": "<9>", "logprob": -2.0, "bytes": list(b"<9>")},
        ],
    }
    completion = LogprobsWriter(False, lambda t: "ab" if t == 5 else "c")
    first = completion.write([5], [-0.5], [((5, -0.5), (6, -0.7))])
    second = completion.write([6], [-0.7], [((6, -0.7), (5, -0.9))])
    assert first == {
        "tokens": ["ab"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"ab": -0.5, "c": -0.7}],
        "text_offset": [0],
    }
    assert second["text_offset"] == [2]  # continues across a stream's chunks
    # through the door: the fakes' tokens, named by id (their validator has no tokenizer)
    status, payload = door.request("/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "logprobs": 2})
    lp = payload["choices"][0]["logprobs"]
    assert status == 200 and len(lp["tokens"]) == 3 and lp["tokens"][0].startswith("token_id:")
    status, payload = door.request("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "logprobs": 21})
    assert status == 400 and "top_logprobs" in payload["error"]["message"]
    status, raw = door.request(
        "/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "logprobs": 0, "stream": True}
    )
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"][0]["logprobs"]) == 3


def test_structured_output_fields_map_to_one_grammar(door):
    """(What the engine does with it: ``tests/unit/engine/test_structured.py``.)"""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    named = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    cases = [
        (dict(response_format={"type": "text"}), None),
        (
            dict(response_format={"type": "json_object"}),
            StructuredOutput("json_schema", '{"type": "object"}'),
        ),
        (dict(response_format=named), StructuredOutput("json_schema", json.dumps(schema))),
        (dict(structured_outputs={"json": schema}), StructuredOutput("json_schema", json.dumps(schema))),
        (dict(structured_outputs={"regex": "[0-9]+"}), StructuredOutput("regex", "[0-9]+")),
        (dict(structured_outputs={"choice": ["a", "b"]}), StructuredOutput("choice", '["a", "b"]')),
        (dict(structured_outputs={"grammar": 'start: "x"'}), StructuredOutput("grammar", 'start: "x"')),
    ]
    for fields, want in cases:
        assert CompletionRequest(prompt=[1], **fields).params().structured == want, fields
    for body, needle in (
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "whitespace_pattern"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
        ({"response_format": {"type": "json_object"}}, "needs a tokenizer"),  # the fakes' model has none
    ):
        status, payload = door.request("/v1/completions", {"prompt": [5]} | body)
        assert status == 400 and needle in payload["error"]["message"], (body, payload)


def test_echo_puts_the_prompt_first(door):
    """(The prompt's logprobs against transformers, through the disaggregated cluster:
    ``test_cluster_serving``'s OpenAI test; in the engine: ``test_engine.py``.)"""
    status, payload = door.request("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "echo": True})
    assert status == 200 and payload["choices"][0]["text"] == "token_id:5token_id:6"  # no tokenizer: names
    before = len(door.prefill.calls)
    body = {"prompt": [5, 6], "max_tokens": 2, "echo": True, "logprobs": 2}
    status, payload = door.request("/v1/completions", body)
    assert status == 200 and door.prefill.calls[before].params.prompt_logprobs == 2
    status, payload = door.request("/v1/chat/completions", {"messages": [], "echo": True})
    assert status == 400 and "`echo`" in payload["error"]["message"]
    writer = LogprobsWriter(False, lambda t: f"<{t}>")
    prompt = writer.write_prompt([5, 6, 7], [(-1.0, ((6, -1.0),)), (-2.0, ((9, -0.5),))])
    both = writer.join(prompt, writer.write([8], [-0.25], []))
    assert both == {
        "tokens": ["<5>", "<6>", "<7>", "<8>"],
        "token_logprobs": [None, -1.0, -2.0, -0.25],
        "top_logprobs": [None, {"<6>": -1.0}, {"<9>": -0.5}, {}],
        "text_offset": [0, 3, 6, 9],
    }


def test_a_list_of_prompts_gets_one_choice_each(door):
    """OpenAI's batched prompts (what lm-evaluation-harness sends): one choice per prompt,
    in order, usage summed."""
    status, payload = door.request("/v1/completions", {"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 2})
    assert status == 200 and [c["index"] for c in payload["choices"]] == [0, 1]
    assert payload["usage"]["prompt_tokens"] == 5 and payload["usage"]["completion_tokens"] == 4
    body = {"prompt": [[5, 6]], "max_tokens": 2, "echo": True}
    status, payload = door.request("/v1/completions", body)
    assert status == 200 and payload["choices"][0]["text"] == "token_id:5token_id:6"
    status, payload = door.request("/v1/completions", {"prompt": [[5], [6]], "stream": True})
    assert status == 400 and "one prompt" in payload["error"]["message"]
    status, payload = door.request("/v1/completions", {"prompt": [[5], []]})
    assert status == 400 and "empty" in payload["error"]["message"]


def test_usage_reports_speculation_as_predicted_tokens():
    """OpenAI's fields for predicted tokens carry speculative decoding's counts, summed
    over choices; a request that did not speculate has none."""
    from splitserve.router.events import FinalEvent
    from splitserve.router.openai.responses import usage
    from splitserve.wire.sampling import FinishReason

    def final(index, drafted, kept):
        times = dict(queue_ms=0, prefill_ms=0, transfer_ms=0, decode_ms=0, kv_pull_ms=0, ttft_ms=0, e2e_ms=0)
        return FinalEvent(FinishReason.LENGTH, 3, 6, 0, **times, prefill_worker="", decode_worker="d0",
                          index=index, draft_tokens=drafted, accepted_draft_tokens=kept)  # fmt: skip

    got = usage([final(0, 8, 5), final(1, 4, 1)])
    assert got["completion_tokens_details"] == {
        "accepted_prediction_tokens": 6,
        "rejected_prediction_tokens": 6,
    }
    assert "completion_tokens_details" not in usage([final(0, 0, 0)])
