"""Deterministic OpenAI answers, shared by the Node's `fake` adapter and the fake upstream.

Both send the same bytes for the same request, so a test can predict every one of them.
"""

from .answers import WORDS, Completion, OpenAIError, error_body, parse_request, tokens

__all__ = ["WORDS", "Completion", "OpenAIError", "error_body", "parse_request", "tokens"]
