"""The OpenAI endpoint of a disaggregated cluster of the real model (SmolLM2,
float32: one prefill worker, two decode workers, KV over NIXL), driven by the
``openai`` client:

- 20 JSON schemas (nested objects, arrays, enums, ``anyOf``, string formats) as
  ``response_format``: every output validates with ``jsonschema``; the same with
  the decode worker killed mid-output (the request resumes on the other one, its
  grammar rebuilt from the tokens already sent): the output still validates and
  equals the undisturbed run;
- chat ``logprobs`` with ``top_logprobs: 5``: equal to transformers' log_softmax of
  the float32 model within 1e-4;
- a request can only fail itself: every sampling field at its extremes (NaN and
  infinities included), with each structured-output kind, logprobs and ``n``,
  through both front doors: 200 inside the range docs/api.md documents, 400
  outside it, the two doors alike case by case, every 200 answer held to its
  structured-output kind, no worker restarts, and greedy streams running
  meanwhile unchanged.
"""

from __future__ import annotations

import json
import math
import re
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import openai
import pytest
import ray

from splitserve.client import Client, InvalidArgument
from splitserve.cluster.config import ClusterConfig
from tests.integration.cluster_util import kv_used, live_cluster, scrape, total, wait_kv_free, wait_until
from tests.unit.engine.test_structured import NAME, SCHEMAS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.needs_smollm2,
]


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
JOIN_S = 400  # a request thread still running then has hung (each client gives up by 300 s)


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
    base_url = f"http://{cluster.http_address}/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)


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

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(ALL_SCHEMAS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive(), f"a request hung past {JOIN_S} s"
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


# ---- a request can only fail itself: every sampling field at its extremes ------------------------
BIG = 1.7976931348623157e308  # the largest finite float
FLOATS = {
    "temperature": [0.0, 5e-324, 1.5, BIG, math.nan, math.inf],
    "top_p": [0.0, 5e-324, 1.0, BIG, math.nan],
    "min_p": [0.0, 5e-324, 1.0, BIG, math.nan],
    "repetition_penalty": [0.0, 5e-324, BIG, math.nan, -math.inf],
    "frequency_penalty": [0.0, 5e-324, 2.0, -BIG, math.nan],
    "presence_penalty": [-2.0, 5e-324, BIG, math.inf],
}
INTS = {
    "max_tokens": [0, 1, 2**32 - 1],
    "top_k": [0, 1, 2**32 - 1],
    "seed": [0, 2**64 - 1],
    "n": [0, 3, 2**32 - 1],
}
INTS |= {"min_tokens": [0, 4, 2**32 - 1], "top_logprobs": [0, 20, 2**32 - 1]}
STRUCTURED = [None, ("json_schema", '{"type": "object"}'), ("regex", "[a-z]+"), ("choice", '["yes", "no"]')]
STRUCTURED += [("json_schema", json.dumps(_object(answer={"enum": ["yes", "no"]})))]


# Whether each extreme is inside the range docs/api.md gives its field (the reference the
# answers are held to, case by case): 200/OK inside it, 400/INVALID_ARGUMENT outside
DOCUMENTED = {
    "temperature": lambda v: 0 <= v <= 100,  # [0, 100]; NaN compares false: outside
    "top_p": lambda v: 0 < v <= 1,  # (0, 1]
    "min_p": lambda v: 0 <= v <= 1,  # [0, 1]
    "repetition_penalty": lambda v: 0 < v <= 100,  # (0, 100]
    "frequency_penalty": lambda v: -2 <= v <= 2,  # [-2, 2]
    "presence_penalty": lambda v: -2 <= v <= 2,  # [-2, 2]
    "max_tokens": lambda v: 1 <= v <= 1000,  # >= 1, within the context (2^32 - 1 is past any)
    "top_k": lambda v: 0 <= v < 2**31,  # an integer < 2^31; 0 is off
    "seed": lambda v: 0 <= v < 2**64,  # [0, 2^64)
    "n": lambda v: 1 <= v <= 64,  # 1 to 64
    "min_tokens": lambda v: 0 <= v <= 4,  # >= 0, at most max_tokens (4 in every case)
    "top_logprobs": lambda v: 0 <= v <= 20,  # 0-20
}


def _extremes():
    """(index, field, value) of every extreme, each one combined (by its index) with a
    structured-output kind, logprobs on or off, and n of 1 or 2."""
    cases = [(f, v) for f, vs in FLOATS.items() for v in vs] + [(f, v) for f, vs in INTS.items() for v in vs]
    return [(i, f, v) for i, (f, v) in enumerate(cases)]


def _http_body(i: int, field: str, value) -> dict:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}
    body |= {"n": 1 + (i % 3 == 0), "logprobs": i % 2 == 0, "temperature": 0.7, "seed": i}
    kind = STRUCTURED[i % len(STRUCTURED)]
    if kind is not None and kind[0] == "json_schema":
        schema = json.loads(kind[1])
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    elif kind is not None:
        body["structured_outputs"] = {kind[0]: json.loads(kind[1]) if kind[0] == "choice" else kind[1]}
    if field == "top_logprobs":
        body["logprobs"] = True
    body[field] = value
    return body


