"""``generation_config.json`` defaults: read from the model directory, applied by
the router to the sampling fields a request left unset (both front doors), and
its EOS ids added to the engine's; ``generation_config: false`` ignores the file."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from splitserve.engine.engine import Engine
from splitserve.proto import splitserve_pb2 as pb
from splitserve.router.dispatch import Dispatcher
from splitserve.router.events import GenerateInput
from splitserve.router.openai.protocol import ChatRequest
from splitserve.router.registry import WorkerRegistry
from splitserve.router.service import generate_input
from splitserve.wire.config import EngineConfig
from splitserve.wire.defaults import DEFAULTED, SERVER_DEFAULTS, GenerationDefaults
from splitserve.wire.errors import ModelLoadError
from splitserve.wire.sampling import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.unit.router.fakes import VALIDATOR, FakeDecode, FakePrefill


def _write(directory, **values):
    (directory / "generation_config.json").write_text(json.dumps(values))


def test_the_file_sets_sampling_fields_and_eos_ids(tmp_path):
    assert GenerationDefaults.read(tmp_path) == GenerationDefaults()  # no file: nothing
    _write(tmp_path, temperature=0.6, top_p=0.9, eos_token_id=[7, 9], do_sample=True)
    d = GenerationDefaults.read(tmp_path)
    assert d.sampling() == {"temperature": 0.6, "top_p": 0.9}
    assert d.eos_token_ids == (7, 9)
    sent = SamplingParams(temperature=0.0, top_p=0.5, top_k=5)
    applied = d.apply(sent, {"top_p"})  # the client set temperature (to greedy) and top_k itself
    assert (applied.temperature, applied.top_p, applied.top_k) == (0.0, 0.9, 5)
    # a field neither the client nor the file sets gets the server's (OpenAI's) default
    applied = d.apply(sent, {"top_k"})
    assert (applied.top_p, applied.top_k) == (0.5, SERVER_DEFAULTS["top_k"])
    assert (
        GenerationDefaults().apply(sent, {"temperature"}).temperature == SERVER_DEFAULTS["temperature"] == 1.0
    )


def test_a_default_out_of_range_is_refused_at_load(tmp_path):
    _write(tmp_path, top_p=1.5)
    with pytest.raises(ModelLoadError, match="sampling default out of range.*top_p"):
        GenerationDefaults.read(tmp_path)


def test_both_front_doors_report_which_fields_were_left_unset():
    assert set(DEFAULTED) == {"max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
    req = pb.GenerateRequest(
        prompt="hi", sampling=pb.SamplingParams(temperature=0.0, max_tokens=4, min_p=0.1)
    )
    assert generate_input(req, None)[0].unset == {"top_p", "top_k", "repetition_penalty"}
    body = ChatRequest(messages=[{"role": "user", "content": "hi"}], top_k=3, repetition_penalty=1.1)
    assert body.unset() == {"temperature", "top_p", "max_tokens", "min_p"}
    assert generate_input(pb.GenerateRequest(prompt="hi"), None)[0].unset == set(DEFAULTED)


def test_the_router_applies_the_models_defaults_to_unset_fields_only():
    registry = WorkerRegistry()
    prefill, decode = FakePrefill("p0"), FakeDecode("d0")

    async def run():
        for role, fake in (("prefill", prefill), ("decode", decode)):
            registry.add(fake.worker_id, role, fake, 16)
            await registry.activate(fake.worker_id)
        validator = dataclasses.replace(VALIDATOR, defaults=GenerationDefaults(temperature=0.6, top_k=20))
        d = Dispatcher(registry, validator, "tiny")
        params = SamplingParams(max_tokens=4, temperature=0.0, top_k=0)
        for unset in ({"temperature", "top_p", "top_k"}, {"top_p", "top_k"}):
            async for _ in d.generate(GenerateInput(params, prompt=[5, 6, 7], unset=frozenset(unset))):
                pass

    asyncio.run(run())
    first, second = (task.params for task in prefill.calls)
    assert (first.temperature, first.top_k, first.top_p) == (0.6, 20, SERVER_DEFAULTS["top_p"])
    assert (second.temperature, second.top_k) == (0.0, 20)  # temperature 0 was the client's own


@pytest.mark.parametrize("use_file", [True, False])
def test_the_engine_stops_at_the_files_eos_ids_unless_told_to_ignore_it(tmp_path, use_file):
    make_hf_checkpoint("llama", tmp_path)
    _write(tmp_path, eos_token_id=[11, 12], temperature=0.7)
    engine = Engine(EngineConfig(model=str(tmp_path), dtype="float32", generation_config=use_file))
    assert ({11, 12} <= engine.eos_token_ids) == use_file
    assert engine.validator.defaults.sampling() == ({"temperature": 0.7} if use_file else {})
