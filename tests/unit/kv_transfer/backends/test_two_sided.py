"""``kv_transfer.backends.two_sided``: export numbers and the liveness probe that the
torch_dist and ucx sinks use to tell a dead source from a slow one."""

from __future__ import annotations

import socket

from splitserve.kv_transfer.backends.two_sided import TransferNumbers, accepts_connections


def test_numbers_are_never_reused_and_removed_ones_are_gone():
    numbers = TransferNumbers()
    a, b = numbers.add("t-a"), numbers.add("t-b")
    assert a != b and numbers.get(a) == "t-a" and numbers.get(b) == "t-b"
    numbers.remove(a)
    assert numbers.get(a) is None
    assert numbers.add("t-c") not in (a, b)
    numbers.remove(12345)  # unknown: no error


def test_a_listening_port_accepts_and_a_closed_one_does_not():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    assert accepts_connections("127.0.0.1", port, 1.0)
    server.close()
    assert not accepts_connections("127.0.0.1", port, 1.0)
