"""Pieces shared by the two-sided backends (``torch_dist``, ``ucx``), where a sink
asks and the source answers: numbered exports, and telling a dead source from a
slow one."""

from __future__ import annotations

import socket


class TransferNumbers:
    """A source's numbers for its published exports. A sink's request names a transfer
    by number (one int64 on the wire); a number is never reused by the same source."""

    def __init__(self) -> None:
        self._last = 0
        self._ids: dict[int, str] = {}

    def add(self, transfer_id: str) -> int:
        self._last += 1
        self._ids[self._last] = transfer_id
        return self._last

    def remove(self, number: int) -> None:
        self._ids.pop(number, None)

    def get(self, number: int) -> str | None:
        """The transfer numbered ``number``, or None once it was removed (or never was)."""
        return self._ids.get(number)


def accepts_connections(host: str, port: int, timeout_s: float) -> bool:
    """False once nothing accepts TCP connections at ``host:port``: the process that
    listened there is gone. A fresh connection each call, so a stale socket cannot hide
    that. A slow or unreachable address is no proof of death and answers True (the
    caller's deadline still holds)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
