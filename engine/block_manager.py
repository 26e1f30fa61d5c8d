"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, reference counts and
prefix caching. No torch: block ids index the tensors that ``kv_cache`` owns.

Layout of one sequence over its block table (block_size = 4)::

    token_ids      t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    block_table    [   17      |    4        |  9   ]   <- last block partly filled
    hashes         [   h0      |    h1       ]          <- only full blocks are hashed

Prefix caching: a full block is identified by ``block_hash(parent_hash, its
tokens)`` (``wire.prefix``: a named hash, the same in every process), so
equal content after a different prefix never matches. When a block's last
token has been computed its hash is registered; a later sequence whose prompt
starts with the same tokens takes a reference to the block instead of computing
it again. Freed blocks keep their hash and stay findable until the allocator
reuses them, least recently freed first (LRU eviction). The block holding a
prompt's last token is never taken from the cache, so every prompt computes at
least one token (its logits give the first output token) and never writes into
a shared block.

Every hash registered or dropped is written to ``prefix_log``, which a router
follows to know which prefixes this cache holds.

A host tier below the cache (``tier``, ``engine.kv_tier``; single shard only): an
evicted block's bytes are saved there by hash before the block is reused, and a
waiting prompt whose next full blocks are missing from the cache but held by the
tier gets fresh blocks loaded from it (``tier_prefix`` then ``reload``) instead of
computing them. The log keeps a hash while either tier holds it.

Sliding windows: a block whose sliding layers' KV was never brought in (a request
imported from another engine without the keys out of its windows:
``Sequence.partial_from``) would give a later prompt wrong keys as a cached
prefix, so ``commit_computed`` registers no block of that sequence from there on.

