"""Swapping layers of a built model for other implementations (CPU packing,
quantization, FP8 checkpoint shells) through one walk."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def replace_children(root: nn.Module, kind: type[nn.Module], make: Callable[[nn.Module], nn.Module]) -> int:
    """Replace every submodule of ``root`` of type ``kind`` by ``make(it)``, in place;
    returns how many were replaced. The walk holds references to the parents only,
    so each replaced module (and its weights, unless shared) is freed as soon as its
    replacement exists: a conversion costs one layer's memory, not the model's."""
    parents = [m for m in root.modules() if not isinstance(m, kind)]
    replaced = 0
    for parent in parents:
        for name in [n for n, child in parent.named_children() if isinstance(child, kind)]:
            setattr(parent, name, make(getattr(parent, name)))
            replaced += 1
    return replaced
