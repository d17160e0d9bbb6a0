"""Free loopback ports for tests and benchmarks."""

from __future__ import annotations

import socket

_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before in this process: the kernel may offer a port it
    just gave back, and two listeners of one test must not be told the same one."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
