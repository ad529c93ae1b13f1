"""Deterministic stand-ins for tests, demos and benchmarks.

- `answers`: OpenAI answers, shared by the `fake` adapter and the fake upstream; both send the
  same bytes for the same request, so a test can predict every one of them.
- `configs`: synthetic EdgeConfigs of a given size (nodes of four providers).
- `upstream`: `FakeUpstream`, the fake OpenAI-compatible server (`iop fake-upstream`) that stands
  in for GPU servers: those answers (embeddings too) at a configurable latency and speed, and
  failures on request (an error status, a connection dropped before or during an answer).
- `collector`: `FakeCollector`, an OpenTelemetry collector's trace receiver (`iop
  fake-collector`): OTLP/gRPC in, the spans it got as JSON out, for tests and demos.
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
from .collector import FakeCollector
from .configs import sized_spec
from .simulating import GpuEngine, GpuSettings
from .upstream import FAIL_MODES, FakeUpstream, FakeUpstreamSettings

__all__ = [
    "EMBEDDING_DIMENSIONS",
    "FAIL_MODES",
    "FakeCollector",
    "FakeUpstream",
    "FakeUpstreamSettings",
    "GpuEngine",
    "GpuSettings",
    "OpenAIError",
    "embedding_response",
    "embedding_vector",
    "parse_request",
    "sized_spec",
    "tokens",
]
