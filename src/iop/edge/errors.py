"""The Edge's one exception hierarchy: everything a request can fail with, before HTTP.

Dispatch, auth, request parsing and the three HTTP apps raise these; `http/responses.py` is the
one place that turns them into HTTP statuses and error bodies, so no other module knows the
status of an error.
"""

from __future__ import annotations


class EdgeError(Exception):
    """A request the Edge answers with an error; `message` is safe to show the client.

    `code` names the error in the body where the answering API has a word of its own for it
    (the admin API's `no_refresh`); by default the error's class decides it."""

    code: str | None = None

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class BadRequest(EdgeError):
    """The request body is not JSON, or a field is missing or has the wrong type or value."""

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.param = param


class Unauthorized(EdgeError):
    """No bearer token where one is required, or a token the config does not know."""

    def __init__(self, message: str, *, missing: bool, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.missing = missing


class RouteNotFound(EdgeError):
    """No such path (or nothing at it yet)."""


class Conflict(EdgeError):
    """What is asked does not fit the state it is asked in (a promote with no change watched)."""


class MethodNotAllowed(EdgeError):
    """A known path asked with the wrong method."""

    def __init__(self, message: str, allowed: str, *, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.allowed = allowed


class PayloadTooLarge(EdgeError):
    """The body is larger than the listener takes (`openai.max_request_bytes`)."""


class ModelNotFound(EdgeError):
    """The `model` is not in the catalog (or left it while the request waited)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist or you do not have access to it.")
        self.model = model


class ResponseNotFound(EdgeError):
    """A stored response's retrieve, delete or cancel names an id this Edge never saw answered
    (or has forgotten): it cannot know which server holds it (404 response_not_found)."""


class ResponseHolderUnavailable(EdgeError):
    """The server that holds a stored response cannot be reached: its provider is out of
    dispatch now (503 response_holder_unavailable, worth a retry), or has left the config
    (`gone`: 410 response_holder_gone, never worth one). `param` names the request's field
    that referred to it, when one did."""

    def __init__(self, message: str, *, gone: bool, param: str | None = None) -> None:
        super().__init__(message)
        self.gone = gone
        self.param = param


class NoProvider(EdgeError):
    """The model is in the catalog but no enabled provider can ever take this request."""


class QueueFull(EdgeError):
    """Every candidate is busy and the model's waiting queue is at its bound."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueTimeout(EdgeError):
    """The request waited the model's queue timeout without a free candidate."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Shed(EdgeError):
    """A sheddable request (a class of negative priority) found its model saturated: refused at
    admission (429 model_saturated), never queued; `retry_after_s` is the queue's estimate."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Displaced(EdgeError):
    """A waiting request gave its place in a full queue to a request of a higher priority
    (503 displaced); it had not started anywhere."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueDeadline(EdgeError):
    """The request waited as long as its class or its own header allow (504
    queue_wait_exceeded), before it reached a server."""


class Forbidden(EdgeError):
    """The caller may not ask for this (403): `code` says what."""


class RateLimited(EdgeError):
    """A limit of `openai.limits[]` has no room for the request (429 rate_limit_exceeded).

    `kind` is OpenAI's error type for it (`requests` or `tokens`); `headers` say when to try
    again (`Retry-After`, `retry-after-ms`, or `x-should-retry: false` when it never passes)
    and the `x-ratelimit-*` state, as `limits/limiter.py` words them.
    """

    def __init__(self, message: str, kind: str, headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__(message)
        self.kind = kind
        self.headers = headers


class TooManyRequests(EdgeError):
    """One client holds as many requests as it may, or failed authentication too often (429):
    `code` says which."""

    def __init__(self, message: str, code: str, retry_after_s: float) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class ProviderFailed(EdgeError):
    """The Node or the provider behind it failed the run (`code` from the wire)."""

    def __init__(self, message: str, code: str, status: int | None) -> None:
        super().__init__(message, code=code)
        self.status = status


# -- refused before a request reaches the app: the HTTP server's caps (http/caps.py) ----------


class HeadersTooLarge(EdgeError):
    """The request line and headers are larger, or more, than the listener accepts (431)."""


class HeaderTimeout(EdgeError):
    """The client did not finish sending its request's head in time (408)."""


class TooManyConnections(EdgeError):
    """The listener holds as many connections as it may; this one is refused (503)."""


class MalformedRequest(EdgeError):
    """The bytes are not an HTTP/1.x request (400)."""


class InternalError(EdgeError):
    """A bug: the Edge failed a request it should have answered (500)."""
