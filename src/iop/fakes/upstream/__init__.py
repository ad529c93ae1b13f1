"""The fake OpenAI-compatible upstream (`iop fake-upstream`; docs/architecture.md, "The fakes").

- `server`: `FakeUpstream`, the server: its settings, its counts, its routes and its answers.
"""

from .server import FAIL_MODES, FakeUpstream, FakeUpstreamSettings

__all__ = ["FAIL_MODES", "FakeUpstream", "FakeUpstreamSettings"]
