"""Export KV layer by layer as prefill writes it: the prefill side of layer-wise
streaming, and of hashing during prefill instead of at export.

``LayerExporter`` is the engine's ``LayerObserver`` for a prefill worker (TP=1;
a TP group's other ranks export whole). For each prefill-only prompt that
completes in a step, it hashes each layer's blocks right after the forward
pass wrote them, so the export after the step hashes nothing. With
``stream=True`` (a backend whose ``KVSource.streams``), it also opens the
export before the forward pass (``begin_export``) and announces each layer as
it is hashed (``layer_ready``), so a sink pulls layer k while layer k+1
computes::

    step_begins(prompts) --begin_export--> streamed descriptors --> on_stream(...)
    layer_done(0) --hash, layer_ready(0)--> ... layer_done(L-1)
    after the step: export(request) -> the streamed descriptor, or a whole export
                    with the checksums already taken
    a prompt that will not be exported (finished at its first token, failed):
                    discard(request) releases its export
    a step that failed part way (the engine runs it again without the observer):
                    step_failed() releases its streamed exports

A cache on a GPU is hashed per layer only when streaming: hashing copies the
layer's blocks to the host, and doing that inside the forward pass would stall
the GPU after every layer; without streaming, export hashes after the step.

Runs on the engine's thread; calls into the source hold ``lock`` (the one the
worker's poller holds while it polls the same source).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.kv_transfer.integrity import layer_checksum
from splitserve.kv_transfer.source import KVSource
from splitserve.wire.kv import KVDescriptor
from splitserve.wire.outputs import FinishingPrefill, LayerObserver


@dataclass
class _Pending:
    prompt: FinishingPrefill
    checksums: list[int] = field(default_factory=list)
    streamed: KVDescriptor | None = None


class LayerExporter(LayerObserver):
    """Hashes (and, streaming, publishes) each layer of the prompts a step completes."""

    def __init__(
        self,
        source: KVSource,
        stream: bool = False,
        lease_s: float | None = None,
        lock: threading.Lock | None = None,
        on_stream: Callable[[list[KVDescriptor]], None] | None = None,
        readers: Callable[[str], int] | None = None,
    ):
        """``on_stream`` is given the descriptors each step begins streaming, before
        its forward pass runs: the moment to hand them to the decode side. ``readers``
        says how many sinks will read a request's streamed export (one if not given:
        more when the ranks of a decode TP group each pull their heads of it)."""
        if stream and not source.streams:
            raise ValueError(f"the {source.backend!r} backend cannot stream KV layer by layer")
        self.source = source
        self.stream = stream
        self.lease_s = lease_s
        self._lock = lock or threading.Lock()
        self._on_stream = on_stream
        self._readers = readers or (lambda request_id: 1)
        self._step: list[_Pending] = []
        self._done: dict[str, _Pending] = {}  # hashed (and maybe streamed), not yet exported

    # ---- LayerObserver ------------------------------------------------------
    def step_begins(self, finishing: list[FinishingPrefill]) -> None:
        self._step = [_Pending(p) for p in finishing]
        if not self.stream:
            return
        with self._lock:
            for pending in self._step:
                if self.source.can_stream():
                    p = pending.prompt
                    readers = self._readers(p.request_id)
                    pending.streamed = self.source.begin_export(
                        p.request_id, list(p.block_ids), p.num_kv_tokens, self.lease_s, readers, p.window_from
                    )
        streamed = [p.streamed for p in self._step if p.streamed is not None]
        if streamed and self._on_stream is not None:
            self._on_stream(streamed)

    def step_failed(self) -> None:
        """The step failed part way: its prompts' streamed exports are released (a reader
        learns at once; its request is prefilled again) and their hashes dropped; they
        are exported whole after the step that completes them."""
        step, self._step = self._step, []
        with self._lock:
            for pending in step:
                if pending.streamed is not None:
                    self.source.release(pending.streamed.transfer_id)

    def layer_done(self, layer: int) -> None:
        cache, layout = self.source.cache, self.source.compat.layout
        if self.stream or cache.device.type == "cpu":
            for pending in self._step:
                p = pending.prompt
                checksum = layer_checksum(
                    cache, layer, layout.layer_blocks(layer, p.block_ids, p.window_from), layout
                )
                pending.checksums.append(checksum)
                if pending.streamed is not None:
                    with self._lock:
                        self.source.layer_ready(pending.streamed.transfer_id, layer, checksum)
        if layer == self.source.compat.layout.num_layers - 1:
            self._done.update((p.prompt.request_id, p) for p in self._step)
            self._step = []

    # ---- after the step -------------------------------------------------------
    def export(
        self, request_id: str, block_ids: list[int], num_tokens: int, readers: int = 1, window_from: int = 0
    ) -> KVDescriptor:
        """The export of a prompt this observer saw completed: its streamed descriptor (opened
        for the ``readers`` the constructor's function gave), or a whole export for
        ``readers`` with the checksums taken during prefill (hashed here otherwise);
        ``window_from`` as ``KVSource.export``'s."""
        pending = self._done.pop(request_id, None)
        if pending is not None and (
            list(pending.prompt.block_ids) != list(block_ids)
            or pending.prompt.num_kv_tokens != num_tokens
            or pending.prompt.window_from != window_from
        ):
            raise RuntimeError(f"{request_id}: the blocks exported differ from those prefill wrote")
        if pending is not None and pending.streamed is not None:
            return pending.streamed
        complete = pending is not None and len(pending.checksums) == self.source.compat.layout.num_layers
        checksums = tuple(pending.checksums) if complete else None
        with self._lock:
            return self.source.export(
                request_id, block_ids, num_tokens, self.lease_s, readers, checksums, window_from
            )

    def discard(self, request_id: str) -> None:
        """A prompt that will not be exported: release its streamed export, if any."""
        pending = self._done.pop(request_id, None)
        if pending is not None and pending.streamed is not None:
            with self._lock:
                self.source.release(pending.streamed.transfer_id)
