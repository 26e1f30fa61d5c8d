"""The requests of an engine whose KV moves to or from another engine: the methods
``Engine`` takes from ``KVRequests`` (split out of ``engine.py`` to keep each file
about one thing; they use the engine's request table and helpers, which ``Engine``
defines).

- the prefill half: ``prefilled`` names a PREFILLED request's blocks to export,
  ``release`` frees them;
- prefixes lent and borrowed between workers: ``lend_prefix`` (the holder),
  ``reserve_prefix`` then ``adopt_prefix`` (the borrower);
- the decode half: ``hold_prefix`` (what the decode side has already),
  ``import_request`` (blocks for the rest), ``activate``;
- a running request moving to another engine (live migration): ``suspend`` here
  (its KV then exported as a prefill's is: ``prefilled``, ``release``), and on
  the other engine ``import_request`` with every token it generated, then
  ``activate``: it decodes on from there as if it had never moved. To keep the
  pause short the other engine may first copy its full blocks while it still
  decodes here (pre-copy: ``reserve_moving`` there, ``lend_running`` here,
  ``fill_moving`` there); ``suspend(from_block=...)`` then exports only the blocks
  after those.

Every method validates first and raises ``InvalidRequest`` before touching state.

A sliding-window model's layer groups (``KVLayout.grouped``): a transfer names the
full layers' blocks, then each sliding group's from ``window_from`` on, in one flat
list (``transfer_ids``). A pre-copy copies only blocks no window of the request
will reach again (those before the window of its tokens so far), their full
layers' KV alone; the move sends the rest, the sliding layers' windows with it.
KV that arrives whole (an import, a borrowed prefix) takes sliding blocks only
from its end's window on. A prefix is lent all or nothing: the borrower's ids
name every block it asked for.
"""

from __future__ import annotations

import dataclasses

from splitserve.engine import faults
from splitserve.engine.meaning import check_import
from splitserve.engine.request_state import RequestState
from splitserve.engine.sequence import Sequence, SequenceStatus
from splitserve.wire.errors import (
    AdapterMismatch,
    InvalidRequest,
    MeaningMismatch,
    Overloaded,
    UnknownRequest,
)
from splitserve.wire.faults import HandoffFault
from splitserve.wire.kv import MeaningCheck
from splitserve.wire.outputs import PrefilledRequest
from splitserve.wire.sampling import FinishReason, SamplingParams


