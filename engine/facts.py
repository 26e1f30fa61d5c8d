"""``EngineFacts``: what a worker knows of its engine without reaching into it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.engine.tokenizer import Tokenizer
from splitserve.wire.validation import RequestValidator

if TYPE_CHECKING:
    from splitserve.engine.engine import Engine


@dataclass(frozen=True)
class EngineFacts:
    """An engine's facts that stay as they are once it is built: how its requests are
    checked, its tokenizer (for the text a worker makes off the engine's thread), its
    one-line summary, its KV bytes per token and which weights it serves. Picklable:
    an engine in a process of its own (``engine.process``) hands them to its worker."""

    validator: RequestValidator
    tokenizer: Tokenizer | None  # None: a checkpoint without one (token ids only)
    summary: str
    kv_bytes_per_token: int
    revision: str

    @classmethod
    def of(cls, engine: Engine) -> EngineFacts:
        return cls(
            engine.validator,
            engine.tokenizer,
            engine.summary,
            engine.capacity.bytes_per_token,
            engine.revision,
        )
