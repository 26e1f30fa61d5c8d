"""Lazy package attributes (PEP 562): a package re-exports names from its modules
without importing them until first use, so importing the package for its
plain-data records does not load torch."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_attributes(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``exports`` maps a name to the
    submodule (relative to ``package``) that defines it; the first access imports
    it and caches the value in the package."""

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
