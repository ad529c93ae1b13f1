"""Waiting for a positive signal, the one way the tests and the end-to-end tests poll.

For state that gives no event to wait on (in another process, behind an API server): poll a
probe until it returns something true, and return that; at the deadline, fail naming what was
awaited and what the probe last said. `wait_for` blocks (kubectl, the Kubernetes API);
`wait_until` awaits, and takes an async probe too (an HTTP call). `wait_available` is the one
wait for an Edge's providers to be available to dispatch.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A wait's deadline passed: the test fails, naming what it waited for."""


def wait_for(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.2,
    show: Callable[[], object] | None = None,
) -> T:
    """Call `probe` every `interval` seconds until it returns something true (returned); after
    `timeout`, raise `WaitTimeout` naming `what` and its last answer (or what `show()` says)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            last = show() if show is not None else value
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


async def wait_until(
    condition: Callable[[], object],
    timeout: float = 10.0,
    interval: float = 0.01,
    *,
    what: str = "the condition",
) -> Any:
    """`wait_for` for async tests: `condition` may be async (an HTTP call), awaited each time."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > until:
            raise WaitTimeout(f"{what} did not hold within {timeout:g}s; last: {value!r}")
        await asyncio.sleep(interval)


async def wait_available(url: str, providers: list[str], timeout: float = 20) -> None:
    """Until the Edge at `url` lists exactly `providers` as available to dispatch (/readyz)."""
    async with httpx.AsyncClient(base_url=url) as http:

        async def available() -> object:
            ready = (await http.get("/readyz")).json()
            return ready["providers_available"] == providers or None

        await wait_until(available, timeout, 0.05, what=f"providers {providers} at {url}")
