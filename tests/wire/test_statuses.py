"""Upstream failures map to codes once; codes map to the HTTP status an Edge client sees."""

from __future__ import annotations

import grpc
import orjson
import pytest

from iop.wire import RunFailed, statuses


@pytest.mark.parametrize(
    ("status", "code", "retryable"),
    [
        pytest.param(400, statuses.BAD_REQUEST, False, id="400"),
        pytest.param(404, statuses.BAD_REQUEST, False, id="404"),
        pytest.param(401, statuses.UPSTREAM_AUTH, False, id="401"),
        pytest.param(429, statuses.UPSTREAM_RATE_LIMITED, True, id="429"),
        pytest.param(500, statuses.UPSTREAM_ERROR, False, id="500"),
        pytest.param(503, statuses.UPSTREAM_ERROR, False, id="503"),
        pytest.param(504, statuses.UPSTREAM_TIMEOUT, False, id="504"),
    ],
)
def test_upstream_statuses(status: int, code: str, retryable: bool) -> None:
    failed = statuses.upstream_http_failure(
        status, b'{"error": {"message": "boom", "type": "server_error"}}'
    )
    assert (failed.code, failed.retryable, failed.status) == (code, retryable, status)
    assert failed.message == f"upstream answered HTTP {status}: boom"


SECRET = "sk-internal-0123456789abcdef"


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(f"<html>token {SECRET}</html>".encode(), id="html"),
        pytest.param(f"invalid token {SECRET}".encode(), id="text"),
        pytest.param(f'{{"error": "{SECRET}"}}'.encode(), id="error-string"),
        pytest.param(f'{{"message": "{SECRET}", "kind": "Status"}}'.encode(), id="k8s-status"),
        pytest.param(f'{{"data": {{"token": "{SECRET}"}}}}'.encode(), id="other-json"),
        pytest.param(f'["{SECRET}"]'.encode(), id="json-list"),
    ],
)
def test_no_part_of_an_error_body_of_another_shape_reaches_the_client(body: bytes) -> None:
    """A server that is not a model server (an API server, a metadata service) answers with
    bodies of other shapes: the client learns the status only."""
    failed = statuses.upstream_http_failure(403, body)
    assert failed.message == "upstream answered HTTP 403"


def test_vllm_s_older_error_shape_is_shown() -> None:
    body = b'{"object": "error", "message": "maximum context length is 4096", "code": 400}'
    failed = statuses.upstream_http_failure(400, body)
    assert failed.message == "upstream answered HTTP 400: maximum context length is 4096"


def test_an_openai_error_message_is_bounded_and_on_one_line() -> None:
    message = "line one\r\nline two\x00" + "x" * 2000
    body = orjson.dumps({"error": {"message": message}})
    shown = statuses.upstream_http_failure(400, body).message
    assert shown.startswith("upstream answered HTTP 400: line one line two ")
    assert shown.endswith("x…") and len(shown) < 560
    assert "\n" not in shown and "\x00" not in shown


@pytest.mark.parametrize(
    ("failed", "http"),
    [
        pytest.param(statuses.failure(statuses.PROVIDER_BUSY, "x"), 503, id="busy"),
        pytest.param(statuses.failure(statuses.UPSTREAM_TIMEOUT, "x"), 504, id="timeout"),
        pytest.param(statuses.failure(statuses.UPSTREAM_ERROR, "x", status=500), 502, id="5xx"),
        pytest.param(statuses.failure(statuses.BAD_REQUEST, "x", status=422), 422, id="422"),
        pytest.param(RunFailed("something-new", "x", False), 502, id="unknown"),
    ],
)
def test_http_status(failed: RunFailed, http: int) -> None:
    assert statuses.http_status(failed) == http


def test_only_capacity_and_placement_failures_are_retryable() -> None:
    assert statuses.failure(statuses.PROVIDER_BUSY, "").retryable
    assert statuses.failure(statuses.NODE_UNAVAILABLE, "").retryable
    assert not statuses.failure(statuses.UPSTREAM_ERROR, "").retryable


def test_credentials_refusals_are_permanent_for_the_node() -> None:
    refusal = statuses.describe_connection_error(grpc.StatusCode.UNAUTHENTICATED, "wrong token")
    assert refusal.permanent and "wrong token" in refusal.description
    assert not statuses.describe_connection_error(grpc.StatusCode.UNAVAILABLE, None).permanent
