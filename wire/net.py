"""This machine's address as other machines reach it (stdlib only: every process may need it)."""

from __future__ import annotations

import socket


def default_route_ip() -> str:
    """The address of this machine's default-route interface (what a peer on another node
    can reach), or 127.0.0.1 where there is no network. Connecting a UDP socket sends
    nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
