"""Deterministic stand-ins for tests, demos and benchmarks.

- `answers`: OpenAI answers, shared by the Node's `fake` adapter and the fake upstream; both send
  the same bytes for the same request, so a test can predict every one of them.
- `configs`: synthetic EdgeConfigs of a given size (nodes of four providers).
- `upstream`: `FakeUpstream`, the fake OpenAI-compatible server (`iop fake-upstream`) that stands
  in for GPU servers: those answers at a configurable latency and speed, and failures on request
  (an error status with an OpenAI error body, a connection dropped before or during an answer).
"""

from .answers import WORDS, Completion, OpenAIError, error_body, parse_request, tokens
from .configs import sized_spec
from .upstream import FailMode, FakeUpstream, FakeUpstreamSettings, UpstreamStats

__all__ = [
    "WORDS",
    "Completion",
    "FailMode",
    "FakeUpstream",
    "FakeUpstreamSettings",
    "OpenAIError",
    "UpstreamStats",
    "error_body",
    "parse_request",
    "sized_spec",
    "tokens",
]
