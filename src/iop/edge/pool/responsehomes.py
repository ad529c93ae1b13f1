"""Which server holds each stored response of the Responses API: affinity by response id.

A model server keeps the responses it answered (`store`, OpenAI's default), and only it can
continue one (`previous_response_id`), retrieve, delete or cancel it. The Edge learns where each
one lives as its first answer passes through (the `id` of a JSON answer, or of the
`response.created` event that opens a stream) and remembers it here: the provider that answered
and the model it was asked as. Bounded: the least recently used id is forgotten first, so memory
stays within `limit` entries whatever clients do. docs/edge.md, "The Responses API", says what a
forgotten or unreachable holder gets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: Ids remembered at most by default: about 200 bytes each, a few tens of MB in all.
DEFAULT_LIMIT: Final = 100_000
#: Longest id kept (OpenAI's and vLLM's are about 50 characters): a longer one is not recorded.
MAX_ID_CHARS: Final = 256


@dataclass(frozen=True, slots=True)
class ResponseHome:
    """Where one stored response lives: its provider, and the catalog model it was asked as."""

    provider_id: str
    model_id: str


class ResponseHomes:
    """Response id -> `ResponseHome`, the least recently used forgotten past `limit`."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._homes: OrderedDict[str, ResponseHome] = OrderedDict()
        #: Ids forgotten to stay within the limit, since start.
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._homes)

    def record(self, response_id: str, provider_id: str, model_id: str) -> None:
        if not response_id or len(response_id) > MAX_ID_CHARS:
            return
        homes = self._homes
        homes[response_id] = ResponseHome(provider_id, model_id)
        homes.move_to_end(response_id)
        while len(homes) > self.limit:
            homes.popitem(last=False)
            self.forgotten += 1

    def find(self, response_id: str) -> ResponseHome | None:
        home = self._homes.get(response_id)
        if home is not None:
            self._homes.move_to_end(response_id)
        return home

    def forget(self, response_id: str) -> None:
        self._homes.pop(response_id, None)


class ResponseHomesCollector(Collector):
    """`iop_edge_response_homes` and `..._forgotten_total`, read when Prometheus scrapes."""

    def __init__(self, homes: ResponseHomes) -> None:
        self._homes = homes

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "iop_edge_response_homes",
            "Stored responses (the Responses API) whose holder this Edge remembers.",
            value=len(self._homes),
        )
        yield CounterMetricFamily(
            "iop_edge_response_homes_forgotten",
            "Stored responses whose holder this Edge forgot to stay within its bound (the "
            "least recently used first).",
            value=self._homes.forgotten,
        )


def answer_id(body: bytes) -> str | None:
    """The `id` of a JSON response object."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    found = document.get("id") if isinstance(document, dict) else None
    return found if isinstance(found, str) else None


def stream_id(events: bytes) -> str | None:
    """The response's `id` in the first event of a stream's first chunk (`response.created`,
    whose `response` is the response object), read from its `data:` line."""
    start = events.find(b"data:")
    if start < 0:
        return None
    end = events.find(b"\n", start)
    try:
        document = orjson.loads(events[start + 5 : end if end >= 0 else len(events)])
    except orjson.JSONDecodeError:
        return None
    response = document.get("response") if isinstance(document, dict) else None
    found = response.get("id") if isinstance(response, dict) else None
    return found if isinstance(found, str) else None