class KVRequests:
    """Mixed into ``Engine`` (``self`` is the engine)."""

    # ---- prefill half ------------------------------------------------------
    def prefilled(self, request_id: str) -> PrefilledRequest:
        """A PREFILLED request's KV to export: its blocks after the ``export_from_block``
        its reader holds, the tokens in them, and (a model with sliding windows) the
        first of them whose sliding layers' KV the request still reads as it goes on
        (``KVLayout.window_from``)."""
        seq = self._get(request_id, SequenceStatus.PREFILLED).seq
        skip = seq.export_from_block
        ids, window_from = self.transfer_ids(seq, skip, seq.num_computed_tokens)
        return PrefilledRequest(
            request_id,
            list(seq.prompt_token_ids),
            seq.output_token_ids,
            ids + self.kv_cache.slot_blocks(seq.state_slot),
            seq.num_computed_tokens - skip * self.block_manager.block_size,
            seq.num_cached_tokens,
            window_from,
            seq.lora_digest,
        )

    def transfer_ids(self, seq: Sequence, first: int, kv_tokens: int) -> tuple[list[int], int]:
        """The block ids a transfer of ``seq``'s KV of its first ``kv_tokens`` tokens names,
        from its block ``first`` on, and its ``window_from`` (``KVLayout.window_from``):
        its blocks, and with layer groups each sliding group's from ``window_from`` on
        (``KVLayout.transfer_ids``), which the sequence holds: no window reaches back
        before them."""
        layout = self.kv_cache.layout
        window_from = layout.window_from(first, kv_tokens)
        blocks = seq.block_table[first:]
        if not layout.grouped:
            return blocks, window_from
        if not seq.window_tables:  # a pre-copy's loan: full layers' blocks no window reaches
            return blocks, len(blocks)
        at = first + window_from - seq.window_start
        if at < 0:
            raise RuntimeError(f"{seq.request_id} gave back sliding blocks a transfer of it names")
        return layout.transfer_ids(blocks, [t[at:] for t in seq.window_tables], window_from), window_from

    def release(self, request_id: str) -> None:
        """Free a PREFILLED request's blocks (its KV has been delivered or given up)."""
        self._finish(self._get(request_id, SequenceStatus.PREFILLED), FinishReason.PREFILL_DONE)

    # ---- a running request moving to another engine -----------------------------
    def suspend(self, request_id: str, from_block: int = 0) -> PrefilledRequest:
        """Stop decoding RUNNING request ``request_id`` and hold its KV for another
        engine: it is PREFILLED from here on, ``prefilled`` names its blocks from
        ``from_block`` on (the reader holds those before), and ``release`` (or
        ``abort``) frees them. Its KV covers every token but the last one sampled (the
        next step would have computed that one's); the reader imports the request with
        all its output tokens (``import_request``) and samples the next token as this
        engine would have. Raises ``UnknownRequest`` unless it is RUNNING, and
        ``InvalidRequest`` while its prompt is still being prefilled."""
        state = self._get(request_id, SequenceStatus.RUNNING)
        seq = state.seq
        if not seq.num_output_tokens or seq.num_computed_tokens != seq.num_tokens - 1:
            raise InvalidRequest(f"request {request_id} is still being prefilled: it cannot move yet")
        most = seq.num_computed_tokens // self.block_manager.block_size
        if not 0 <= from_block <= most:
            raise InvalidRequest(f"a reader can hold at most its {most} full blocks, not {from_block}")
        seq.export_from_block = from_block
        self._park_prefilled(state)
        return self.prefilled(request_id)

    def lend_running(
        self, loan_id: str, request_id: str, token_ids: list[int], from_block: int
    ) -> PrefilledRequest | None:
        """Pre-copy, on the engine a request moves from: hold the leading full blocks of
        RUNNING request ``request_id`` whose KV is computed, at most those of
        ``token_ids`` (whole blocks: what the taker expects of it), for loan ``loan_id``
        (PREFILLED from here on, naming those from ``from_block`` on: ``prefilled``);
        the request decodes on (a full block never changes). ``release`` (or ``abort``)
        lets them go. None, holding nothing, when it has no more than ``from_block``.
        Raises ``UnknownRequest`` unless it is RUNNING, ``InvalidRequest`` when its
        tokens are not ``token_ids``."""
        seq, bs = self._get(request_id, SequenceStatus.RUNNING).seq, self.block_manager.block_size
        n = min(len(token_ids) // bs, seq.num_computed_tokens // bs)
        if seq.token_ids[: n * bs] != list(token_ids[: n * bs]):
            raise InvalidRequest(f"request {request_id} here holds other tokens than those asked for")
        if n <= from_block:
            return None
        loan_id = self._new_id(loan_id)
        loan = self._sequence(
            loan_id, seq.token_ids[: n * bs], SamplingParams(max_tokens=1), prefill_only=True
        )
        loan.lora_digest, loan.hash_root = seq.lora_digest, seq.hash_root  # it never runs: no slot
        self.block_manager.share(loan, seq.block_table[:n])
        loan.export_from_block = from_block
        self.requests[loan_id] = state = RequestState(loan, loan.num_tokens)
        self._park_prefilled(state)
        return self.prefilled(loan_id)

    def withdraw(self, request_id: str) -> list[int]:
        """End request ``request_id`` here, in any state but PREFILLED or IMPORTING, to go
        on elsewhere by recompute (the other engine prefills its prompt and these tokens):
        its output tokens so far; its blocks are freed. ``UnknownRequest`` when it is not
        here, or its KV is held for another engine."""
        state = self.requests.get(request_id)
        if state is None or state.seq.status in (SequenceStatus.PREFILLED, SequenceStatus.IMPORTING):
            raise UnknownRequest(f"no running or waiting request with id {request_id!r}")
        outputs = list(state.seq.output_token_ids)
        self.abort(request_id)
        return outputs

    # ---- prefixes lent and borrowed between workers ---------------------------
    def lend_prefix(self, request_id: str, token_ids: list[int], from_block: int) -> PrefilledRequest | None:
        """Hold the leading full blocks of ``token_ids`` this engine has (its cache, then
        its host tier) for request ``request_id``, PREFILLED from here on, naming those
        from ``from_block`` on (``prefilled``) for another worker to copy; ``release``
        (or ``abort``) lets them go. None, holding nothing, when it has no more than
        ``from_block`` of them, or, with layer groups, when it lacks any of them (with
        its windows): it lends all or nothing. Lending computes nothing and counts as
        no reuse here."""
        self._refuse_hybrid()
        request_id = self._new_id(request_id)
        ids = self.validate_request(list(token_ids), SamplingParams(max_tokens=1))
        seq = self._sequence(request_id, ids, SamplingParams(max_tokens=1), prefill_only=True)
        held = self._hold(seq, whole=True, reused=False)
        grouped = self.kv_cache.layout.grouped
        if held <= from_block or (grouped and held < len(ids) // self.block_manager.block_size):
            self.block_manager.free(seq)
            return None
        seq.export_from_block = from_block
        self.requests[request_id] = state = RequestState(seq, seq.num_tokens)
        self._park_prefilled(state)
        # a prefix joins the borrower's cache, for prompts of any length: every layer's whole
        # (layer groups: the sliding groups' windows before its end, all they hold)
        lent = self.prefilled(request_id)
        if not grouped:
            lent = dataclasses.replace(lent, window_from=0)
        self.lent_tokens += lent.num_kv_tokens
        return lent

    def reserve_prefix(self, request_id: str, token_ids: list[int]) -> tuple[int, list[int]]:
        """Before copying the KV of ``token_ids`` (whole blocks, a prompt's prefix) from
        another worker: hold its leading blocks this engine has (cache, host tier) and
        allocate the others, for request ``request_id`` (IMPORTING: never scheduled,
        its blocks never evicted). Returns (blocks held, the ids a transfer of the
        others names: ``transfer_ids``, to fill in order). Then ``adopt_prefix``, or
        ``abort`` to free them all. Raises
        ``Overloaded`` (holding nothing) when the cache has no room now."""
        self._refuse_hybrid()
        request_id = self._new_id(request_id)
        ids = self.validate_request(list(token_ids), SamplingParams(max_tokens=1))
        if len(ids) % self.block_manager.block_size:
            raise InvalidRequest(f"a prefix of {len(ids)} tokens is not a whole number of blocks")
        seq = self._sequence(request_id, ids, SamplingParams(max_tokens=1))
        held = self._hold(seq, whole=True, reused=False)  # the prompt added next counts them
        missing = len(ids) - seq.num_computed_tokens
        if not self.block_manager.can_allocate(seq, missing, arriving=True):
            self.block_manager.free(seq)
            raise Overloaded(f"not enough free KV blocks for a {missing}-token prefix")
        self.block_manager.allocate(seq, missing, arriving=True)
        seq.status = SequenceStatus.IMPORTING
        self.requests[request_id] = RequestState(seq, seq.num_tokens)
        return held, self.transfer_ids(seq, held, len(ids))[0]

    def adopt_prefix(self, request_id: str, num_blocks: int) -> int:
        """The first ``num_blocks`` blocks of a prefix ``reserve_prefix`` made hold their
        KV now (held here, or copied in and verified): they join the prefix cache (a
        prompt starting with them, added next, takes them), and the request ends,
        freeing its blocks. Returns the tokens copied in (those not held before)."""
        state = self._get(request_id, SequenceStatus.IMPORTING)
        seq, bs = state.seq, self.block_manager.block_size
        if not 0 <= num_blocks <= len(seq.block_table):
            raise InvalidRequest(f"{request_id} reserved {len(seq.block_table)} blocks, not {num_blocks}")
        copied = max(0, num_blocks * bs - seq.num_computed_tokens)
        seq.num_computed_tokens = num_blocks * bs
        self.block_manager.commit_computed(seq)
        self.pulled_tokens += copied
        self._finish(state, FinishReason.ABORT)
        return copied

    # ---- decode half -------------------------------------------------------
    def hold_prefix(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Before asking for the KV of ``prompt_token_ids`` from elsewhere: take the
        prompt's leading full blocks this engine holds (its cache, then its host tier,
        reloaded now) for request ``request_id``, which is IMPORTING from here on, holding
        them (never evicted) until ``import_request`` adds the rest, or ``abort``. Returns
        the tokens held, a whole number of blocks (0: none; no request is made). Never
        the block of the prompt's last token: its KV always comes from the prefill."""
        request_id = self._new_id(request_id)
        prompt_ids = self.validate_request(list(prompt_token_ids), params)
        seq = self._sequence(request_id, prompt_ids, params)
        if not self._hold(seq):
            return 0
        seq.status, seq.awaiting_import = SequenceStatus.IMPORTING, True
        self.requests[request_id] = RequestState(seq, seq.num_tokens)
        return seq.num_computed_tokens

    def reserve_moving(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
    ) -> tuple[int, list[int]]:
        """Pre-copy, before a running request moves here from another engine while it still
        decodes there: for ``request_id`` (IMPORTING from here on: never scheduled, its
        blocks never evicted) hold the leading full blocks of its tokens so far (the
        prompt, then ``output_token_ids``; every full block but the one of the last
        token, whose KV the other engine has not computed yet) that this engine has (its
        cache, its host tier), and allocate the others. Returns (blocks held, the ids of
        the others, to fill in order with KV copied from the other engine). Then
        ``fill_moving``, and at the move ``import_request`` with every token it generated
        by then: only the blocks after the filled ones are left to copy. ``abort`` frees
        them. A stale copy of the same request (copied ahead of a move that failed) is
        dropped first. Raises ``InvalidRequest`` (holding nothing) for a request with less
        than one full block to copy, ``Overloaded`` when the cache has no room now."""
        stale = self.requests.get(request_id)
        if stale is not None and stale.seq.awaiting_import:
            self.abort(request_id)
        request_id = self._new_id(request_id)
        prompt_ids = self.validate_request(list(prompt_token_ids), params)
        outputs = list(output_token_ids)
        if not outputs or len(outputs) >= params.max_tokens:
            raise InvalidRequest(
                f"{len(outputs)} tokens generated: not a running request of max_tokens {params.max_tokens}"
            )
        seq = self._sequence(request_id, prompt_ids, params)
        for t in outputs:
            seq.append_token(t)
        bm, grouped = self.block_manager, self.kv_cache.layout.grouped
        full = bm.reusable_blocks(seq)  # the blocks before the last token's
        if grouped:  # only those no window reaches again: their full layers' KV is all that moves
            full = min(full, bm.window_start(full * bm.block_size))
        if not full:
            raise InvalidRequest(f"request {request_id} has no full block of KV to copy yet")
        held = self._hold(seq, reused=False)
        missing = max(0, full * bm.block_size - seq.num_computed_tokens)
        if not bm.can_allocate(seq, missing, full_only=grouped):
            bm.free(seq)
            raise Overloaded(f"not enough free KV blocks to copy {missing} tokens of a moving request")
        bm.allocate(seq, missing, full_only=grouped)
        seq.status, seq.awaiting_import = SequenceStatus.IMPORTING, True
        self.requests[request_id] = RequestState(seq, seq.num_tokens)
        return held, list(seq.block_table[held:])

    def locate(self, blocks: list[int]) -> tuple[int, list[int]]:
        """Under expert parallelism (each rank caches its own sequences): the rank whose
        share of the cache holds one sequence's ``blocks``, and their ids within it.
        Safe from any thread (arithmetic on values fixed at construction)."""
        return self.block_manager.locate(blocks)

    def fill_moving(self, request_id: str, num_blocks: int, adapter_digest: str | None = None) -> int:
        """The first ``num_blocks`` blocks ``reserve_moving`` made for ``request_id`` hold
        their KV now (held here, or copied in and verified); the others stay allocated for
        the move to fill. Returns the tokens copied in (counted as moved in).
        ``adapter_digest``: as ``activate``'s (``AdapterMismatch``, nothing changed)."""
        state = self._get(request_id, SequenceStatus.IMPORTING)
        seq, bs = state.seq, self.block_manager.block_size
        _check_adapter(seq, adapter_digest)
        held = seq.num_computed_tokens // bs
        if not seq.awaiting_import or not held <= num_blocks <= len(seq.block_table):
            raise InvalidRequest(
                f"{request_id} holds {held} of {len(seq.block_table)} reserved blocks, not {num_blocks}"
            )
        copied = (num_blocks - held) * bs
        seq.num_computed_tokens = num_blocks * bs
        if num_blocks > held:  # a grouped layout's pre-copy brings no sliding KV at all
            self._mark_partial(seq, held, sliding=not self.kv_cache.layout.grouped)
        self.block_manager.commit_computed(seq)
        self.import_moved_tokens += copied
        self.precopied_tokens += copied
        return copied

    def _refuse_hybrid(self) -> None:
        """``InvalidRequest`` for a hybrid model (linear-attention layers): it caches no
        prefix (a prefix would need its state), so it neither lends nor borrows one."""
        if self.kv_cache.states:
            raise InvalidRequest(
                "this model caches no prompt prefixes (its linear layers' state): none to lend"
            )

    def _mark_partial(self, seq: Sequence, first_copied: int, sliding: bool = True) -> None:
        """The blocks of ``seq`` from ``first_copied`` on are copied in from another engine,
        whose sliding layers' KV came only from ``KVLayout.window_from`` on (what the
        other engine sends), or with ``sliding`` false not at all: none of them is to be
        a cached prefix. The same rule as the sender's, at the sequence's KV now, which
        is never shorter than the sender's."""
        if not sliding or self.kv_cache.layout.window_from(first_copied, seq.num_computed_tokens):
            held = seq.partial_from
            seq.partial_from = first_copied if held is None else min(held, first_copied)

    def _hold(self, seq: Sequence, whole: bool = False, reused: bool = True) -> int:
        """Give the fresh ``seq`` the leading blocks of its tokens this engine holds:
        its cache's, then its host tier's (reloaded now, where free blocks allow), up to
        ``BlockManager.reusable_blocks(seq, whole)``. Returns the blocks it holds;
        ``reused``: they count as prompt tokens reused (``stats``)."""
        bm = self.block_manager
        cached = bm.find_cached_prefix(seq, whole)
        tiered = bm.tier_prefix(seq, cached, whole)
        if not bm.can_allocate(seq, tiered * bm.block_size, cached):
            tiered = 0  # the reloads need free blocks; the cached ones do not
        if cached:
            bm.take_cached_prefix(seq, cached, reused)
        if tiered:
            bm.reload(seq, tiered, reused)
        return len(seq.block_table)

    def import_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
    ) -> list[int]:
        """Allocate blocks for KV computed elsewhere: of ``prompt_token_ids`` and of
        every token of ``output_token_ids`` but the last (after the blocks
        ``hold_prefix`` holds for it, if it held any).

        Returns the block ids to fill (in order; the last may be partial): after the
        held ones. A request ``hold_prefix`` made keeps the sequence (and ``params``)
        it was held with; ``prompt_token_ids`` must be the same prompt. Raises
        ``Overloaded`` if the cache has no room now (what was held stays held). The
        request stays IMPORTING until ``activate`` (or ``abort``, which frees the
        blocks). ``output_token_ids`` is the first token the prefill side sampled (a
        handoff; it may be empty when the KV starts moving before prefill ends, and
        then comes with ``activate``), or every token a running request generated on
        the engine it moves from (``suspend``): they count toward ``max_tokens``, the
        stop checks and the grammar, are never emitted again, and seeded sampling
        goes on after them."""
        held = self.requests.get(request_id)
        if held is not None and held.seq.status == SequenceStatus.IMPORTING and held.seq.awaiting_import:
            seq = held.seq  # held by hold_prefix or reserve_moving: their tokens lead these
            given = list(prompt_token_ids) + list(output_token_ids)
            if given[: seq.num_tokens] != seq.token_ids or list(prompt_token_ids) != seq.prompt_token_ids:
                raise InvalidRequest(f"request {request_id} holds the KV of other tokens")
            outputs = list(output_token_ids)[seq.num_output_tokens :]
        else:
            request_id = self._new_id(request_id)
            prompt_ids = self.validate_request(list(prompt_token_ids), params)
            seq = self._sequence(request_id, prompt_ids, params)
            outputs = list(output_token_ids)
        generated = seq.num_output_tokens + len(outputs)
        if generated >= seq.params.max_tokens:
            raise InvalidRequest(
                f"{generated} tokens already generated; max_tokens is {seq.params.max_tokens}"
            )
        if seq.num_prompt_tokens + generated >= self.max_model_len:
            raise InvalidRequest(
                f"{seq.num_prompt_tokens} prompt and {generated} generated tokens leave no room in "
                f"{self.max_model_len}"
            )
        have, total = seq.num_computed_tokens, seq.num_prompt_tokens + max(0, generated - 1)
        if not self.block_manager.can_allocate(seq, total - have, arriving=True):
            raise Overloaded(f"not enough free KV blocks for {total - have} tokens")
        self._bind_or_overloaded(seq)  # its LoRA adapter's slot, as its blocks
        self.block_manager.allocate(seq, total - have, arriving=True)
        for t in outputs:
            seq.append_token(t)
        seq.num_computed_tokens = total
        self._mark_partial(seq, have // self.block_manager.block_size)
        if self.block_manager.states is not None:  # its state comes with the KV, not a snapshot
            self.block_manager.states.started(seq)
        seq.status, seq.awaiting_import = SequenceStatus.IMPORTING, False
        self.import_held_tokens += seq.num_cached_tokens
        self.import_moved_tokens += total - have
        self.requests[request_id] = RequestState(seq, seq.num_tokens)
        ids, _ = self.transfer_ids(seq, have // self.block_manager.block_size, total)
        return ids + self.kv_cache.slot_blocks(seq.state_slot)

    def verify_import(self, request_id: str, output_token_ids: list[int] | None = None) -> MeaningCheck:
        """Check the KV of an IMPORTING request, in place, by meaning (``engine.meaning``),
        its first token the one it has or the first of ``output_token_ids`` (what
        ``activate`` will bring; none: the K/V alone are checked). Returns the check; one
        that fails raises ``MeaningMismatch`` (the request stays IMPORTING: ``abort``
        frees it)."""
        seq = self._get(request_id, SequenceStatus.IMPORTING).seq
        first = seq.token_ids[seq.num_prompt_tokens] if seq.num_output_tokens else None
        if first is None and output_token_ids:
            first = output_token_ids[0]
        check = check_import(seq, first, self.kv_cache, self.runner, self.block_manager.block_size)
        self.meaning_checks["skipped" if check.skipped else "ok" if check.ok else "mismatch"] += 1
        if not check.ok:
            error = MeaningMismatch(f"the KV of request {request_id} failed its check: {check.describe()}")
            error.check = check
            raise error
        return check

    def inject_fault(self, request_id: str, fault: HandoffFault) -> None:
        """A harness's fault (``wire.faults``) applied to the KV this engine holds for
        ``request_id`` (``engine.faults``): a PREFILLED request's exported blocks, or an
        IMPORTING request's blocks, all of them. Those blocks leave the prefix cache first, so
        no later request is served the fault. ``ValueError`` where another request holds one
        of them too (nothing changed), or where the cache cannot have the fault (nothing
        written; the blocks are out of the prefix cache, computed again when next asked)."""
        state = self.requests.get(request_id)
        status = None if state is None else state.seq.status
        if status is SequenceStatus.PREFILLED:
            blocks = self.prefilled(request_id).block_ids
        elif status is SequenceStatus.IMPORTING:
            blocks = list(state.seq.block_table)
        else:
            raise UnknownRequest(f"no exported or importing request with id {request_id!r}")
        mla = self.model_config.mla
        self.block_manager.uncache(blocks)  # the fault stays this request's (ValueError if shared)
        faults.inject(fault, self.kv_cache, blocks, None if mla is None else mla.qk_rope_head_dim)

    def activate(
        self, request_id: str, output_token_ids: list[int] | None = None, adapter_digest: str | None = None
    ) -> None:
        """The KV of an IMPORTING request is in place: start decoding it. The first
        sampled token comes here if ``import_request`` did not have it. ``adapter_digest``:
        the LoRA adapter its KV was computed under ("" the base model; None: not known):
        ``AdapterMismatch`` (nothing changed) unless it is the one the request runs under
        here, as after an adapter was loaded again with other weights on one side."""
        state = self._get(request_id, SequenceStatus.IMPORTING)
        seq = state.seq
        _check_adapter(seq, adapter_digest)
        if output_token_ids:
            if seq.num_output_tokens:
                raise InvalidRequest(f"request {request_id} already has its first token")
            for t in output_token_ids:
                seq.append_token(t)
            self.requests[request_id] = state = RequestState(seq, seq.num_tokens)
        if not seq.num_output_tokens:
            raise InvalidRequest("an imported request needs its first sampled token")
        self.block_manager.commit_computed(state.seq)
        self.scheduler.add_running(state.seq)


def _check_adapter(seq: Sequence, adapter_digest: str | None) -> None:
    """``AdapterMismatch`` unless KV computed under ``adapter_digest`` (None: not known)
    is ``seq``'s: of the LoRA adapter it runs under here (``KVHandoff.adapter_digest``)."""
    if adapter_digest is not None and adapter_digest != seq.lora_digest:
        raise AdapterMismatch(
            f"the KV of request {seq.request_id} was computed under "
            f"{_adapter_named(adapter_digest, seq.params.adapter)}, but it runs here under "
            f"{_adapter_named(seq.lora_digest, seq.params.adapter)}: it is not used"
        )


def _adapter_named(digest: str, name: str | None) -> str:
    return f"LoRA adapter {name!r} with weights {digest}" if digest else "the base model"
