"""Listening sockets bound before a server starts, so a taken port fails the command at once."""

from __future__ import annotations

import socket

__all__ = ["bind_listener"]


def bind_listener(host: str, port: int, what: str) -> socket.socket:
    """A TCP socket bound to `host`:`port` (IPv6 when `host` is); the error names `what`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for {what}: {exc}") from exc
    return sock
