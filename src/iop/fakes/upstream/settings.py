"""What the fake upstream is told: its settings, and how a request's test hooks (`fake_upstream` in
its body) change the way that one request is answered (latency, speed, an injected failure)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

import orjson

from ..simulating import GpuSettings

#: How an injected failure shows: an error status, a connection dropped before the response,
#: or one dropped in the middle of a stream.
FailMode: TypeAlias = Literal["status", "drop", "drop-mid-stream"]
#: Every `FailMode`, for a command line's choices.
FAIL_MODES: Final = ("status", "drop", "drop-mid-stream")


@dataclass(frozen=True, slots=True)
class FakeUpstreamSettings:
    """How the fake answers; every request can override latency, speed and failure."""

    latency_ms: float = 0.0
    tokens_per_second: float | None = None
    completion_tokens: int = 16
    models: tuple[str, ...] = ()
    fail_rate: float = 0.0
    fail_mode: FailMode = "status"
    error_status: int = 500
    seed: int | None = None
    #: Time completions by a simulated GPU server (None: latency and speed as above).
    gpu: GpuSettings | None = None


@dataclass(frozen=True, slots=True)
class Delivery:
    """How one completion or response is answered: after `latency` seconds, a token every
    `interval` seconds (0: all at once), or with the injected `fault` (its error `status`)."""

    latency: float
    interval: float
    fault: FailMode | None
    status: int


def delivery_of(
    settings: FakeUpstreamSettings, overrides: dict[str, Any], draw: random.Random
) -> Delivery:
    """A request's `Delivery`: its hooks where it has them, the settings elsewhere."""
    latency = hooked_latency(settings, overrides)
    speed = overrides.get("tokens_per_second", settings.tokens_per_second)
    interval = 1 / float(speed) if speed else 0.0
    fault, status = injected_fault(settings, overrides, draw)
    return Delivery(latency, interval, fault, status)


def hooked_latency(settings: FakeUpstreamSettings, overrides: dict[str, Any]) -> float:
    """Seconds before a request's answer (or its injected error status)."""
    return float(overrides.get("latency_ms", settings.latency_ms)) / 1000


def injected_fault(
    settings: FakeUpstreamSettings, overrides: dict[str, Any], draw: random.Random
) -> tuple[FailMode | None, int]:
    """The failure a request asked for, or one drawn at `fail_rate`; and its error status."""
    status = overrides.get("status", settings.error_status)
    status = status if isinstance(status, int) and 400 <= status <= 599 else 500
    mode = overrides.get("fail")
    if mode in FAIL_MODES:
        return mode, status
    if settings.fail_rate > 0 and draw.random() < settings.fail_rate:
        return settings.fail_mode, status
    return None, status


def hooks(body: bytes) -> dict[str, Any]:
    """The test hooks of a request body (`fake_upstream`), or none."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    overrides = document.get("fake_upstream") if isinstance(document, dict) else None
    return overrides if isinstance(overrides, dict) else {}
