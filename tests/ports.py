"""A free loopback TCP port, for the brokers, clusters and gateways tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nobody listens on right now (loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
