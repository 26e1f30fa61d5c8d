"""Faults a harness injects into one handoff, to show each one caught
(``bench.handoff_faults``, ``tests/integration/test_handoff_faults.py``): the faults that
disaggregated serving has shipped to users as wrong answers with HTTP 200.

A worker takes a fault for a request it has not seen yet (``arm_fault`` on a prefill or
a decode worker) and injects it once, where such a bug would strike:

- at the **source**, after the export hashed the KV and before the pull: the bytes
  change (``SOURCE_BYTES_CHANGED``), or a block is written by another request
  (``SOURCE_BLOCK_REUSED``). The transfer's checksums catch these;
- at the **pull**: it starts after its lease ended (``PULL_AFTER_LEASE``); the lease
  check catches it;
- at the **sink**, once the KV landed with the source's bytes and passed their
  checksums: right bytes in the wrong place, what only the meaning check
  (``engine.meaning``) sees.

Nothing here runs unless a harness arms it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from splitserve.wire.errors import InvalidRequest

log = logging.getLogger(__name__)


class HandoffFault(enum.Enum):
    SOURCE_BYTES_CHANGED = "source bytes changed after hashing"
    SOURCE_BLOCK_REUSED = "a source block reused before the pull"
    PULL_AFTER_LEASE = "a pull that starts after its lease ended"
    BLOCK_TABLE_PERMUTED = "the decode block table permuted (first and last swapped)"
    LAYERS_SWAPPED = "two layers swapped"
    KV_HEADS_SWAPPED = "two KV heads swapped"
    K_AND_V_SWAPPED = "K and V swapped"
    FP8_SCALES_SWAPPED = "FP8 scales of two layers swapped"
    PREFIX_BLOCK_OTHER_TOKENS = "a prefix block credited to other tokens"
    MLA_PARTS_SWAPPED = "the MLA latent and rope parts swapped"

    @property
    def side(self) -> str:
        """Where it is injected: "source" (the prefill worker's engine, after its export),
        "pull" (the decode worker's pull) or "sink" (the decode worker's engine, before
        the meaning check)."""
        if self in (HandoffFault.SOURCE_BYTES_CHANGED, HandoffFault.SOURCE_BLOCK_REUSED):
            return "source"
        return "pull" if self is HandoffFault.PULL_AFTER_LEASE else "sink"


@dataclass(frozen=True)
class ArmedFault:
    """Inject ``fault`` into the handoff of ``request_id`` (once)."""

    request_id: str
    fault: HandoffFault


class ArmedFaults:
    """A worker's armed faults, each taken once by the request it names."""

    def __init__(self, worker_id: str, sides: tuple[str, ...]) -> None:
        """``sides``: where this worker injects (``HandoffFault.side``)."""
        self.worker_id, self.sides = worker_id, sides
        self._armed: dict[str, HandoffFault] = {}

    def arm(self, armed: ArmedFault) -> None:
        """``InvalidRequest`` for a fault another kind of worker injects."""
        if armed.fault.side not in self.sides:
            raise InvalidRequest(
                f"{self.worker_id} injects faults at the {' and '.join(self.sides)}; "
                f"{armed.fault.name} strikes at the {armed.fault.side}"
            )
        self._armed[armed.request_id] = armed.fault

    @contextlib.contextmanager
    def injecting(self, request_id: str, fault: HandoffFault) -> Iterator[None]:
        """Around the injection (a call or an await): a fault that cannot apply
        (``ValueError``: this cache cannot have it, or its blocks are shared) is logged and
        the request goes on unharmed: the harness sees it not caught."""
        try:
            yield
        except ValueError as e:
            log.warning(
                "%s: fault %s not injected into request %s: %s", self.worker_id, fault.name, request_id, e
            )

    def take(self, request_id: str, side: str) -> HandoffFault | None:
        """The fault armed for ``request_id`` on ``side``, disarmed; None if there is none."""
        fault = self._armed.get(request_id)
        if fault is None or fault.side != side:
            return None
        return self._armed.pop(request_id)
