"""Deterministic stand-ins for tests, demos and benchmarks.

- `answers`: OpenAI answers, shared by the Node's `fake` adapter and the fake upstream; both send
  the same bytes for the same request, so a test can predict every one of them.
- `configs`: synthetic EdgeConfigs of a given size (nodes of four providers).
"""

from .answers import (
    EMBEDDING_DIMENSIONS,
    WORDS,
    Completion,
    OpenAIError,
    embedding_response,
    embedding_vector,
    error_body,
    parse_request,
    tokens,
)
from .configs import sized_spec

__all__ = [
    "EMBEDDING_DIMENSIONS",
    "WORDS",
    "Completion",
    "OpenAIError",
    "embedding_response",
    "embedding_vector",
    "error_body",
    "parse_request",
    "sized_spec",
    "tokens",
]
