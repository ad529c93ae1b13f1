"""A real OTLP/gRPC trace receiver for the tests and benchmarks: the product's fake collector
(`iop.fakes.collector.FakeCollector`, the collector's TraceService) in the test's own process, on a
loopback port, keeping what the processes under test export.

The processes export with the OpenTelemetry SDK's own OTLP exporter, as they would to a
collector: `environment()` gives the variables that point them here (and export each batch
within 100 ms instead of the SDK's 5 s).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from iop.fakes.collector import FakeCollector


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, its ids in lowercase hex as `traceparent` writes them."""

    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any] = field(default_factory=dict)
    #: The status code's name: unset, ok or error.
    status: str = "unset"


class OtlpReceiver:
    """`async with OtlpReceiver() as receiver:` a TraceService on 127.0.0.1; `spans` holds what
    arrived."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.port = 0
        self._collector = FakeCollector()
        self._collector.listeners.append(self._took)
        self._arrived = asyncio.Event()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self, **extra: str) -> dict[str, str]:
        """The variables that make an IOP process export its spans here."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            **extra,
        }

    def _took(self, spans: list[dict[str, Any]]) -> None:
        self.spans.extend(ReceivedSpan(**span) for span in spans)
        self._arrived.set()

    async def wait_until(
        self, holds: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0
    ) -> list[ReceivedSpan]:
        """Until `holds(spans)` of every span arrived (TimeoutError after `timeout`)."""
        async with asyncio.timeout(timeout):
            while not holds(self.spans):
                self._arrived.clear()
                await self._arrived.wait()
        return self.spans

    async def wait_for_trace(
        self, trace_id: str, names: Collection[str], timeout: float = 30.0
    ) -> list[ReceivedSpan]:
        """Until the trace `trace_id` has a span of each of `names`; that trace's spans (others
        may still come: a process exports its spans in batches of its own)."""

        def complete(spans: list[ReceivedSpan]) -> bool:
            return set(names) <= {span.name for span in spans if span.trace_id == trace_id}

        spans = await self.wait_until(complete, timeout)
        return [span for span in spans if span.trace_id == trace_id]

    async def __aenter__(self) -> Self:
        self.port, _ = await self._collector.start("127.0.0.1:0")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._collector.stop()
