"""Decode steps replayed from captured CUDA graphs (``EngineConfig.cuda_graphs``).

A decode step launches hundreds of small kernels; at small batches the GPU
waits on the CPU launching them. ``DecodeGraphs`` records the whole forward
(embedding to logits) once per batch size in ``BATCH_SIZES`` (up to the first
that holds a step's most rows: ``max_num_seqs``, times ``1 + num_tokens`` when
drafts are verified as decode rows) over static input buffers, and a
pure-decode step then only copies its inputs into the buffers and replays the
recording of the next size up::

    step with n decodes, n <= largest size B:
      rows 0..n-1   the real sequences (ids, positions, slots, block tables, lengths)
      rows n..B-1   padding: token 0 at position 0, writing its K/V to a scratch block
                    the block manager never hands out, attending only to itself
      replay graph[B]; logits[:n] are the step's

Shapes inside a recording never change: block tables are as wide as the
longest sequence allowed (``max_model_len``), which the Triton paged-decode
kernel (the only backend allowed here) reads only up to each sequence's length.
Steps with prefill chunks, or more decodes than the largest size, run eagerly.
With LoRA adapters (``engine.lora``), each recording runs the adapters' one-hot pass
over a static buffer of the rows' slots, which a replay fills first (a base row's and
a padding row's: zeros).

``record`` is how a step is captured: on CUDA ``cuda_graph_recorder`` (capture,
then replay); on other devices (tests, with Triton's interpreter) a plain
re-run over the same static buffers, so the padding and buffer logic is
tested without a GPU, with no speed gained.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from splitserve.engine.attention.base import AttentionBackend
from splitserve.engine.attention.sdpa import SdpaMetadata
from splitserve.engine.capture_guard import refuse_host_syncs
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.lora import LoRAAdapters
from splitserve.engine.model.decoder import DecoderModel
from splitserve.engine.model.llama import StepContext

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

Recorder = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def cuda_graph_recorder(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """Capture ``fn`` in a CUDA graph (after warm-up runs on a side stream); the
    returned replay gives the captured output tensor, overwritten by each replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def rerun_recorder(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """Off CUDA, a "recording" is the step itself, run again over the same buffers;
    recording runs it once with what a capture refuses made to raise
    (``capture_guard.HostSync``), so a step a GPU could not capture fails here too."""
    with refuse_host_syncs():
        fn()
    return fn


class DecodeGraphs:
    @classmethod
    def for_engine(
        cls,
        model: DecoderModel,
        kv_cache: KVCache,
        backend: AttentionBackend,
        max_rows: int,
        max_model_len: int,
        tp_size: int,
        loras: LoRAAdapters | None = None,
    ) -> DecodeGraphs:
        """Recordings for an engine whose decode steps have up to ``max_rows`` rows
        (sequences, plus their draft tokens when drafts are verified as decode rows):
        its last KV block becomes the scratch block (the caller gives the block manager
        the blocks before it). Raises ``ValueError``."""
        if tp_size > 1:
            raise ValueError("cuda_graphs needs tp_size 1")
        num_blocks = kv_cache.layout.num_blocks
        if num_blocks < 2:
            raise ValueError("cuda_graphs needs at least 2 KV blocks (one is its scratch block)")
        on_cuda = kv_cache.tensor.device.type == "cuda"
        record = cuda_graph_recorder if on_cuda else rerun_recorder
        return cls(model, kv_cache, backend, max_rows, max_model_len, num_blocks - 1, record, loras)

    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        backend: AttentionBackend,
        max_batch: int,
        max_model_len: int,
        scratch_block: int,
        record: Recorder = cuda_graph_recorder,
        loras: LoRAAdapters | None = None,
    ):
        if backend.name != "triton":
            raise ValueError("CUDA graphs need the triton attention backend (fixed shapes in paged decode)")
        from splitserve.engine.attention.triton import TritonMetadata

        dev = kv_cache.tensor.device
        bs = kv_cache.layout.block_size
        # every size below max_batch, and the first that holds it
        self.sizes = [b for b in BATCH_SIZES if b < max_batch] + [
            next((b for b in BATCH_SIZES if b >= max_batch), BATCH_SIZES[-1])
        ]
        n = self.sizes[-1]
        width = -(-max_model_len // bs)
        self.block_size, self.scratch_block = bs, scratch_block
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), scratch_block * bs, dtype=torch.long, device=dev)
        self.tables = torch.full((n, width), scratch_block, dtype=torch.int32, device=dev)
        self.lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.loras = loras
        if loras is not None:
            loras.make_static(n)
        for b in reversed(self.sizes):  # largest first: later captures reuse its memory
            meta = TritonMetadata(SdpaMetadata(0, None, None, []), b, self.tables[:b], self.lens[:b])
            ctx = StepContext(self.slots[:b], backend, meta)

            def step(b=b, ctx=ctx) -> torch.Tensor:
                if loras is not None:  # no kernel: which buffer the adapters' pass reads
                    loras.use_static(b)
                hidden = model(self.ids[:b], self.positions[:b], kv_cache, ctx)
                return model.compute_logits(hidden)

            self.replays[b] = record(step)

    def fits(self, num_tokens: int, num_decodes: int, num_sampled: int) -> bool:
        """Whether a step can replay a recording: decodes only, all sampled, few enough."""
        return num_tokens == num_decodes == num_sampled and 0 < num_decodes <= self.sizes[-1]

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        lora_rows: Sequence[tuple[int, int, int]] = (),
    ) -> torch.Tensor:
        """Logits [n, vocab] of n decoding sequences (row i: ``ids[i]`` at ``positions[i]``;
        ``lora_rows``: those under a LoRA adapter, as ``LoRAAdapters.begin_step`` takes them)."""
        n = len(ids)
        b = next(size for size in self.sizes if size >= n)
        dev = self.ids.device
        self.ids[:n] = torch.tensor(ids, device=dev)
        self.positions[:n] = torch.tensor(positions, device=dev)
        self.slots[:n] = torch.tensor(slots, device=dev)
        self.lens[:n] = torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=dev)
        width = self.tables.shape[1]
        rows = [t + [self.scratch_block] * (width - len(t)) for t in tables]
        self.tables[:n] = torch.tensor(rows, dtype=torch.int32, device=dev)
        # Rows n..b-1 get back the padding values (an earlier, larger step may have used them).
        self.ids[n:b] = 0
        self.positions[n:b] = 0
        self.slots[n:b] = self.scratch_block * self.block_size
        self.lens[n:b] = 1
        self.tables[n:b] = self.scratch_block
        if self.loras is not None:
            self.loras.fill_static(lora_rows, b)
        return self.replays[b]()[:n]
