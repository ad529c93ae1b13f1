"""Ports for processes that bind them later than the caller picks them."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now and below the kernel's ephemeral range.

    The caller names it (in a config, on a command line) before a process binds it; meanwhile
    every outgoing connection and every server bound to port 0 takes its port from that range,
    never from below it, so none can take this one first.
    """
    low = int(_EPHEMERAL_RANGE.read_text().split()[0]) if _EPHEMERAL_RANGE.exists() else 32768
    for _ in range(200):
        port = random.randrange(max(1024, low - 12_000), low)
        with contextlib.closing(socket.socket()) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} on {host}")
