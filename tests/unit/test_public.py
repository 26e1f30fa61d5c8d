"""The public surface: ``from splitserve import Engine, EngineConfig, SamplingParams,
Client, AsyncClient``, each the subpackage's own object, loaded lazily: importing
``splitserve``, or taking the client from it, loads no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys
import splitserve
assert "torch" not in sys.modules, "import splitserve loaded torch"
from splitserve import AsyncClient, Client
assert "torch" not in sys.modules, "the client loaded torch"
import splitserve.client
assert (Client, AsyncClient) == (splitserve.client.Client, splitserve.client.AsyncClient)
from splitserve import Engine, EngineConfig, SamplingParams
import splitserve.engine.engine, splitserve.wire.config, splitserve.wire.sampling
assert Engine is splitserve.engine.engine.Engine
assert EngineConfig is splitserve.wire.config.EngineConfig
assert SamplingParams is splitserve.wire.sampling.SamplingParams
print(sorted(splitserve.__all__))
"""


def test_the_public_names_load_lazily_and_are_the_subpackages_own():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['AsyncClient', 'Client', 'Engine', 'EngineConfig', 'SamplingParams']"


def test_an_unknown_name_is_an_attribute_error():
    import splitserve

    with pytest.raises(AttributeError, match="no attribute 'LLM'"):
        splitserve.LLM  # noqa: B018