def _float32(value: float) -> float:
    """``value`` as a float32 field of the gRPC wire holds it."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def _carried(field: str, value):
    """``value`` of ``field`` as the gRPC wire carries it to the server."""
    if field in FLOATS:
        return _float32(value)
    return 1 if field == "n" and value == 0 else value


def _http(base: str, body: dict) -> int:
    """The status of ``body``'s request; every choice of a 200 answer holds to its
    structured-output kind (``_holds``)."""
    request = urllib.request.Request(
        f"{base}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())
            for choice in answer["choices"]:
                _holds(body, choice["message"]["content"], choice["finish_reason"])
            return r.status
    except urllib.error.HTTPError as e:
        assert json.loads(e.read())["error"]["message"], "an error without a sentence"
        return e.code


def _holds(body: dict, text: str, finish_reason: str) -> None:
    """``text`` is what ``body``'s structured-output kind allows: whole where it stopped,
    a prefix of it where it ran out of tokens."""
    structured = body.get("structured_outputs", {})
    if "response_format" in body:
        schema = body["response_format"]["json_schema"]["schema"]
        if finish_reason == "stop":
            _valid(schema, text)
    elif "choice" in structured:
        assert any(
            c.startswith(text) if finish_reason == "length" else c == text for c in structured["choice"]
        )
    elif "regex" in structured:
        assert re.fullmatch(r"[a-z]*" if finish_reason == "length" else structured["regex"], text), text


def _grpc(address: str, i: int, field: str, value) -> str:
    options = dict(max_tokens=4, n=1 + (i % 3 == 0), logprobs=i % 2 == 0, temperature=0.7, seed=i)
    kind = STRUCTURED[i % len(STRUCTURED)]
    if kind is not None:
        options["structured"] = kind
    if field == "top_logprobs":
        options["logprobs"] = True
    options[field] = value
    with Client(address, retries=0, timeout=120) as c:
        try:
            outs = c.generate_n(messages=[{"role": "user", "content": QUESTION}], **options)
            for out in outs:  # held to its kind as an HTTP answer is
                _holds(_http_body(i, field, value), out.text, out.finish_reason)
        except InvalidArgument as e:
            assert str(e), "an error without a sentence"
            return "INVALID_ARGUMENT"
        except (ValueError, TypeError, OverflowError):
            return "not carried"  # protobuf cannot hold the value: it never reaches the server
    return "OK"


def test_every_sampling_field_at_its_extremes_fails_only_itself(cluster, client):
    """Through both front doors: each float field at 0, the smallest positive, the largest
    finite, NaN and infinities, each integer at 0, small and its wire type's largest, each
    combined with a structured-output kind, logprobs and n. Every answer is 200/OK or a
    400/INVALID_ARGUMENT with a sentence; no worker restarts or is replaced; greedy streams
    running meanwhile equal their undisturbed output."""
    before = {w.worker_id: w.restarts for p in client.cluster_status().pools for w in p.workers}
    failures_before = total(scrape(cluster), "splitserve:engine_loop_failures_total")
    prompts = [f"Tell me about the number {k}." for k in range(3)]
    good = dict(max_tokens=48, temperature=0, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    undisturbed = [client.generate(messages=m, **good).token_ids for m in chats]
    meanwhile: list = [None] * len(prompts)

    def stream(k: int) -> None:
        with Client(cluster.address, timeout=300) as c:
            meanwhile[k] = c.generate(messages=chats[k], **good).token_ids

    streams = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(len(prompts))]
    for t in streams:
        t.start()
    base = f"http://{cluster.http_address}"
    with ThreadPoolExecutor(4) as pool:
        http = list(pool.map(lambda c: (c, _http(base, _http_body(*c))), _extremes()))
        grpc_ = list(pool.map(lambda c: (c, _grpc(cluster.address, *c)), _extremes()))
    for t in streams:
        t.join(JOIN_S)
        assert not t.is_alive(), f"a greedy stream hung past {JOIN_S} s"
    want = {c: 200 if DOCUMENTED[c[1]](c[2]) else 400 for c in _extremes()}
    assert [(c, code) for c, code in http if code != want[c]] == []  # every case as documented
    # the gRPC door alike, on the value its wire carries: its sampling floats are float32
    # (5e-324 arrives as 0, the largest double as inf), an integer past its field is refused
    # by protobuf in the client ("not carried"), and proto3 cannot tell an n of 0 from
    # none (the proto: "0: 1")
    agree = {True: ("OK",), False: ("INVALID_ARGUMENT", "not carried")}
    carried = {c: DOCUMENTED[c[1]](_carried(c[1], c[2])) for c in _extremes()}
    assert [(c, code) for c, code in grpc_ if code not in agree[carried[c]]] == []
    assert meanwhile == undisturbed
    after = {w.worker_id: w.restarts for p in client.cluster_status().pools for w in p.workers}
    assert after == before  # the same workers, none restarted
    assert total(scrape(cluster), "splitserve:engine_loop_failures_total") == failures_before
