"""A fake OpenAI-compatible upstream for tests, demos and benchmarks (`iop fake-upstream`).

It answers `/v1/models`, `/v1/chat/completions`, `/v1/completions` (streaming or not) and
`/v1/embeddings` with the bytes OpenAI would send, at a configurable latency and speed, and fails
on request: an error status with an OpenAI error body, or a connection dropped before or during
the response. With `GpuSettings` its completions follow a simulated GPU server instead
(`simulating.py`).
"""

from .serving import FailMode, FakeUpstream, FakeUpstreamSettings, UpstreamStats
from .simulating import GpuEngine, GpuSettings

__all__ = [
    "FailMode",
    "FakeUpstream",
    "FakeUpstreamSettings",
    "GpuEngine",
    "GpuSettings",
    "UpstreamStats",
]
