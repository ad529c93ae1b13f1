"""A fake OpenAI-compatible upstream for tests, demos and benchmarks (`iop fake-upstream`).

It answers `/v1/models`, `/v1/chat/completions` and `/v1/completions`, streaming or not, with
the bytes OpenAI would send, at a configurable latency and speed, and fails on request: an error
status with an OpenAI error body, or a connection dropped before or during the response.
"""

from .serving import FailMode, FakeUpstream, FakeUpstreamSettings, UpstreamStats

__all__ = ["FailMode", "FakeUpstream", "FakeUpstreamSettings", "UpstreamStats"]
