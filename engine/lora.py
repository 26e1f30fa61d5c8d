"""Multi-LoRA: PEFT adapters over one base model, several in one batch.

An adapter (PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``)
adds to a projection ``W`` of the base the low-rank ``scaling * B @ A``; a request
names the adapter it runs under (``SamplingParams.adapter``), or none (the base).
``LoRAAdapters`` serves any number of adapters and holds up to ``max_loras`` of them
in slots (those of one step); each targeted projection of the model is wrapped in a
``LoRALinear`` holding every slot's ``A`` and ``B`` side by side. A step
(``LoRAAdapters.begin_step``) sorts its adapter rows two ways, and each wrapped
projection adds each row's ``B @ A x`` to its output:

- **runs**: packed rows of one adapter at least ``LoRAAdapters.MIN_RUN_ROWS`` long (a
  prompt's chunk; adjacent requests of one adapter) are a row slice of their own:
  ``(x[run] @ A_slot) @ B_slot``, only that adapter's rank;
- **the rest** (decode rows, a draft's few, short chunks) in one pass over the rows
  from the first of them to the last: each marked with its slot (a one-hot row; zeros
  for a base row or a run's), ``((x @ A_all) * one_hot) @ B_all``: every slot's
  low-rank product for every row, the rows' own kept, in two plain matmuls and a
  multiply whatever the adapters present (no gather, no scatter, no per-row Python).

A step of base rows only skips both; a decode step replayed from a CUDA graph
(``engine.cuda_graphs``) always runs the one-hot pass, over the graph's static one-hot
rows (``use_static``, ``fill_static``: zeros for a base row or a padding one).

The split is for prefill: over a prompt's rows the one-hot pass costs every slot's rank
(``max_loras`` times the work) and a second pass over the output; a run's slice costs
its own. On this project's 2-vCPU Xeon, one layer
of SmolLM2's four projections over 512 rows in four runs of 128 (4 adapters of rank 16)
took 3.5 ms as runs against 6.5 ms one-hot; over 32 decode rows of one row each, one-hot
took 0.7 ms and runs 9 ms (``MIN_RUN_ROWS`` sits between: 16 runs of 32 rows were about
even).

The engine's projections fuse PEFT's modules: ``qkv_proj`` holds q, k and v (in that
order), ``gate_up_proj`` gate and up. A fused projection's ``A`` stacks its parts'
``A`` (rank ``parts x max_lora_rank``), so one matmul serves every part, and its ``B``
holds each part's ``B`` in that part's output columns: the ``B`` product is one matmul
per part into its own columns (the zeros of a block-diagonal ``B``, two thirds of
``qkv_proj``'s and half of ``gate_up_proj``'s, are never multiplied). ``scaling``
(``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) is folded into ``B`` at load.

Adapters are served from the start (``lora_modules``) or from a load at run time, and
unloaded (``engine.lora_requests``: which request takes which slot, when). A served
adapter is read once and kept in host memory (``max_cpu_loras`` copies, the least
recently used that no request holds dropped past that, read again from its path when
needed); a slot is written, on every rank of a TP group (the driver picks it:
``ModelRunner.write_adapter``), when a request needs it and no slot holds it.

Refused, with a sentence naming the file: a rank above ``max_lora_rank``, a target
the model lacks (a MoE layer has no ``gate_proj``), DoRA, per-module rank or alpha
patterns, trained biases, ``modules_to_save``, ``fan_in_fan_out`` weights, a layer
outside the model, a tensor whose shape does not fit.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from torch import nn

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.layers import kv_head_range
from splitserve.wire.errors import ModelLoadError

# PEFT's module name -> (the engine's module in a decoder layer, the part of its output)
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", "o"),
    "gate_proj": ("mlp.gate_up_proj", "gate"),
    "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", "down"),
}
Key = tuple[str, str]  # an adapter: its name and its weights' digest
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter as loaded: per (layer, PEFT module) its ``A`` [r, in] and its ``B``
    [out, r] with the scaling folded in (float32)."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str  # of its weights file and the config fields that change what it computes


def load_adapter(name: str, path: str | Path, num_layers: int, max_rank: int) -> LoRAAdapter:
    """Read a PEFT LoRA adapter from directory ``path``. ``ModelLoadError`` naming the
    file (and tensor) for what this engine cannot run (see the module docstring)."""
    directory = Path(path)
    config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise ModelLoadError(f"LoRA adapter {name!r}: {f} is missing (a PEFT adapter directory has it)")
    cfg = json.loads(config_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(
            f"LoRA adapter {name!r}: {config_file} is a {cfg['peft_type']} adapter, not LoRA"
        )
    unsupported = {
        "use_dora": "DoRA",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "modules_to_save": "whole modules saved beside the adapter (modules_to_save)",
        "fan_in_fan_out": "fan_in_fan_out weights",
        "lora_bias": "trained LoRA biases",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise ModelLoadError(f"LoRA adapter {name!r}: {config_file} uses {what}, which is not supported")
    if cfg.get("bias", "none") != "none":
        raise ModelLoadError(f"LoRA adapter {name!r}: {config_file} trains biases (bias={cfg['bias']!r})")
    rank = int(cfg["r"])
    if not 1 <= rank <= max_rank:
        raise ModelLoadError(
            f"LoRA adapter {name!r}: {config_file} has rank {rank}, above max_lora_rank {max_rank}"
        )
    alpha = float(cfg.get("lora_alpha", rank))
    data = weights_file.read_bytes()  # read once: hashed and parsed
    h = hashlib.blake2b(data, digest_size=8)
    h.update(json.dumps([rank, alpha, bool(cfg.get("use_rslora"))]).encode())
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_safetensors(data).items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise ModelLoadError(
                f"LoRA adapter {name!r}: {weights_file} holds {key}, which targets no projection this "
                f"engine adapts ({', '.join(TARGETS)} of a decoder layer)"
            )
        layer = int(m.group(1))
        if layer >= num_layers:
            raise ModelLoadError(
                f"LoRA adapter {name!r}: {weights_file} holds {key}, but the model has {num_layers} layers"
            )
        halves.setdefault((layer, m.group(2)), {})[m.group(3)] = tensor.float()
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise ModelLoadError(
                f"LoRA adapter {name!r}: {weights_file} has lora_{''.join(pair)} of layer {layer}'s "
                f"{module} without its other half"
            )
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ModelLoadError(
                f"LoRA adapter {name!r}: {weights_file}: layer {layer}'s {module} has rank "
                f"{a.shape[0]}/{b.shape[1]}, the config says {rank}"
            )
        weights[(layer, module)] = (a, b * scaling)
    if not weights:
        raise ModelLoadError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    return LoRAAdapter(name, str(directory), rank, weights, h.hexdigest())


class LoRAStep:
    """The current step's rows by adapter, shared by every ``LoRALinear`` of a model
    (set by ``LoRAAdapters.begin_step``):

    - ``runs`` [(first packed row, end row, slot)]: rows run as a slice of their own;
    - ``one_hot`` [span rows, max_loras] over the packed rows ``span`` (first, end): each
      other adapter row's slot marked (base rows and rows of ``runs``: zeros), in the
      model's dtype; None when no row is left to it."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, int]] = []
        self.span = (0, 0)
        self.one_hot: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """``base`` (a projection of the model, any implementation taking 2-D input) plus
    each step row's adapter: ``parts`` [(name, first output row, rows)] are the PEFT
    modules it fuses, in output order.

    With ``P`` parts, ``L`` slots (``max_loras``) and rank ``R`` (``max_rank``; a smaller
    adapter's columns past its rank are zeros):

    - ``a`` [in, P x L x R] (the one-hot pass's) holds every slot's ``A`` transposed, a
      column ``(i x L + slot) x R + r`` for rank ``r`` of part ``i``: a row's one-hot slot,
      broadcast over parts and ranks, keeps its own adapter's columns of ``x @ a``;
      part ``i``'s are the ``L x R`` columns from ``i x L x R``;
    - ``a_runs`` [L, in, P x R] (a run's) holds the same per slot, a column ``i x R + r``
      (``A`` twice: each copy ``P x L x R / out`` of the base projection's size; at 4
      slots of rank 16, 3 % for Llama-3-8B's ``qkv_proj``, 20 % for SmolLM2's);
    - ``b`` [L x R, out] holds every slot's ``B`` transposed, a row ``slot x R + r``, each
      part's in its own output columns: part ``i``'s columns of ``x @ a`` (or of
      ``x @ a_runs[slot]``, with ``b``'s rows of that slot) times ``b``'s columns of part
      ``i`` is its product (no block-diagonal zeros multiplied)."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        parts: list[tuple[str, int, int]],
        max_loras: int,
        max_rank: int,
        step: LoRAStep,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.base = base
        self.parts = {name: (i, first, rows) for i, (name, first, rows) in enumerate(parts)}
        self.max_rank, self.max_loras = max_rank, max_loras
        self.step = step
        out = sum(rows for _, _, rows in parts)
        width = max_rank * max_loras  # the columns of x @ a of one part
        self.spans = [
            (i * width, (i + 1) * width, first, first + rows) for i, (_, first, rows) in enumerate(parts)
        ]
        self.register_buffer("a", torch.zeros(in_features, len(parts) * width, dtype=dtype, device=device))
        self.register_buffer(
            "a_runs", torch.zeros(max_loras, in_features, len(parts) * max_rank, dtype=dtype, device=device)
        )
        self.register_buffer("b", torch.zeros(width, out, dtype=dtype, device=device))

    def check(self, part: str, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """``ValueError`` unless ``A`` and ``B`` fit ``part`` (None: the adapter leaves it)."""
        _, _, rows = self.parts[part]
        if a is not None and (a.shape[1] != self.a.shape[0] or b.shape[0] != rows):
            fits = f"{rows} x {self.a.shape[0]}"
            raise ValueError(f"{part}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit ({fits})")

    def set(self, slot: int, part: str, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot ``slot``'s ``A`` and ``B`` for ``part`` (None: zeros: the adapter leaves it)."""
        self.check(part, a, b)
        i, first, rows = self.parts[part]
        size, loras, rank = self.a.shape[0], self.max_loras, self.max_rank
        at = self.a.view(size, -1, loras, rank)  # [in, P, L, R]
        ar = self.a_runs.view(loras, size, -1, rank)  # [L, in, P, R]
        bt = self.b.view(loras, rank, self.b.shape[1])  # [L, R, out]
        at[:, i, slot].zero_()
        ar[slot, :, i].zero_()
        bt[slot, :, first : first + rows].zero_()
        if a is None:
            return
        r = a.shape[0]
        at[:, i, slot, :r] = a.T.to(self.a.dtype)
        ar[slot, :, i, :r] = a.T.to(self.a.dtype)
        bt[slot, :r, first : first + rows] = b.T.to(self.b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step, rank = self.step, self.max_rank
        if step.one_hot is not None:
            s0, s1 = step.span
            t = torch.mm(x[s0:s1], self.a)
            t.view(s1 - s0, len(self.spans), self.max_loras, rank).mul_(step.one_hot[:, None, :, None])
            ys = y[s0:s1]
            for t0, t1, y0, y1 in self.spans:  # each part's rank columns into its own output columns
                ys[:, y0:y1].addmm_(t[:, t0:t1], self.b[:, y0:y1])
        for r0, r1, slot in step.runs:  # one adapter's rows: its rank only
            t = torch.mm(x[r0:r1], self.a_runs[slot])
            yr, b = y[r0:r1], self.b[slot * rank : (slot + 1) * rank]
            for i, (_, _, y0, y1) in enumerate(self.spans):
                yr[:, y0:y1].addmm_(t[:, i * rank : (i + 1) * rank], b[:, y0:y1])
        return y


class LoRAAdapters:
    """The adapters an engine serves (``served``, the driver's), their host copies, and
    the ``max_loras`` slots of every ``LoRALinear`` the model's projections were wrapped
    in (at construction), each holding one adapter's weights or none."""

    MIN_RUN_ROWS = 32  # adjacent rows of one adapter from which they run as a slice (``begin_step``)

    def __init__(
        self,
        model: nn.Module,
        mc: ModelConfig,
        tp: TPGroup,
        max_loras: int,
        max_cpu_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """``model``, this rank's shard of ``mc`` in group ``tp``: each projection takes
        its share of an adapter as of its base weights (``_shards``). ``max_loras`` slots
        (adapters in one step), ``max_cpu_loras`` host copies."""
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self.num_layers = len(model.layers)
        self.step = LoRAStep()
        self.dtype, self.device = dtype, device
        self.served: dict[str, str] = {}  # adapter served -> ``LoRAAdapter.digest`` (driver)
        # (name, digest) -> its path and host copy (None once evicted), least recently used first
        self._host: collections.OrderedDict[Key, tuple[str, LoRAAdapter | None]] = collections.OrderedDict()
        self._slots: list[Key | None] = [None] * max_loras  # the adapter each slot holds
        self._written = [0] * max_loras  # when each slot was last written (``_clock``)
        self._clock = 0
        self._modules: dict[tuple[int, str], LoRALinear] = {}  # (layer, engine module path) -> wrapper
        self._static: torch.Tensor | None = None  # a CUDA graph's one-hot rows (``use_static``)
        self._shards = _shards(mc, tp)
        for index, layer in enumerate(model.layers):
            for path, parts in _fused_parts(layer).items():
                owner_path, attr = path.rsplit(".", 1)
                owner = layer.get_submodule(owner_path)
                base = getattr(owner, attr)
                inner = getattr(base, "linear", None)  # a row-parallel projection: its shard
                target = inner if inner is not None else base
                wrapped = LoRALinear(
                    target, _in_features(target), parts, max_loras, max_rank, self.step, dtype, device
                )
                if inner is not None:
                    base.linear = wrapped
                else:
                    setattr(owner, attr, wrapped)
                self._modules[(index, path)] = wrapped

    # ---- what the engine serves (the driver's; the other ranks only ``write``) ---------
    def load(self, name: str, path: str | Path) -> str:
        """Serve adapter ``name`` from ``path`` as an engine does at start (no request yet,
        one rank: ``check_new``, ``write`` to check, ``serve``); returns its digest."""
        adapter = self.read(name, path)
        self.check_new(name, adapter.digest, set())
        self.write(name, path, None, adapter)
        self.serve(name, str(path), adapter, set())
        return adapter.digest

    def check_new(self, name: str, digest: str, needed: set[Key]) -> None:
        """``ModelLoadError`` unless weights ``digest`` may be served as ``name``: not while
        ``name`` is served with other weights, nor while requests run under other weights
        it was served with (``needed``: the (name, digest) of every request the engine holds)."""
        if name in self.served and self.served[name] != digest:
            raise ModelLoadError(
                f"a LoRA adapter named {name!r} is loaded already, with other weights; unload it first"
            )
        if any(n == name and d != digest for n, d in needed):
            raise ModelLoadError(
                f"LoRA adapter {name!r} was unloaded, but requests still run here under its earlier "
                "weights; load other weights under this name once they have finished (or under "
                "another name now)"
            )

    def serve(self, name: str, path: str, adapter: LoRAAdapter, needed: set[Key]) -> None:
        """Serve ``adapter`` (read from ``path``, checked: ``check_new``, ``write``) as
        ``name`` to requests added from here on. Its host copy is kept, and past
        ``max_cpu_loras`` copies the least recently used that no request holds
        (``needed``) is dropped (read again from its path when a slot needs it); a slot
        is written only when a request needs it (``slot_for``)."""
        self.served[name] = adapter.digest
        self.keep((name, adapter.digest), path, adapter, needed)

    def unserve(self, name: str) -> None:
        """Serve ``name`` to no new request (``KeyError`` if not served). The requests under
        it run on in their slots, or get one as any other (its host copy stays theirs)."""
        del self.served[name]

    def slot_for(self, key: Key, in_use: Callable[[], set[int]]) -> tuple[int, bool] | None:
        """A slot for adapter ``key`` (name, digest): (the one holding its weights, True),
        else (one no request runs in, ``in_use()``, emptiest and least recently written
        first, False: to ``write``), else None: every slot is in use."""
        for slot, held in enumerate(self._slots):
            if held == key:
                return slot, True
        busy = in_use()
        free = [s for s in range(self.max_loras) if s not in busy]
        if not free:
            return None
        return min(free, key=lambda s: (self._slots[s] is not None, self._written[s])), False

    def forget(self, slot: int) -> None:
        """Slot ``slot`` holds no adapter (a write that failed on some rank)."""
        self._slots[slot] = None

    def source(self, key: Key) -> tuple[str, LoRAAdapter | None]:
        """Where adapter ``key``'s weights come from: its path, and its host copy if kept
        (``KeyError`` for an adapter never served here)."""
        entry = self._host[key]
        self._host.move_to_end(key)
        return entry

    # ---- every rank ---------------------------------------------------------------
    def read(self, name: str, path: str | Path) -> LoRAAdapter:
        """Adapter ``name`` from ``path`` as this engine would load it (``load_adapter``);
        files that do not parse are a ``ModelLoadError`` too (never another error: a slot
        written as a request is scheduled reads here, and must fail that request alone)."""
        try:
            return load_adapter(name, path, self.num_layers, self.max_rank)
        except ModelLoadError:
            raise
        except Exception as e:  # JSON, safetensors, a field missing
            raise ModelLoadError(f"LoRA adapter {name!r} ({path}): {type(e).__name__}: {e}") from None

    def write(
        self,
        name: str,
        path: str | Path,
        slot: int | None,
        adapter: LoRAAdapter | None = None,
        digest: str | None = None,
    ) -> str:
        """Write adapter ``name`` (``adapter``, else read from ``path``) into ``slot``, this
        rank's share (None: check only that it fits); returns its digest. ``ModelLoadError``
        as ``load_adapter``, for a target this model lacks, or for weights other than
        ``digest`` (the files at ``path`` changed since), leaving the slot as it was. The
        caller picks a slot no row selects."""
        adapter = adapter or self.read(name, path)
        if digest is not None and adapter.digest != digest:
            raise ModelLoadError(f"the files of LoRA adapter {name!r} at {path} changed since it was loaded")
        writes = self._writes(adapter)
        if slot is not None:
            for wrapped, part, a, b in writes:
                wrapped.set(slot, part, a, b)
            self._slots[slot] = (name, adapter.digest)
            self._clock += 1
            self._written[slot] = self._clock
        return adapter.digest

    def _writes(self, adapter: LoRAAdapter) -> list:
        """Every (module, part, A, B) ``adapter`` writes, this rank's share, each checked:
        ``ModelLoadError`` for one that does not fit this model."""
        name = adapter.name
        for layer, module in adapter.weights:
            if (layer, TARGETS[module][0]) not in self._modules:
                raise ModelLoadError(
                    f"LoRA adapter {name!r} ({adapter.path}) adapts layer {layer}'s {module}, which this "
                    "model does not have there"
                )
        writes = []
        for (layer, path_), wrapped in self._modules.items():
            for part in wrapped.parts:
                module = next(m for m, (p, pt) in TARGETS.items() if p == path_ and pt == part)
                pair = adapter.weights.get((layer, module))
                try:
                    a, b = (None, None) if pair is None else self._shards[module].of(*pair)
                    wrapped.check(part, a, b)
                except ValueError as e:
                    raise ModelLoadError(
                        f"LoRA adapter {name!r} ({adapter.path}): layer {layer}'s {e}"
                    ) from None
                writes.append((wrapped, part, a, b))
        return writes

    def keep(self, key: Key, path: str, adapter: LoRAAdapter, needed: set[Key]) -> None:
        """Keep ``adapter``'s host copy, most recently used; past ``max_cpu_loras`` copies,
        drop the least recently used that no request needs (``needed``) until there are
        no more (or only needed ones are left), and forget adapters no longer served
        that none needs."""
        self._host[key] = (path, adapter)
        self._host.move_to_end(key)
        for old in [k for k in self._host if k != key]:
            if old not in needed and self.served.get(old[0]) != old[1]:
                del self._host[old]  # unloaded, and no request left under it
        kept = [k for k, (_, a) in self._host.items() if a is not None]  # least recently used first
        excess = len(kept) - self.max_cpu_loras
        for old in kept:
            if excess <= 0:
                break
            if old not in needed and old != key:
                self._host[old] = (self._host[old][0], None)  # read again from its path when needed
                excess -= 1

    def begin_step(self, rows: list[tuple[int, int, int]], num_rows: int) -> None:
        """The next forward's rows by adapter: ``rows`` [(first packed row, rows, slot)] of
        its ``num_rows`` packed rows, in row order, the others the base's (``LoRAStep``):
        adjacent rows of one slot merged, runs of ``MIN_RUN_ROWS`` or more as slices,
        the rest one-hot over the rows from the first of them to the last."""
        merged: list[list[int]] = []  # [first, end, slot]
        for first, count, slot in rows:
            if slot is None:
                raise ValueError(f"rows {first}..{first + count - 1} name an adapter in no slot")
            if merged and merged[-1][1] == first and merged[-1][2] == slot:
                merged[-1][1] = first + count
            else:
                merged.append([first, first + count, slot])
        runs = [(f, e, s) for f, e, s in merged if e - f >= self.MIN_RUN_ROWS]
        rest = [(f, e, s) for f, e, s in merged if e - f < self.MIN_RUN_ROWS]
        self.step.runs = runs
        if not rest:
            self.step.one_hot = None
            return
        s0, s1 = rest[0][0], rest[-1][1]
        one_hot = torch.zeros(s1 - s0, self.max_loras, dtype=self.dtype)  # made here, moved once
        for first, end, slot in rest:
            one_hot[first - s0 : end - s0, slot] = 1
        self.step.span = (s0, s1)
        self.step.one_hot = one_hot.to(self.device, non_blocking=True)

    def make_static(self, max_rows: int) -> None:
        """The static buffer of CUDA graphs' one-hot rows, ``max_rows`` of them (made once,
        before any recording)."""
        self._static = torch.zeros(max_rows, self.max_loras, dtype=self.dtype, device=self.device)

    def use_static(self, rows: int) -> None:
        """The next forward (a CUDA graph's, recorded or replayed, of ``rows`` rows) reads
        its rows' slots from the static buffer (``make_static``) that ``fill_static``
        writes: every row through the one-hot pass, none as a run."""
        self.step.runs = []
        self.step.span = (0, rows)
        self.step.one_hot = self._static[:rows]

    def fill_static(self, rows: Sequence[tuple[int, int, int]], num_rows: int) -> None:
        """A graph replay's rows by adapter (``begin_step``'s ``rows``) into the static
        buffer's first ``num_rows`` (the recorded size; the rest of them padding: zeros)."""
        one_hot = torch.zeros(num_rows, self.max_loras, dtype=self.dtype)
        for first, count, slot in rows:
            if slot is None:
                raise ValueError(f"rows {first}..{first + count - 1} name an adapter in no slot")
            one_hot[first : first + count, slot] = 1
        self._static[:num_rows].copy_(one_hot, non_blocking=True)


@dataclass(frozen=True)
class _Shard:
    """This rank's share of a PEFT module's ``A`` [r, in] and ``B`` [out, r]: the rows of
    ``B`` (a column-parallel projection) or the columns of ``A`` (row-parallel) its base
    weights hold, ``span`` of the model's ``full``."""

    of_b: bool
    span: tuple[int, int]
    full: int

    def of(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ValueError`` for a tensor of another size than the model's."""
        side = b.shape[0] if self.of_b else a.shape[1]
        if side != self.full:
            what = "B has" if self.of_b else "A has"
            raise ValueError(
                f"{what} {side} {'rows' if self.of_b else 'columns'}; the model's has {self.full}"
            )
        s0, s1 = self.span
        return (a, b[s0:s1]) if self.of_b else (a[:, s0:s1], b)


def _shards(mc: ModelConfig, tp: TPGroup) -> dict[str, _Shard]:
    """Each PEFT module's share on rank ``tp.rank``, as the engine shards its weights
    (``engine.model.placement``): query heads and KV heads (replicated where fewer
    than ranks), the intermediate width; ``o_proj`` and ``down_proj`` by input."""
    hd = mc.head_dim
    h0, h1 = tp.shard_range(mc.num_heads)
    k0, k1 = kv_head_range(mc.num_kv_heads, tp)
    out = {
        "q_proj": _Shard(True, (h0 * hd, h1 * hd), mc.num_heads * hd),
        "k_proj": _Shard(True, (k0 * hd, k1 * hd), mc.num_kv_heads * hd),
        "v_proj": _Shard(True, (k0 * hd, k1 * hd), mc.num_kv_heads * hd),
        "o_proj": _Shard(False, (h0 * hd, h1 * hd), mc.num_heads * hd),
    }
    if mc.intermediate_size and mc.intermediate_size % tp.size == 0:
        i0, i1 = tp.shard_range(mc.intermediate_size)
        for module in ("gate_proj", "up_proj"):
            out[module] = _Shard(True, (i0, i1), mc.intermediate_size)
        out["down_proj"] = _Shard(False, (i0, i1), mc.intermediate_size)
    return out


def _fused_parts(layer: nn.Module) -> dict[str, list[tuple[str, int, int]]]:
    """The projections of decoder ``layer`` an adapter may adapt: engine module path ->
    its PEFT parts [(part, first output row, rows)]."""
    out: dict[str, list[tuple[str, int, int]]] = {}
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is not None and hasattr(attn, "qkv_proj") and hasattr(attn, "q_size") and not attn.gated:
        q, kv = attn.q_size, attn.kv_size
        out["self_attn.qkv_proj"] = [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)]
        out["self_attn.o_proj"] = [("o", 0, _out_features(attn.o_proj))]
    if mlp is not None and hasattr(mlp, "gate_up_proj") and hasattr(mlp, "inter"):
        out["mlp.gate_up_proj"] = [("gate", 0, mlp.inter), ("up", mlp.inter, mlp.inter)]
        out["mlp.down_proj"] = [("down", 0, _out_features(mlp.down_proj))]
    return out


def _in_features(m: nn.Module) -> int:
    return m.in_features if hasattr(m, "in_features") else m.weight.shape[1]


def _out_features(m: nn.Module) -> int:
    m = getattr(m, "linear", m)
    return m.out_features if hasattr(m, "out_features") else m.weight.shape[0]
