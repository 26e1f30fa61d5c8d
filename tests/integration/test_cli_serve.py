"""The README's main path with the real model: ``splitserve serve`` (router ->
prefill actor -> NIXL -> decode actor), then ``splitserve generate --stream``
and ``splitserve status`` against it, then Ctrl-C shuts it down cleanly. The
machine has seen a Ray cluster die without cleaning up: its session file still
names it, and ``serve`` starts its own Ray regardless."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request

import jsonschema
import openai
import pytest

from splitserve.engine.device import cpu_has_native_bf16
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.needs_smollm2,
]
CLI = [sys.executable, "-m", "splitserve.cli.main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_openai_chat(address: str) -> None:
    """The HTTP endpoint's greedy chat answer, streamed and not, equals the engine's.
    Asked of a server that has answered nothing yet: in bfloat16, a prompt prefilled
    after a cached prefix (every chat shares the template's system prompt) may pick
    another greedy token than the same prompt prefilled whole."""
    from splitserve.engine.engine import Engine
    from splitserve.wire.config import EngineConfig
    from splitserve.wire.sampling import SamplingParams

    messages = [{"role": "user", "content": "Name three colors."}]
    engine = Engine(EngineConfig(model="smollm2", kv_cache_memory_mib=64))
    engine.add_request(messages=messages, params=SamplingParams(max_tokens=24))
    want = []
    while engine.has_unfinished():
        want.extend(o.text for o in engine.step())
    api = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0)
    out = api.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
    assert out.choices[0].message.content == "".join(want)
    stream = api.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == "".join(want)
    # structured output through the disaggregated cluster: the answer is the schema's JSON
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}},
        "required": ["color", "count"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    out = api.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=60, temperature=0, response_format=fmt
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    # /tokenize gives the ids the chat ran on; /detokenize gives text back
    assert _post(address, "/tokenize", {"messages": messages})["count"] == out.usage.prompt_tokens
    assert out.choices[0].finish_reason == "stop"
    ids = _post(address, "/tokenize", {"prompt": "Name three colors."})["tokens"]
    assert _post(address, "/detokenize", {"tokens": ids})["prompt"] == "Name three colors."


# A Hermes-style template that shows tools (SmolLM2's own does not): a request's chat_template
HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call functions. Available tools: <tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
For each call, return a JSON object within <tool_call></tool_call> tags.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def _check_tool_conversation(address: str) -> None:
    """call -> tool result -> answer through the ``openai`` client, streamed and not:
    ``tool_choice: required`` holds the model to a valid call (finish_reason
    ``tool_calls``); the streamed call's deltas add up to the same call; the answer to
    the tool's result is text, streamed the same as not."""
    api = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0)
    ask = dict(model="smollm2", temperature=0, max_tokens=60, tools=[WEATHER])
    ask["extra_body"] = {"chat_template": HERMES_TEMPLATE}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = api.chat.completions.create(messages=messages, tool_choice="required", **ask)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed: dict = {}
    chunks = list(api.chat.completions.create(messages=messages, tool_choice="required", stream=True, **ask))
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = streamed.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert streamed == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 21}'},
    ]
    answer = api.chat.completions.create(messages=messages, tool_choice="none", **ask)
    text = answer.choices[0].message.content
    assert text and not answer.choices[0].message.tool_calls
    alone = api.chat.completions.create(messages=messages[:1], tool_choice="none", **ask | {"max_tokens": 1})
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 20  # the call and its result rendered
    stream = api.chat.completions.create(messages=messages, tool_choice="none", stream=True, **ask)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def _post(address: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://{address}{path}", json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def _stale_ray_dir() -> str:
    """A Ray temp dir whose ``ray_current_cluster`` (what ``ray start`` writes, and a
    crash leaves behind) names a cluster that is gone. Short, under /tmp: Ray's unix
    socket paths inside it must stay under 108 bytes."""
    root = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    os.makedirs(os.path.join(root, "ray"))
    with open(os.path.join(root, "ray", "ray_current_cluster"), "w") as f:
        f.write(f"127.0.0.1:{_free_port()}")
    return root


def test_serve_generate_status_and_ctrl_c(tmp_path):
    port, http_port = _free_port(), _free_port()
    log = open(tmp_path / "serve.log", "w+")
    ray_dir = _stale_ray_dir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": ray_dir}
    server = subprocess.Popen(
        [*CLI, "serve", "--port", str(port), "--http-port", str(http_port)], stdout=log, stderr=log, env=env
    )
    try:

        def ready() -> bool:
            text = (tmp_path / "serve.log").read_text()
            assert server.poll() is None, text[-3000:]
            return "Ctrl-C stops" in text

        wait_until(ready, "the server ready", 600, 0.5)
        _check_openai_chat(f"127.0.0.1:{http_port}")
        _check_tool_conversation(f"127.0.0.1:{http_port}")
        address = f"127.0.0.1:{port}"
        gen = subprocess.run(
            [
                *CLI,
                "generate",
                "What is the capital of France?",
                "--server",
                address,
                "--stream",
                "--wait",
                "60",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gen.returncode == 0, gen.stderr
        assert "Paris" in gen.stdout
        # structured output through the gRPC SDK too
        from splitserve.client import Client

        with Client(address, timeout=120) as client:
            chat = [{"role": "user", "content": "Is the sky blue?"}]
            out = client.generate(messages=chat, temperature=0, structured=("choice", '["yes", "no"]'))
        assert out.text in ("yes", "no") and out.final.finish_reason == "stop"
        status = subprocess.run(
            [*CLI, "status", "--server", address], capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 0, status.stderr
        assert "smollm2 (disaggregated)" in status.stdout
        assert "prefill-0" in status.stdout and "decode-0" in status.stdout
        # each pool's KV cache: the CPU default of 1 GiB over SmolLM2's 30 layers x 3 KV
        # heads x 64 dims of K and V, in 16-token blocks; its 8192-token context fits
        per_token = 2 * 30 * 3 * 64 * (2 if cpu_has_native_bf16() else 4)
        tokens = 2**30 // (per_token * 16) * 16
        for role in ("prefill", "decode"):
            assert (
                f"{role}: KV cache {tokens:,} tokens per worker ({per_token:,} bytes per token per rank); "
                "max context 8,192 tokens; "
                f"{tokens / 8192:.2f}x concurrency" in status.stdout
            ), status.stdout
    finally:
        server.send_signal(signal.SIGINT)
        try:
            code = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
        finally:
            shutil.rmtree(ray_dir, ignore_errors=True)
    text = (tmp_path / "serve.log").read_text()
    assert code == 0, text[-3000:]
    assert "stopped" in text
    # It says what each pool's engine chose (the dtype this CPU is best at, the threads it got).
    dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    for role in ("prefill", "decode"):
        assert f"{role} engine: llama, {dtype} on 1 torch threads" in text, text[-3000:]
