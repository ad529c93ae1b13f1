"""Where a server listens: `host:port` checked, and its socket bound before the server starts,
so a taken port fails the command at once; and the addresses a service name lists now (every
pod a headless Service lists)."""

from __future__ import annotations

import asyncio
import ipaddress
import re
import resource
import socket
from collections.abc import Awaitable, Callable
from typing import Final


def split_listener(value: str) -> tuple[str, int]:
    """Split `host:port` (IPv6 as `[::1]:80`); raise ValueError naming what is wrong."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError("must be host:port, for example 127.0.0.1:8080")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address") from None
    elif not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", host):
        raise ValueError(f"{host!r} is not a host name or IP address (IPv6 goes in brackets)")
    if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"port {port_text!r} must be a number from 0 to 65535")
    return host, int(port_text)


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


#: `await resolve(host, port)`: the addresses (`ip:port`, `[ip6]:port`) a name lists now;
#: raises OSError when the name does not resolve. The seam of the lookups of Nodes and Edges.
Resolve = Callable[[str, int], Awaitable[list[str]]]


async def resolve_service(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (the system's resolver: cluster DNS in a pod)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found: list[str] = []
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if address not in found:
            found.append(address)
    return found


#: Open files a server keeps for everything but client and Node connections (listeners, logs,
#: config reads, upstream sockets of the tests' in-process parts) when it fits its connection
#: caps to the open-file limit.
FD_RESERVE: Final = 256


def open_file_limit() -> int:
    """The process's soft open-file limit (ulimit -n)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def open_file_room(open_files: int | None = None) -> int:
    """Open files left for connections under the soft open-file limit (`open_files`, read from
    the process by default) once `FD_RESERVE` is kept."""
    open_files = open_file_limit() if open_files is None else open_files
    return max(1, open_files - FD_RESERVE)
