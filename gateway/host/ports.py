"""A free TCP port of this host."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick), for a server started next."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
