"""The requests of an engine under LoRA adapters: the methods ``Engine`` takes from
``LoRARequests`` (split out of ``engine.py`` as ``kv_requests`` is; they use the
engine's request table, runner and ``loras``, which ``Engine`` defines).

An adapter is served (``load_adapter``, or ``lora_modules`` at start) before a request
may name it, and it may be served while no slot holds it: ``max_loras`` slots hold the
adapters of one step, ``max_cpu_loras`` host copies the adapters read lately, and any
number are served. A request takes its adapter's digest as it is added (the weights it
runs under to its end: ``Sequence.lora_digest``) and a slot as it is scheduled
(``bind_lora``, the scheduler's ``ready``): the slot holding those weights, else one
no request holds, written then on every rank (from the host copy, or read again from
its path), else none: it waits, the base model's requests behind it go first, and
those under adapters wait behind it (none joins a held slot ahead of it: the slots
drain, so it cannot starve). A request keeps
its slot until it ends, preempted too. So an adapter unloaded, or loaded again under
its name, never changes what a running request computes; other weights under a name
are refused while requests under the earlier ones run (``LoRAAdapters.serve``).
A request taken in from another engine (an import) takes its slot as its blocks are
allocated: ``LoRASlotsBusy`` while none is free (the decode worker's admission queue
then tries the requests behind it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from splitserve.engine.lora import Key, LoRAAdapters
from splitserve.engine.sequence import Sequence
from splitserve.wire.errors import (
    InvalidRequest,
    LoRASlotsBusy,
    ModelLoadError,
    SequenceFailed,
    UnknownRequest,
)

if TYPE_CHECKING:
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.request_state import RequestState
    from splitserve.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class LoRARequests:
    loras: LoRAAdapters | None
    requests: dict[str, RequestState]
    runner: ModelRunner
    scheduler: Scheduler
    _busy: set[int] | None = None  # the slots requests hold, this schedule (``_busy_slots``)

    # ---- the scheduler's side (``Engine.step_tokens``) --------------------------------
    def _init_lora_scheduling(self) -> None:
        """With adapters, the scheduler takes a waiting request only once it has a slot."""
        self._slot_waited = False  # a request waited for a slot in this schedule
        self._unbound: list[tuple[Sequence, SequenceFailed]] = []  # whose adapter no slot could take
        if self.loras is not None:
            self.scheduler.ready = self._lora_ready

    def _begin_lora_schedule(self) -> None:
        """Before each schedule: the slots held are found again if needed, none waited yet."""
        self._busy, self._slot_waited = None, False

    def _end_lora_schedule(self) -> list[tuple[Sequence, SequenceFailed]]:
        """After each schedule: the requests whose adapter no slot could take (its files
        changed or are gone), each with its error; the caller fails them alone."""
        unbound, self._unbound = self._unbound, []
        return unbound

    def _lora_ready(self, seq: Sequence) -> bool:
        """The scheduler's ``ready``: ``bind_lora``, in the waiting queue's order: once one
        request waits for a slot, the adapter requests after it wait too (none joins a
        held slot ahead of it, so the slots drain and it cannot starve); the base's go
        on. A request whose adapter no slot can take waits to fail alone after the
        schedule (``_end_lora_schedule``)."""
        if seq.lora_slot is not None or seq.params.adapter is None:
            return True
        if self._slot_waited:
            return False
        try:
            self._slot_waited = not self.bind_lora(seq)
            return not self._slot_waited
        except ModelLoadError as e:
            if all(s is not seq for s, _ in self._unbound):
                self._unbound.append(
                    (seq, SequenceFailed("lora", f"its LoRA adapter could not be loaded: {e}"))
                )
            return False

    # ---- adapters served ----------------------------------------------------------

    def load_adapter(self, name: str, path: str) -> str:
        """Serve LoRA adapter ``name`` from ``path`` (a PEFT directory every rank of the
        group can read) to the requests added from here on; returns its digest
        (``LoRAAdapter.digest``). Every rank checks that its share fits its model, or
        the adapter is served nowhere: ``ModelLoadError`` with the first refusal's
        sentence (a name served with other weights, or unloaded with other weights that
        requests still run under, a file this engine cannot run); the same weights
        under a name served already change nothing. ``InvalidRequest`` when this engine
        has LoRA off. Driver only, between steps (the other ranks check as they follow)."""
        loras = self._lora_adapters()
        adapter = loras.read(name, path)
        if loras.served.get(name) == adapter.digest:
            return adapter.digest
        needed = self._adapters_needed()
        loras.check_new(name, adapter.digest, needed)
        self.runner.write_adapter(name, str(path), None, adapter)  # every rank: its share fits
        loras.serve(name, str(path), adapter, needed)
        log.info("LoRA adapter %r (%s) loaded from %s", name, adapter.digest, path)
        return adapter.digest

    def unload_adapter(self, name: str) -> None:
        """Serve LoRA adapter ``name`` to no new request (``InvalidRequest`` if it is not
        served here). The requests that run under it finish under it."""
        loras = self._lora_adapters()
        if name not in loras.served:
            raise InvalidRequest(f"no LoRA adapter named {name!r} is loaded here")
        loras.unserve(name)

    def adapter_digest(self, request_id: str) -> str:
        """The digest of the LoRA adapter ``request_id`` runs under ("" for the base model):
        its KV's identity beside the weights' revision (``wire.kv.KVHandoff``)."""
        state = self.requests.get(request_id)
        if state is None:
            raise UnknownRequest(f"no request with id {request_id!r}")
        return state.seq.lora_digest

    def bind_lora(self, seq: Sequence) -> bool:
        """Whether ``seq`` may run now (see the module docstring), taking its slot where it
        has none. ``ModelLoadError`` when its adapter's slot could not be written (its
        files changed or are gone): the slot is left empty."""
        if seq.lora_slot is not None or seq.params.adapter is None:
            return True
        loras = self.loras
        key: Key = (seq.params.adapter, seq.lora_digest)
        found = loras.slot_for(key, self._busy_slots)
        if found is None:
            return False
        slot, written = found
        if not written:
            path, adapter = loras.source(key)
            if adapter is None:  # its host copy was dropped: read again, and kept
                adapter = loras.read(key[0], path)
                if adapter.digest != key[1]:
                    raise ModelLoadError(
                        f"the files of LoRA adapter {key[0]!r} at {path} changed since it was loaded"
                    )
                loras.keep(key, path, adapter, self._adapters_needed())
            try:
                self.runner.write_adapter(key[0], path, slot, adapter)
            except ModelLoadError:
                loras.forget(slot)  # some rank may have written part of it
                raise
        seq.lora_slot = slot
        if self._busy is not None:
            self._busy.add(slot)
        return True

    def _busy_slots(self) -> set[int]:
        """The slots requests hold: found once per schedule (``Engine.step_tokens`` forgets
        it before each; a slot freed since counts as held until then, never the reverse)."""
        if self._busy is None:
            self._busy = {st.seq.lora_slot for st in self.requests.values()} - {None}
        return self._busy

    def _bind_or_overloaded(self, seq: Sequence) -> None:
        """``bind_lora`` for a request taken in from another engine: ``LoRASlotsBusy`` (an
        ``Overloaded``) while every slot is held (``SequenceFailed`` where its adapter
        cannot be written)."""
        self._busy = None
        try:
            if self.bind_lora(seq):
                return
        except ModelLoadError as e:
            raise SequenceFailed("lora", f"its LoRA adapter could not be put in a slot: {e}") from None
        raise LoRASlotsBusy(
            f"every LoRA slot ({self.loras.max_loras}, max_loras) is in use by running requests"
        )

    def _adapters_needed(self) -> set[Key]:
        """The adapters (name, digest) of every request this engine holds."""
        return {
            (st.seq.params.adapter, st.seq.lora_digest) for st in self.requests.values() if st.seq.lora_digest
        }

    def _lora_adapters(self) -> LoRAAdapters:
        if self.loras is None:
            raise InvalidRequest("LoRA adapters are not enabled on this engine (enable_lora)")
        return self.loras
