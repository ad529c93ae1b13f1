"""The few ASGI pieces the Edge's raw apps share: scope types, headers, one-shot bodies, lifespan.

The OpenAI API, the admin API and the metrics app (`openaiapp.py`, `adminapp.py`,
`metricsapp.py`) use them, and so do `clientguard.py` (which wraps the OpenAI app),
`responses.py` (which renders every error) and `server.py` (an HTTP/1.0 stream). All three apps
are plain ASGI callables on uvicorn rather than framework apps: the OpenAI API measured faster
that way (docs/benchmarks.md). These helpers keep the protocol details in one place.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

#: The ASGI connection scope.
Scope = MutableMapping[str, Any]
#: One ASGI event, received or sent.
Message = MutableMapping[str, Any]
#: The ASGI `receive` callable.
Receive = Callable[[], Awaitable[Message]]
#: The ASGI `send` callable.
Send = Callable[[Message], Awaitable[None]]


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of request header `name` (lowercase), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


async def send_body(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """A complete response: status, content type and length, extra headers, body."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def not_http(scope: Scope, receive: Receive, send: Send) -> bool:
    """Serve a scope that is not an HTTP request: the lifespan protocol is accepted, anything
    else (websockets) ignored; True when `scope` was one, so the app has nothing to do."""
    if scope["type"] == "http":
        return False
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
    return True


async def _lifespan(receive: Receive, send: Send) -> None:
    """Accept the lifespan protocol; the process (server.py) owns the Edge's lifecycle."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