Layer groups (a sliding-window model, ``KVLayout.grouped``): besides its
``block_table`` (the full layers' blocks) a sequence holds one table per group of
sliding layers (``Sequence.window_tables``), of the blocks from ``window_start`` on:
those a sliding layer still reads (``window_start``: a query at position p reads
keys from p - window + 1). Every step's end gives back the older ones
(``commit_computed``), so a sliding layer holds at most its window and one block
per sequence. Each group's full, computed blocks are registered by the same hash
chain as the full ones (a block is in one group at a time, and its group's table of
hashes names it); a cached prefix of n blocks is taken only with every group's
blocks of the window before position n (``find_cached_prefix``), which stay
findable once given back, until reused. No host tier and no state slots with them.

A hybrid model (linear-attention layers beside full ones, ``engine.model.deltanet``)
keeps each sequence's linear layers' memory in state slots, not in blocks
(``engine.state_slots``): with ``states`` every sequence that holds blocks holds
its slots too, taken by ``allocate`` and given back by ``free``, and
``can_allocate`` is False while they cannot be had. A cached prefix of such a
model is found only up to a block whose state snapshot is kept, and a sequence
that takes it starts from that snapshot.

Ownership: the sequence holds one reference per entry in its block table;
``free`` drops them all. A block returns to the free pool when its count is 0.

Shards (expert parallelism, attention data-parallel): with ``shards`` > 1 the
block ids are split evenly, shard s owning [s * shard_blocks, (s + 1) * shard_blocks)
(rank s of the group holds them in its own cache), and all of one sequence's
blocks come from one shard, its home: the shard of the cached prefix it takes, or
else the one with the most free blocks, chosen when it gets its first block and
kept until it frees them. A cached prefix is only taken within one shard.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from splitserve.engine.sequence import Sequence
from splitserve.engine.state_slots import StateSlots
from splitserve.wire.prefix import PrefixCursor, PrefixLog, PrefixUpdate, block_hash


class KVTier(Protocol):
    """A store of evicted blocks by hash (``engine.kv_tier.HostKVTier``)."""

    def holds(self, h: int, tokens: tuple[int, ...]) -> bool: ...
    def save(self, h: int, tokens: tuple[int, ...], block: int) -> list[int]: ...
    def load(self, h: int, block: int) -> bool: ...
    def hashes(self) -> list[int]: ...
    def __contains__(self, h: int) -> bool: ...


class BlockManager:
    """Allocates KV blocks to sequences. Check with ``can_*``, then act."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        shards: int = 1,
        tier: KVTier | None = None,
        states: StateSlots | None = None,
        window: int = 0,
        window_groups: int = 0,
    ):
        if num_blocks < 1 or block_size < 1 or shards < 1:
            raise ValueError("num_blocks, block_size and shards must be positive")
        if window_groups and (tier is not None or states is not None or window < 1):
            raise ValueError("sliding layer groups need a window, and go without a host tier or state slots")
        if states is not None and (shards > 1 or tier is not None):
            raise ValueError("a hybrid model's state slots go with one shard and no host tier")
        if num_blocks % shards:
            raise ValueError(f"{num_blocks} blocks do not split evenly into {shards} shards")
        if tier is not None and (shards > 1 or not enable_prefix_caching):
            raise ValueError("a host KV tier needs prefix caching and one shard")
        self.num_blocks = num_blocks
        self.shards = shards
        self.shard_blocks = num_blocks // shards  # the most one sequence can hold
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Free blocks of each shard in eviction order (oldest freed first); values unused.
        per = self.shard_blocks
        self._free: list[OrderedDict[int, None]] = [
            OrderedDict((b, None) for b in range(s * per, (s + 1) * per)) for s in range(shards)
        ]
        # Per-sequence chain of hashes of its full, computed blocks.
        self._seq_hashes: dict[int, list[int]] = {}
        self.prefix_hits = 0  # tokens served from the cache since start (a metric)
        self.tier = tier
        self.tier_hits = 0  # tokens reloaded from the tier since start (a metric)
        self.prefix_log = PrefixLog()
        self.states = states  # a hybrid model's state slots and snapshots
        # layer groups: the widest sliding window (tokens), the sliding groups, each group's
        # registered blocks by hash, and the group whose hash each block holds (0: the full one)
        self.window = window
        self.window_groups = window_groups
        self._window_hashes: list[dict[int, int]] = [{} for _ in range(window_groups)]
        self.block_group = [0] * num_blocks if window_groups else []

    # ---- queries -----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return sum(len(f) for f in self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def shard_of(self, block: int) -> int:
        return block // self.shard_blocks

    def home(self, seq: Sequence, cached: list[int] = ()) -> int:
        """The shard ``seq``'s blocks are (or will be) in: that of its first block, or of
        ``cached``, or else the shard with the most free blocks (the first of those)."""
        if seq.block_table:
            return self.shard_of(seq.block_table[0])
        if cached:
            return self.shard_of(cached[0])
        return max(range(self.shards), key=lambda s: len(self._free[s]))

    def locate(self, blocks: list[int]) -> tuple[int, list[int]]:
        """(shard, the blocks' ids within it) of one sequence's ``blocks``. Arithmetic on
        values fixed at construction: safe from any thread (the block manager is not)."""
        shard = self.shard_of(blocks[0])
        base = shard * self.shard_blocks
        return shard, [b - base for b in blocks]

    def prefix_update(self, cursor: PrefixCursor | None) -> PrefixUpdate:
        """The registered hashes that changed since ``cursor`` (``wire.prefix``)."""
        held = self.hash_to_block if self.tier is None else {*self.hash_to_block, *self.tier.hashes()}
        return self.prefix_log.since(cursor, held)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def window_start(self, computed: int) -> int:
        """The first block a sliding layer reads again once a sequence's first ``computed``
        tokens have their KV: the next query, at position ``computed``, reaches back to
        the key at ``computed - window + 1`` (``KVLayout.window_from``)."""
        return max(0, computed - self.window + 1) // self.block_size

    def reusable_blocks(self, seq: Sequence, whole: bool = False) -> int:
        """How many of ``seq``'s leading full blocks a cache may give it: those before
        the block of its last token (whose logits it must compute), or with ``whole``
        every full block (a prefix lent or borrowed as KV, computing nothing)."""
        return (seq.num_tokens if whole else seq.num_tokens - 1) // self.block_size

    def find_cached_prefix(self, seq: Sequence, whole: bool = False) -> list[int]:
        """Block ids that hold a prefix of ``seq``'s tokens (no references taken), at
        most ``reusable_blocks(seq, whole)``."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        found: list[int] = []
        parent = seq.hash_root
        bs = self.block_size
        for i in range(self.reusable_blocks(seq, whole)):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            if found and self.shard_of(block) != self.shard_of(found[0]):
                break  # a sequence's blocks are in one shard
            found.append(block)
            parent = h
        if self.states is not None:  # a hybrid model's: only up to a block with a state snapshot
            found = found[: self.states.snapshot_prefix([self.block_hashes[b] for b in found])]
        while found and self.window_groups and self._window_prefix(found) is None:
            found.pop()  # each sliding group's blocks of the window before it are needed too
        return found

    def _window_prefix(self, found: list[int]) -> list[list[int]] | None:
        """Each sliding group's blocks of the window before the prefix ``found`` (cached
        full blocks, from the first), by the same hashes, in the same shard; None when
        one of them is not cached."""
        n = len(found)
        shard = self.shard_of(found[0]) if found else 0
        out = []
        for hashes in self._window_hashes:
            ids = []
            for b in found[self.window_start(n * self.block_size) : n]:
                w = hashes.get(self.block_hashes[b])
                if w is None or self.block_tokens[w] != self.block_tokens[b] or self.shard_of(w) != shard:
                    return None
                ids.append(w)
            out.append(ids)
        return out

    def tier_prefix(self, seq: Sequence, cached: list[int], whole: bool = False) -> int:
        """How many full blocks of ``seq``'s prompt right after ``cached`` (what
        ``find_cached_prefix`` found) the tier holds, up to ``reusable_blocks(seq,
        whole)``; 0 without a tier."""
        if self.tier is None or seq.params.prompt_logprobs is not None:  # a tier implies prefix caching
            return 0
        parent = self.block_hashes[cached[-1]] if cached else seq.hash_root
        bs, n = self.block_size, 0
        for i in range(len(cached), self.reusable_blocks(seq, whole)):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = block_hash(parent, tokens)
            if not self.tier.holds(parent, tokens):
                break
            n += 1
        return n

    def can_allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached: list[int] = (),
        full_only: bool = False,
        arriving: bool = False,
    ) -> bool:
        """Whether ``seq`` (holding its current table, or about to take ``cached``)
        can grow to cover ``num_computed_tokens + num_new_tokens`` tokens (with
        ``full_only``, its full layers' blocks alone: ``allocate``)."""
        if self.states is not None and not self.states.can_hold(seq):
            return False  # every state slot is held
        have = len(seq.block_table) + len(cached)
        computed = seq.num_computed_tokens + len(cached) * self.block_size
        end = self.blocks_needed(computed + num_new_tokens)
        need = end - have
        free = self._free[self.home(seq, cached)]
        taken_from_free = sum(1 for b in cached if b in free)
        if self.window_groups and not full_only:  # each sliding group's from its window's start on
            held = seq.window_start + len(seq.window_tables[0]) if seq.window_tables else 0
            if cached:
                taken_from_free += sum(1 for t in self._window_prefix(cached) for b in t if b in free)
                held = len(cached)
            start = self.window_start(computed + (num_new_tokens if arriving else 0))
            need += self.window_groups * max(0, end - max(held, start))
        return need + taken_from_free <= len(free)

    # ---- actions -----------------------------------------------------------
    def take_cached_prefix(self, seq: Sequence, cached: list[int], count: bool = True) -> None:
        """Give a fresh sequence references to ``cached`` and count them computed (and,
        with ``count``, as prompt tokens reused: ``prefix_hits``)."""
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError("prefix can only be taken by a sequence holding no blocks")
        parent = None
        hashes = []
        for b in cached:
            self._ref(b)
            parent = self.block_hashes[b]
            hashes.append(parent)
        seq.block_table = list(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        if self.window_groups:
            seq.window_tables = self._window_prefix(cached)
            seq.window_start = self.window_start(seq.num_computed_tokens)
            for table in seq.window_tables:
                for b in table:
                    self._ref(b)
        if self.states is not None and cached:  # its first step starts from the snapshot there
            self.states.start_from(seq, self.block_hashes[cached[-1]])
        if count:
            self.prefix_hits += seq.num_computed_tokens
        self._seq_hashes[seq.seq_no] = hashes

    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """Give a fresh ``seq`` references to ``blocks``: full, computed blocks another
        sequence holds (a running request's KV lent to another worker), counted computed.
        Their hashes stay the other's to register; ``seq`` holds none. With layer
        groups only the full layers' blocks are shared: ``seq`` holds no window (a
        pre-copy's loan of blocks no window of the other reaches)."""
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError("blocks can only be shared with a sequence holding none")
        for b in blocks:
            self._ref(b)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size

    def reload(self, seq: Sequence, count: int, reused: bool = True) -> int:
        """Give ``seq`` (holding only its cached prefix, all computed) fresh blocks for
        its next ``count`` full blocks and load them from the tier, registering each.
        Stops at the first block the tier cannot give (dropped, or its checksum failed:
        then computed as usual). Returns the blocks loaded, counted in ``tier_hits``
        when ``reused``. Check ``can_allocate`` for ``count`` blocks' tokens first."""
        bs, free = self.block_size, self._free[0]
        hashes = self._seq_hashes.setdefault(seq.seq_no, [])
        parent = hashes[-1] if hashes else seq.hash_root
        loaded = 0
        for i in range(len(seq.block_table), len(seq.block_table) + count):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            block = self._pop_free(free)
            if not self.tier.load(h, block):
                self.ref_counts[block] = 0
                free[block] = None
                free.move_to_end(block, last=False)  # reused first: it holds nothing
                self._forget(h)
                break
            seq.block_table.append(block)
            self.block_hashes[block], self.block_tokens[block] = h, tokens
            if h not in self.hash_to_block:
                self.hash_to_block[h] = block
                self.prefix_log.stored(h)
            hashes.append(h)
            parent = h
            loaded += 1
        seq.num_computed_tokens += loaded * bs
        seq.num_cached_tokens += loaded * bs
        if reused:
            self.tier_hits += loaded * bs
        return loaded

    def allocate(
        self, seq: Sequence, num_new_tokens: int, full_only: bool = False, arriving: bool = False
    ) -> None:
        """Append blocks so ``seq`` covers its computed tokens plus ``num_new_tokens``.
        Call ``can_allocate`` first (with the same flags); raises ``RuntimeError`` if the
        pool is short. With layer groups: ``full_only``, the full layers' blocks alone
        (KV no window will reach: a pre-copy's), the sliding groups' coming with the
        next allocation; ``arriving``, the tokens' KV comes whole from elsewhere (no
        query of this engine runs over them), so the sliding groups need blocks only
        from the window of their end on."""
        end = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        need = end - len(seq.block_table)
        free = self._free[self.home(seq)]
        window_need = 0
        if self.window_groups and not full_only:
            start = self.window_start(seq.num_computed_tokens + (num_new_tokens if arriving else 0))
            self._release_window(seq, start)
            if not seq.window_tables:
                seq.window_tables = [[] for _ in range(self.window_groups)]
            if not seq.window_tables[0]:
                seq.window_start = start
            window_need = max(0, end - seq.window_start - len(seq.window_tables[0]))
        if need + self.window_groups * window_need > len(free):
            raise RuntimeError("allocate() called without enough free blocks")
        if self.states is not None and seq.state_slot is None:
            self.states.hold(seq)
        for _ in range(need):
            seq.block_table.append(self._pop_free(free))
        for table in seq.window_tables:
            for _ in range(window_need):
                table.append(self._pop_free(free))

    def commit_computed(self, seq: Sequence) -> None:
        """Register hashes of blocks that became full and computed (prefix caching); with
        layer groups, each sliding group's too, then give back the sliding blocks no
        window reaches any more (``window_start``)."""
        self._commit_hashes(seq)
        if self.window_groups:
            self._release_window(seq, self.window_start(seq.num_computed_tokens))

    def _commit_hashes(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.seq_no, [])
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        if seq.partial_from is not None:  # blocks without their sliding layers' KV: never a prefix
            num_full = min(num_full, seq.partial_from)
        parent = hashes[-1] if hashes else seq.hash_root
        for i in range(len(hashes), num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            block = seq.block_table[i]
            if self.block_hashes[block] is None and h not in self.hash_to_block:
                self.block_hashes[block] = h
                self.block_tokens[block] = tokens
                self.hash_to_block[h] = block
                self.prefix_log.stored(h)
            hashes.append(h)
            parent = h
        held = seq.window_start + len(seq.window_tables[0]) if seq.window_tables else 0
        for i in range(seq.window_start, min(num_full, len(hashes), held)):
            h, tokens = hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs])
            for g, table in enumerate(seq.window_tables):
                block = table[i - seq.window_start]
                if self.block_hashes[block] is None and h not in self._window_hashes[g]:
                    self.block_hashes[block], self.block_tokens[block] = h, tokens
                    self.block_group[block] = g + 1
                    self._window_hashes[g][h] = block

    def uncache(self, blocks: list[int]) -> None:
        """Take ``blocks`` (held by one sequence alone) out of the prefix cache: their
        contents are about to change (a harness's fault: ``Engine.inject_fault``), and no
        later prompt may find them. ``ValueError`` if another sequence holds one of them
        (nothing changed then)."""
        shared = [b for b in blocks if self.ref_counts[b] > 1]
        if shared:
            raise ValueError(f"blocks {shared} are shared with another request")
        for block in blocks:
            h, self.block_hashes[block], self.block_tokens[block] = self.block_hashes[block], None, None
            if h is None:
                continue
            group = self.block_group[block] if self.window_groups else 0
            owner = self._window_hashes[group - 1] if group else self.hash_to_block
            if owner.get(h) == block:
                del owner[h]
                if not group:
                    self._forget(h)

    def hash_of(self, seq: Sequence, block: int) -> int | None:
        """The hash of ``seq``'s ``block``-th block, once registered (``commit_computed``)."""
        hashes = self._seq_hashes.get(seq.seq_no, [])
        return hashes[block] if block < len(hashes) else None

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past those ``seq``'s tokens need (a speculative step
        allocated room for a draft it did not keep). They hold no hashed block: the
        prefix cache only registers computed ones."""
        keep = self.blocks_needed(seq.num_tokens)
        tables = [(seq.block_table, keep)] + [(t, keep - seq.window_start) for t in seq.window_tables]
        for table, n in tables:
            while len(table) > max(n, 0):
                self._unref(table.pop(), empty=True)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references (last block first, so a prefix outlives its tail)."""
        for table in (*seq.window_tables, seq.block_table):
            for b in reversed(table):
                self._unref(b)
        seq.block_table, seq.window_tables, seq.window_start = [], [], 0
        seq.partial_from = None
        if self.states is not None:
            self.states.release(seq)
        self._seq_hashes.pop(seq.seq_no, None)

    # ---- internals ---------------------------------------------------------
    def _release_window(self, seq: Sequence, start: int) -> None:
        """Give back ``seq``'s sliding blocks before position ``start`` (they keep their
        hashes: findable until reused)."""
        while seq.window_tables and seq.window_tables[0] and seq.window_start < start:
            for table in seq.window_tables:
                self._unref(table.pop(0))
            seq.window_start += 1

    def _unref(self, block: int, empty: bool = False) -> None:
        """Drop one reference; a block no one holds goes back to the free pool, last to be
        reused (it keeps its hash: a cached prefix), or with ``empty`` (it holds nothing)
        first."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            free = self._free[self.shard_of(block)]
            free[block] = None
            if empty:
                free.move_to_end(block, last=False)

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[self.shard_of(block)][block]
        self.ref_counts[block] += 1

    def _forget(self, h: int) -> None:
        """``h`` left a tier: logged removed unless the other still holds it."""
        if h not in self.hash_to_block and (self.tier is None or h not in self.tier):
            self.prefix_log.removed(h)

    def _pop_free(self, free: OrderedDict[int, None]) -> int:
        block, _ = free.popitem(last=False)
        h = self.block_hashes[block]
        if h is not None and self.window_groups and self.block_group[block]:  # a sliding group's
            hashes = self._window_hashes[self.block_group[block] - 1]
            if hashes.get(h) == block:
                del hashes[h]
            self.block_hashes[block] = self.block_tokens[block] = None
            self.block_group[block] = 0
        elif h is not None:  # evict: its content is about to be overwritten
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
                if self.tier is None:
                    self.prefix_log.removed(h)
                else:  # the bytes move down a tier
                    for gone in self.tier.save(h, self.block_tokens[block], block):
                        self._forget(gone)
            self.block_hashes[block] = None
            self.block_tokens[block] = None
        self.ref_counts[block] = 1
        return block
