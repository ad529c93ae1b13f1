"""The fake OpenAI-compatible upstream (`iop fake-upstream`): an HTTP/1.1 server on asyncio and
httptools, faithful (OpenAI's paths, bodies, SSE framing and error bodies), cheap, and failing on
request; docs/architecture.md, "The fakes", says how and why.

- `server`: `FakeUpstream`: its lifecycle, its routes, its answers (counted in flight, failing as
  asked).
- `settings`: `FakeUpstreamSettings`, `FAIL_MODES`, and how a request's test hooks
  (`fake_upstream` in its body) change its latency, speed and failure.
- `stats`: what it saw (`GET /fake/stats`).
- `connection`: one client connection: requests parsed, responses and streams written.
- `streaming`: the SSE chunks of completion and Responses API streams, the one paced writer
  they share, and its counterpart for a whole answer.
- `gpuclock`: the simulated GPU server (`simulating.GpuEngine`) run in real time, and the
  completions it times.
"""

from .server import FakeUpstream
from .settings import FAIL_MODES, FakeUpstreamSettings

__all__ = ["FAIL_MODES", "FakeUpstream", "FakeUpstreamSettings"]
