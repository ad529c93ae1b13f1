"""Deterministic stand-ins for tests, demos and benchmarks.

- `answers`: OpenAI answers, shared by the `fake` adapter and the fake upstream; both send the
  same bytes for the same request, so a test can predict every one of them.
- `responses`: OpenAI's Responses API answers (a response, its typed stream events) and the
  responses a server keeps for `previous_response_id`, retrieve, delete and cancel.
- `configs`: synthetic EdgeConfigs of a given size (nodes of four providers).
- `upstream`: `FakeUpstream`, the fake OpenAI-compatible server (`iop fake-upstream`) that stands
  in for GPU servers: those answers (embeddings too) at a configurable latency and speed, and
  failures on request (an error status, a connection dropped before or during an answer).
- `collector`: `FakeCollector`, an OpenTelemetry collector's trace receiver (`iop
  fake-collector`): OTLP/gRPC in, the spans it got as JSON out, for tests and demos. Imported
  by its own name (`iop.fakes.collector`), so that grpc and aiohttp load only where spans are
  received, never with the fake upstream.
- `simulating`: `GpuEngine`, a simulated GPU model server behind the fake upstream's completions
  when given `GpuSettings` (`iop fake-upstream --gpu`; docs/architecture.md, "The fakes").
"""

from .answers import (
    EMBEDDING_DIMENSIONS,
    OpenAIError,
    embedding_response,
    embedding_vector,
    parse_request,
    tokens,
)
from .configs import sized_spec
from .responses import ResponseStore, parse_response_request
from .simulating import GpuEngine, GpuSettings
from .upstream import FAIL_MODES, FakeUpstream, FakeUpstreamSettings

__all__ = [
    "EMBEDDING_DIMENSIONS",
    "FAIL_MODES",
    "FakeUpstream",
    "FakeUpstreamSettings",
    "GpuEngine",
    "GpuSettings",
    "OpenAIError",
    "ResponseStore",
    "embedding_response",
    "embedding_vector",
    "parse_request",
    "parse_response_request",
    "sized_spec",
    "tokens",
]
