"""``KVLayout``: the plain-data shape of a paged KV cache (no torch), shared by
the engine, the transfer layer and every process that checks compatibility.
``splitserve.engine.kv_cache`` describes the tensor it lays out."""

from __future__ import annotations

import functools
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1, "uint8": 1}


def kv_head_range(total: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The model's KV heads rank ``tp_rank`` of ``tp_size`` holds, [start, stop): an even
    split, or, with fewer KV heads than ranks, the one head that rank's query heads
    attend to (replicated over ``tp_size / total`` ranks, as vLLM does). ``ValueError``
    unless one of ``total`` and ``tp_size`` divides the other."""
    if total % tp_size and tp_size % total:
        raise ValueError(f"{total} KV heads neither split over nor replicate across {tp_size} ranks")
    if total >= tp_size:
        per = total // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    head = tp_rank * total // tp_size
    return head, head + 1


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    tp_size: int = 1
    tp_rank: int = 0
    # the model's KV heads; None: num_kv_heads * tp_size (no head is replicated)
    model_kv_heads: int | None = None
    # how values are scaled: "none", or an FP8 cache's scheme (engine.kv_quant.SCHEME)
    kv_scales: str = "none"
    # planes per layer: 2 (K and V), or 1 (an MLA latent row; num_kv_heads 1, the
    # same on every TP rank)
    planes: int = 2
    # each layer's sliding window in tokens, 0 for a layer that attends to every earlier
    # key; () when no layer has one (``window_from``)
    windows: tuple[int, ...] = ()
    # a hybrid model: how its linear layers' states lie in blocks past the KV ones
    # (``engine.state_blocks.StatePlan.signature``); "" for a model without them
    states: str = ""
    # the sliding layers share the cache's rows with the full ones, in layer groups
    # (``rows``, ``row``, ``group``): a sliding layer's blocks out of its window are freed
    grouped: bool = False

    def __post_init__(self) -> None:
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError(f"{len(self.windows)} layer windows for {self.num_layers} layers")
        if self.grouped and (self.states or not 0 < sum(1 for w in self.windows if w) < self.num_layers):
            raise ValueError("only a layout with both sliding and full layers (and no states) groups them")

    # ---- layer groups ------------------------------------------------------------
    # A grouped layout's tensor is ``[rows, planes, blocks, ...]`` with ``rows`` the full
    # layers' count: group 0 is the full layers, each further group as many sliding
    # layers (in layer order; the last may be short), layer l in row ``row(l)`` of the
    # blocks of its group ``group(l)``. A block belongs to one group at a time, so one
    # pool of ids serves them all. A sequence holds a table per group: the full one
    # every block of its tokens, each sliding one only the blocks its window still
    # reaches. A transfer names one flat list of ids: the full group's, then each
    # sliding group's from ``window_from`` on (``layer_blocks``).

    @property
    def rows(self) -> int:
        """The cache tensor's first dimension: the layers, or a grouped layout's rows."""
        return _groups(self.windows)[2] if self.grouped else self.num_layers

    @property
    def window_groups(self) -> int:
        """A grouped layout's sliding groups (0 for any other)."""
        return _groups(self.windows)[3] if self.grouped else 0

    def row(self, layer: int) -> int:
        """The row of the cache tensor holding ``layer``'s KV."""
        return _groups(self.windows)[0][layer] if self.grouped else layer

    def group(self, layer: int) -> int:
        """The layer group ``layer`` is in: 0 for a full layer (and every layer of a
        layout that is not grouped), 1.. for a grouped layout's sliding ones."""
        return _groups(self.windows)[1][layer] if self.grouped else 0

    @property
    def cache_shape(self) -> tuple[int, ...]:
        """The cache tensor's shape."""
        return (self.rows, self.planes, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def transfer_ids(self, blocks, windows, window_from: int) -> list[int]:
        """The flat id list a transfer names for a sequence's full blocks ``blocks`` (from
        the first one moved) and, for a grouped layout, each sliding group's blocks
        ``windows`` at the same positions from ``window_from`` on."""
        if not self.grouped:
            return list(blocks)
        return [*blocks, *(b for table in windows for b in table)]

    def most_ids(self, num_blocks: int) -> int:
        """The most ids a transfer of ``num_blocks`` blocks of tokens names: a grouped
        layout's sliding groups add at most their window's blocks and one each."""
        reach = -(-max(self.windows, default=0) // self.block_size) + 1
        return num_blocks + self.window_groups * min(num_blocks, reach)

    def token_blocks(self, num_ids: int, window_from: int) -> int:
        """Of a transfer's flat id list of ``num_ids`` ids, the full group's: the blocks
        of tokens it covers. ``ValueError`` for a count no transfer names."""
        k = self.window_groups
        n, odd = divmod(num_ids + k * window_from, k + 1)
        if odd or not 0 <= window_from <= n:
            raise ValueError(f"{num_ids} block ids with window_from {window_from} fit no transfer")
        return n

    def windowed(self, layer: int) -> bool:
        """Whether ``layer`` keeps only a sliding window's KV."""
        return bool(self.windows) and self.windows[layer] > 0

    def window_from(self, first_block: int, kv_tokens: int) -> int:
        """Of a run of blocks from ``first_block`` of a sequence holding the KV of its first
        ``kv_tokens`` tokens, how many leading ones no sliding layer reads again as the
        sequence goes on: the next token, at position ``kv_tokens``, attends to keys from
        ``kv_tokens - window + 1`` (the widest window) on, and later ones to later keys.
        A handoff or a move sends the sliding layers' KV only from there on; 0 for a
        model without windows."""
        widest = max(self.windows, default=0)
        if not widest:
            return 0
        return max(0, max(0, kv_tokens - widest + 1) // self.block_size - first_block)

    def layer_span(self, layer: int, num_ids: int, window_from: int) -> tuple[int, int]:
        """[start, stop) of a transfer's flat id list (``num_ids`` ids) whose KV of
        ``layer`` moves (and is hashed): all of them, or for a sliding layer those from
        ``window_from`` on; in a grouped layout its group's part (``transfer_ids``)."""
        if not self.grouped:
            return (window_from if self.windowed(layer) else 0), num_ids
        n = self.token_blocks(num_ids, window_from)
        g, m = self.group(layer), n - window_from
        return (0, n) if g == 0 else (n + (g - 1) * m, n + g * m)

    def layer_blocks(self, layer: int, blocks, window_from: int):
        """The ids of ``blocks`` (a transfer's flat list) whose KV of ``layer`` moves
        (``layer_span``)."""
        start, stop = self.layer_span(layer, len(blocks), window_from)
        return blocks[start:stop]

    def layer_runs(self, layers: range, num_ids: int, window_from: int) -> list[tuple[int, int, int, int]]:
        """``layers`` as maximal runs of consecutive layers in consecutive rows that move
        the same ids, as (first layer, end layer, first id, end id) of a transfer's flat
        list: one run for a model without windows, a run per layer where sliding and full
        layers alternate."""
        out: list[tuple[int, int, int, int]] = []
        for layer in layers:
            start, stop = self.layer_span(layer, num_ids, window_from)
            if out and out[-1][2:] == (start, stop) and self.row(out[-1][1] - 1) + 1 == self.row(layer):
                out[-1] = (out[-1][0], layer + 1, start, stop)
            else:
                out.append((layer, layer + 1, start, stop))
        return out

    def moved_bytes(self, num_ids: int, window_from: int) -> int:
        """Bytes a transfer naming ``num_ids`` block ids moves, the sliding layers' from
        ``window_from`` on."""
        n = self.token_blocks(num_ids, window_from) if self.grouped else num_ids
        sliding = sum(1 for w in self.windows if w)
        layer_blocks = (self.num_layers - sliding) * n + sliding * (n - window_from)
        return layer_blocks * self.planes * self.block_bytes

    @property
    def total_kv_heads(self) -> int:
        """The model's KV heads, over all ranks (each counted once, replicated or not)."""
        return self.num_kv_heads * self.tp_size if self.model_kv_heads is None else self.model_kv_heads

    @property
    def kv_head_range(self) -> tuple[int, int]:
        """The model's KV heads this cache holds: [start, stop)."""
        return kv_head_range(self.total_kv_heads, self.tp_size, self.tp_rank)

    @property
    def bytes_per_token(self) -> int:
        """This cache's bytes of one token, all rows and planes (a grouped layout's
        sliding layers hold their window's tokens on top)."""
        return self.rows * self.planes * self.block_bytes // self.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes in one block of one layer's K (or V, or MLA latent): the unit a transfer moves."""
        return self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


@functools.lru_cache(maxsize=32)
def _groups(windows: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """(row of each layer, group of each layer, rows, sliding groups) of a grouped layout
    with these windows (``KVLayout``'s layer groups)."""
    full = [layer for layer, w in enumerate(windows) if not w]
    sliding = [layer for layer, w in enumerate(windows) if w]
    rows, groups = [0] * len(windows), [0] * len(windows)
    for i, layer in enumerate(full):
        rows[layer] = i
    size = len(full)
    for i, layer in enumerate(sliding):
        groups[layer], rows[layer] = 1 + i // size, i % size
    return tuple(rows), tuple(groups), size, -(-len(sliding) // size)
