"""The sampling defaults a model ships in ``generation_config.json``.

A request that leaves ``temperature``, ``top_p``, ``top_k``, ``min_p`` or
``repetition_penalty`` unset gets the model's value (Llama-3-Instruct ships
``temperature: 0.6, top_p: 0.9``; Qwen3 also ``top_k: 20``), as vLLM does with
``--generation-config auto``, else ``SERVER_DEFAULTS`` (OpenAI's); the file's
``eos_token_id`` adds to the model's end-of-sequence ids. Turning it off
(``EngineConfig.generation_config = False``, vLLM's ``--generation-config vllm``)
leaves the server's own defaults. The router applies them (it knows which
fields a client left unset); ``Engine.generate`` takes ``SamplingParams`` as
given. Plain data: routers unpickle it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from splitserve.wire.errors import ModelLoadError
from splitserve.wire.sampling import SamplingParams

log = logging.getLogger(__name__)

FILE = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# What a request gets for a sampling field it leaves unset when the model's file
# sets none: OpenAI's defaults (top_k: off), for every front door.
SERVER_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
DEFAULTED = ("max_tokens", *SAMPLING_FIELDS)  # the fields a front door may leave to the server


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def read(cls, directory: Path) -> GenerationDefaults:
        """The defaults in ``directory/generation_config.json``; none if there is no file.
        Raises ``ModelLoadError`` for a file that is not JSON or has values out of range."""
        path = directory / FILE
        if not path.exists():
            return cls()
        try:
            raw = json.loads(path.read_text())
        except ValueError as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        out = cls(
            temperature=raw.get("temperature"),
            top_p=raw.get("top_p"),
            top_k=raw.get("top_k"),
            min_p=raw.get("min_p"),
            repetition_penalty=raw.get("repetition_penalty"),
            eos_token_ids=tuple(int(i) for i in eos_ids),
        )
        try:
            out.apply(SamplingParams(), SAMPLING_FIELDS)
        except ValueError as e:  # InvalidRequest is a ValueError
            raise ModelLoadError(f"{path} has a sampling default out of range: {e}") from e
        if out.sampling():
            log.info("sampling defaults from %s: %s", FILE, out.sampling())
        return out

    def sampling(self) -> dict[str, float | int]:
        """The sampling fields this file sets."""
        return {f: getattr(self, f) for f in SAMPLING_FIELDS if getattr(self, f) is not None}

    def apply(self, params: SamplingParams, unset: Collection[str]) -> SamplingParams:
        """``params`` with each sampling field in ``unset`` (by name) replaced by this
        file's value, or ``SERVER_DEFAULTS``' where the file sets none; the rest as the
        client sent them."""
        ours = SERVER_DEFAULTS | self.sampling()
        changes = {k: v for k, v in ours.items() if k in unset}
        return dataclasses.replace(params, **changes) if changes else params
