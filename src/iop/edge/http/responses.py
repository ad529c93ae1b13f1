"""The one place where an Edge error becomes an HTTP status, headers and an error body.

Every app of the Edge answers errors in OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`: the OpenAI API (clients, the official SDKs included, pick their exception class by the
status and show `message`), the admin API and the metrics listener. A run's failure from the
Node (`RunFailed`) gets its status from `iop.wire.statuses`, which the Node and the Edge share,
and becomes a `ProviderFailed` here; a refresh report's status is chosen here too.
"""

from __future__ import annotations

import http
import math
from dataclasses import dataclass
from typing import Final

import orjson

from iop.wire import RunFailed
from iop.wire import statuses as wire_statuses

from ..errors import (
    BadRequest,
    Conflict,
    Displaced,
    EdgeError,
    Forbidden,
    HeadersTooLarge,
    HeaderTimeout,
    MalformedRequest,
    MethodNotAllowed,
    ModelNotFound,
    NoProvider,
    PayloadTooLarge,
    ProviderFailed,
    QueueDeadline,
    QueueFull,
    QueueTimeout,
    RateLimited,
    ResponseHolderUnavailable,
    ResponseNotFound,
    RouteNotFound,
    Shed,
    TooManyConnections,
    TooManyRequests,
    Unauthorized,
)
from ..refresh import RefreshReport
from .exchanges import Exchange

Headers = list[tuple[bytes, bytes]]

_JSON: Final = (b"content-type", b"application/json")


@dataclass(frozen=True, slots=True)
class ErrorResponse:
    status: int
    headers: Headers
    body: bytes


def _shape(error: EdgeError) -> tuple[int, str, str | None, str | None, Headers]:
    """status, type, code, param and extra headers of `error` (its own `code` if it has one)."""
    status, kind, code, param, headers = _class_shape(error)
    return status, kind, error.code or code, param, headers


def _class_shape(error: EdgeError) -> tuple[int, str, str | None, str | None, Headers]:
    if isinstance(error, BadRequest):
        return 400, "invalid_request_error", "invalid_request", error.param, []
    if isinstance(error, Unauthorized):
        code = "missing_api_key" if error.missing else "invalid_api_key"
        return 401, "invalid_request_error", code, None, [(b"www-authenticate", b"Bearer")]
    if isinstance(error, Forbidden):
        return 403, "permission_error", None, None, []
    if isinstance(error, ModelNotFound):
        return 404, "invalid_request_error", "model_not_found", "model", []
    if isinstance(error, RouteNotFound):
        return 404, "invalid_request_error", "unknown_url", None, []
    if isinstance(error, Conflict):
        return 409, "invalid_request_error", "conflict", None, []
    if isinstance(error, MethodNotAllowed):
        return (
            405,
            "invalid_request_error",
            "method_not_allowed",
            None,
            [(b"allow", error.allowed.encode())],
        )
    if isinstance(error, PayloadTooLarge):
        # The connection stays open: the server drops the rest of the body unbuffered, so
        # the client can finish sending and read this answer instead of a connection reset.
        return 413, "invalid_request_error", "request_too_large", None, []
    if isinstance(error, RateLimited):
        return 429, error.kind, "rate_limit_exceeded", None, error.headers
    if isinstance(error, QueueFull):
        return 429, "rate_limit_error", "queue_full", None, [_retry_after(error.retry_after_s)]
    if isinstance(error, Shed):
        return 429, "rate_limit_error", "model_saturated", None, _retry_headers(error.retry_after_s)
    if isinstance(error, Displaced):
        return (
            503,
            "service_unavailable_error",
            "displaced",
            None,
            _retry_headers(error.retry_after_s),
        )
    if isinstance(error, QueueDeadline):
        return 504, "timeout_error", "queue_wait_exceeded", None, []
    if isinstance(error, TooManyRequests):
        return 429, "rate_limit_error", None, None, [_retry_after(error.retry_after_s)]
    if isinstance(error, QueueTimeout):
        return (
            503,
            "service_unavailable_error",
            "queue_timeout",
            None,
            [_retry_after(error.retry_after_s)],
        )
    if isinstance(error, NoProvider):
        return 503, "service_unavailable_error", "no_provider", None, []
    if isinstance(error, ResponseNotFound):
        return 404, "invalid_request_error", "response_not_found", None, []
    if isinstance(error, ResponseHolderUnavailable):
        if error.gone:
            return 410, "invalid_request_error", "response_holder_gone", error.param, []
        return (
            503,
            "service_unavailable_error",
            "response_holder_unavailable",
            error.param,
            [_retry_after(1.0)],
        )
    if isinstance(error, HeadersTooLarge):
        return 431, "invalid_request_error", "request_header_fields_too_large", None, []
    if isinstance(error, HeaderTimeout):
        return 408, "invalid_request_error", "request_timeout", None, []
    if isinstance(error, MalformedRequest):
        return 400, "invalid_request_error", "malformed_http_request", None, []
    if isinstance(error, TooManyConnections):
        return (
            503,
            "service_unavailable_error",
            "too_many_connections",
            None,
            [_retry_after(1.0)],
        )
    if isinstance(error, ProviderFailed):
        status = error.status or 502
        kind = "invalid_request_error" if 400 <= status < 500 else "upstream_error"
        return status, kind, None, None, []
    return 500, "server_error", "internal_error", None, []


