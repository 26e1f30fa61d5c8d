"""Reading checkpoint tensors a slice at a time.

A checkpoint is a sequence of ``(name, TensorSource)`` pairs in Hugging Face
naming. A ``TensorSource`` knows its shape and dtype and reads any range along
one dimension, so each tensor-parallel rank reads only its own slice:

- ``safetensors_tensors(directory)``: the files of an HF directory, memory-mapped
  (``safe_open(...).get_slice``); a slice is copied out of the page cache once,
  nothing else of the file is ever copied;
- ``in_memory_tensors(pairs)``: tensors already in memory (tests, converters);
- ``random_tensors(shapes, seed)``: transformers' init, drawn per tensor from a
  seed and the tensor's name, so every rank (and every TP size) sees the same
  model whatever order it reads in.

Which files of a directory hold the model (vLLM's rules): those named in
``model.safetensors.index.json`` when it exists, else every ``*.safetensors``
except Mistral's ``consolidated*.safetensors`` when sharded files sit beside it.
A directory with only PyTorch pickles (``*.bin``, ``*.pt``) is refused.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from splitserve.wire.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"

# safetensors' dtype names -> torch
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class TensorSource(Protocol):
    """One checkpoint tensor, read on demand."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The whole tensor (``dim`` None) or its range [start, stop) along ``dim``."""
        ...


def _index(ndim: int, dim: int | None, start: int, stop: int | None) -> tuple[slice, ...]:
    idx = [slice(None)] * ndim
    if dim is not None:
        idx[dim] = slice(start, stop)
    return tuple(idx)


class _SafetensorsSlice:
    def __init__(self, sl, name: str):
        self._slice = sl
        self.shape = tuple(sl.get_shape())
        dtype = sl.get_dtype()
        if dtype not in _ST_DTYPES:
            raise ModelLoadError(f"checkpoint tensor {name} has dtype {dtype}, which splitserve cannot read")
        self.dtype = _ST_DTYPES[dtype]

    def read(self, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if not self.shape:
            return self._slice[...]
        return self._slice[_index(len(self.shape), dim, start, stop)]


@dataclass
class _InMemory:
    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def read(self, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.tensor[_index(self.tensor.dim(), dim, start, stop)]


@dataclass
class _Random:
    """normal(0, std) for matrices, ones for norm weights, zeros for biases; the full
    tensor is drawn (in float32, on ``device``) and the asked range returned."""

    name: str
    shape: tuple[int, ...]
    seed: int
    device: torch.device
    std: float = 0.02
    dtype: torch.dtype = torch.float32

    def read(self, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if self.name.endswith("norm.weight"):
            full = torch.ones(self.shape, device=self.device)
        elif self.name.endswith(".bias"):
            full = torch.zeros(self.shape, device=self.device)
        else:
            g = torch.Generator(self.device).manual_seed(
                self.seed * 1_000_003 + zlib.crc32(self.name.encode())
            )
            full = torch.randn(self.shape, generator=g, device=self.device) * self.std
        return full[_index(len(self.shape), dim, start, stop)]


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files that hold the model in ``directory`` (see the module docstring)."""
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a safetensors index (no weight_map): {e}") from e
        files = [directory / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index.name} names files that are not in {directory}: {missing[:3]}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if len(files) > 1:
        files = [f for f in files if not f.name.startswith("consolidated")] or files
    if not files:
        pickles = sorted(p.name for pat in ("*.bin", "*.pt", "*.pth") for p in directory.glob(pat))
        if pickles:
            raise ModelLoadError(
                f"{directory} holds only PyTorch pickle weights ({', '.join(pickles[:3])}); splitserve "
                "loads safetensors: convert them (e.g. transformers' save_pretrained(..., "
                "safe_serialization=True)) or use the model's safetensors release"
            )
        raise ModelLoadError(f"no *.safetensors files in {directory}")
    return files


def safetensors_tensors(directory: Path) -> Iterator[tuple[str, TensorSource]]:
    """Every tensor of the directory's checkpoint files, memory-mapped, once by name."""
    from safetensors import safe_open

    seen: set[str] = set()
    for f in checkpoint_files(directory):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if name not in seen:
                    seen.add(name)
                    yield name, _SafetensorsSlice(fh.get_slice(name), name)


def in_memory_tensors(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, TensorSource]]:
    for name, tensor in pairs:
        yield name, _InMemory(tensor)


def random_tensors(
    shapes: dict[str, tuple[int, ...]], seed: int, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, TensorSource]]:
    for name, shape in shapes.items():
        yield name, _Random(name, shape, seed, torch.device(device))


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of the checkpoint files (what a load reads at most)."""
    return sum(f.stat().st_size for f in checkpoint_files(directory))
