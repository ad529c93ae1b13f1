"""Ports for processes that bind them later than the caller picks them."""

from __future__ import annotations

import contextlib
import os
import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_SPAN = 12_000
SHARE_VARIABLE = "IOP_PORT_SHARE"
"""`K/N`: processes that pick ports at once (workers of a parallel test run) each pick from a
share of their own, the K-th of N (children inherit it)."""

_handed: set[int] = set()


def share_ports(index: int, count: int) -> None:
    """Pick this process's ports (and its children's) from the `index`-th of `count` shares."""
    os.environ[SHARE_VARIABLE] = f"{index}/{count}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, below the kernel's ephemeral range, that this process has not
    handed out before.

    The caller names it (in a config, on a command line) before a process binds it; meanwhile
    every outgoing connection and every server bound to port 0 takes its port from that range,
    never from below it, so none can take this one first; nor can another process of a parallel
    run that was given another share (`share_ports`), nor a later call of this one.
    """
    low, high = _window()
    for _ in range(200):
        port = random.randrange(low, high)
        if port in _handed:
            continue
        with contextlib.closing(socket.socket()) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{high - 1} on {host}")


def _window() -> tuple[int, int]:
    ephemeral = int(_EPHEMERAL_RANGE.read_text().split()[0]) if _EPHEMERAL_RANGE.exists() else 32768
    low = max(1024, ephemeral - _SPAN)
    index, _, count = os.environ.get(SHARE_VARIABLE, "0/1").partition("/")
    width = (ephemeral - low) // max(1, int(count))
    start = low + int(index) * width
    return start, start + width