def _retry_after(seconds: float) -> tuple[bytes, bytes]:
    return (b"retry-after", str(max(1, math.ceil(seconds))).encode())


def _retry_headers(seconds: float) -> Headers:
    """Retry-After in whole seconds, and the estimate itself in `retry-after-ms`, which the
    official OpenAI clients honour before Retry-After."""
    return [
        _retry_after(seconds),
        (b"retry-after-ms", str(max(1, math.ceil(seconds * 1000))).encode()),
    ]


def _body(error: EdgeError, kind: str, code: str | None, param: str | None) -> bytes:
    return orjson.dumps(
        {"error": {"message": error.message, "type": kind, "param": param, "code": code}}
    )


def error_response(error: EdgeError) -> ErrorResponse:
    """The complete HTTP answer to `error`."""
    status, kind, code, param, headers = _shape(error)
    body = _body(error, kind, code, param)
    return ErrorResponse(
        status, [_JSON, (b"content-length", str(len(body)).encode()), *headers], body
    )


def raw_response(error: EdgeError) -> bytes:
    """The whole HTTP/1.1 answer to `error` as bytes, closing the connection: for what the
    HTTP server refuses before any app sees a request (its limits, malformed framing)."""
    response = error_response(error)
    phrase = http.HTTPStatus(response.status).phrase.encode()
    lines = [b"HTTP/1.1 %d %s" % (response.status, phrase)]
    lines += [name + b": " + value for name, value in response.headers]
    lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + response.body


def error_event(error: EdgeError) -> tuple[int, bytes]:
    """A failure after a stream began: its status (for metrics) and the SSE event to send."""
    status, kind, code, param, _ = _shape(error)
    return status, b"data: " + _body(error, kind, code, param) + b"\n\n"


def typed_error_event(error: EdgeError) -> tuple[int, bytes]:
    """`error_event` for a stream of typed events (the Responses API): an `error` event, with
    the fields of OpenAI's and its `error` object too (which the official clients raise)."""
    status, kind, code, param, _ = _shape(error)
    body = orjson.dumps(
        {
            "type": "error",
            "code": code,
            "message": error.message,
            "param": param,
            "error": {"message": error.message, "type": kind, "param": param, "code": code},
        }
    )
    return status, b"event: error\ndata: " + body + b"\n\n"


def provider_failed(failed: RunFailed) -> ProviderFailed:
    """The Edge error for a run the Node failed."""
    return ProviderFailed(failed.message, failed.code, wire_statuses.http_status(failed))


def ended_early() -> ProviderFailed:
    """The error of a run that ended with neither a result nor a failure."""
    return ProviderFailed("The run ended without a result.", "incomplete_run", 502)


def answer_error(exchange: Exchange, error: EdgeError) -> int:
    """Answer `exchange` with `error`; its status."""
    status, kind, code, param, headers = _shape(error)
    exchange.respond(status, _body(error, kind, code, param), headers=headers)
    return status


def report_status(report: RefreshReport) -> int:
    """The status of a refresh report: 422 invalid, 409 apply refused (restart required, or the
    config was just rolled back), else 200."""
    if report.outcome == "invalid":
        return 422
    if report.outcome == "rolled_back" or (
        report.outcome == "restart_required" and report.mode == "apply"
    ):
        return 409
    return 200
