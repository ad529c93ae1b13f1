"""Guessing API keys shows and slows: an address that failed authentication
`openai.auth_failures_per_minute` times gets 429 `too_many_auth_failures` with Retry-After for
whatever it sends next, a right key included (so guesses tell it nothing), while other
addresses are served; the log names the address and the key's hash prefix, never the key, at
a bounded rate; the metrics count each reason.

The finding replayed: 4 connections from one address sending wrong keys as fast as they can
(4,843 a second went through unthrottled and unlogged before).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import httpx
import pytest

from iop.edge.authfailures import token_hint
from testkit import CLIENT_TOKEN

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]

GUESSER = "127.0.0.2"
BUDGET = 20


async def test_wrong_keys_are_throttled_per_address_and_logged_without_the_keys(
    document_of, start_edge, start_node, until, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    document = document_of(
        [{"id": "p1", "adapter": {"type": "fake", "completion_tokens": 2}, "served_models": ["s"]}],
        openai={"auth_failures_per_minute": BUDGET},
        edge={"admin": {"listen": "127.0.0.1:0"}},
    )
    edge = await start_edge(document)
    await start_node(edge.hub)
    await until(lambda: edge.dispatcher.available == {"p1"})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def client(source: str, key: str | None) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(
            base_url=edge.url,
            headers=headers,
            transport=httpx.AsyncHTTPTransport(local_address=source),
            timeout=30,
        )

    statuses: list[int] = []
    retry_after: set[str] = set()

    async def guess(worker: int) -> None:
        async with client(GUESSER, None) as http:
            for attempt in range(25):
                key = f"sk-guess-{worker}-{attempt}"
                answer = await http.post(
                    "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
                )
                statuses.append(answer.status_code)
                if answer.status_code == 429:
                    assert answer.json()["error"]["code"] == "too_many_auth_failures"
                    retry_after.add(answer.headers["retry-after"])

    began = time.monotonic()
    await asyncio.gather(*(guess(worker) for worker in range(4)))
    # The budget, then one more guess each time it refills (a minute's budget over a minute).
    refilled = math.ceil((time.monotonic() - began) * BUDGET / 60)
    assert BUDGET <= statuses.count(401) <= BUDGET + refilled, statuses
    assert statuses.count(429) == 100 - statuses.count(401)
    assert retry_after and all(int(value) >= 1 for value in retry_after)
    # A right key from the throttled address is refused too (once a wrong one was: the budget
    # may have refilled by one meanwhile); another address is served.
    extra = 0
    async with client(GUESSER, CLIENT_TOKEN) as http:
        wrong = {"authorization": "Bearer sk-one-more-guess"}
        while (
            await http.post("/v1/chat/completions", json=body, headers=wrong)
        ).status_code == 401:
            extra += 1
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 429
    async with client("127.0.0.1", CLIENT_TOKEN) as http:
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        # No key, and a key that is not a bearer token, count under their own reasons.
        assert (await http.get("/v1/models", headers={"authorization": ""})).status_code == 401
        malformed = {"authorization": "Basic c2VjcmV0"}
        assert (await http.get("/v1/models", headers=malformed)).status_code == 401
    text = "\n".join(record.getMessage() for record in caplog.records)
    assert "sk-guess-" not in text
    lines = [r.getMessage() for r in caplog.records if "failed authentication" in r.getMessage()]
    # One line every 10 s at most (and the one that says the address is throttled), whatever
    # the guesser sends.
    assert 1 <= len(lines) <= 2 + (time.monotonic() - began) / 10, lines
    assert GUESSER in lines[0] and "token sha256 " in lines[0]
    hint = lines[0].split("token sha256 ")[1][:8]
    assert hint in {token_hint(f"sk-guess-{w}-0") for w in range(4)}
    assert any(f"throttling {GUESSER}" in r.getMessage() for r in caplog.records)
    metrics = edge.metrics.render().decode()
    failed = statuses.count(401) + extra
    invalid = f'iop_edge_auth_failures_total{{listener="openai",reason="invalid"}} {failed}.0'
    assert invalid in metrics
    assert 'iop_edge_auth_failures_total{listener="openai",reason="missing"} 1.0' in metrics
    assert 'iop_edge_auth_failures_total{listener="openai",reason="malformed"} 1.0' in metrics
    # The guesses past the budget, the one more that found it spent, the right key after it.
    throttled_count = statuses.count(429) + 2
    throttled = f'iop_edge_auth_throttled_total{{listener="openai"}} {throttled_count}.0'
    assert throttled in metrics
