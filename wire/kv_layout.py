"""``KVLayout``: the plain-data shape of a paged KV cache (no torch), shared by
the engine, the transfer layer and every process that checks compatibility.
``splitserve.engine.kv_cache`` describes the tensor it lays out."""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError(f"{len(self.windows)} layer windows for {self.num_layers} layers")

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

    def layer_blocks(self, layer: int, blocks, window_from: int):
        """The blocks of ``blocks`` whose KV of ``layer`` moves (and is hashed): all of them,
        or for a sliding layer those from ``window_from`` on."""
        return blocks[window_from:] if self.windowed(layer) else blocks

    def moved_bytes(self, num_blocks: int, window_from: int) -> int:
        """Bytes a transfer of ``num_blocks`` blocks moves, the sliding layers' from
        ``window_from`` on."""
        sliding = sum(1 for w in self.windows if w)
        layer_blocks = (self.num_layers - sliding) * num_blocks + sliding * (num_blocks - window_from)
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
        """This cache's bytes of one token, all layers and planes."""
        return self.num_layers * self.planes * self.block_bytes // self.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes in one block of one layer's K (or V, or MLA latent): the unit a transfer moves."""
        return self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]
