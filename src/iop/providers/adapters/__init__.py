"""Adapters: how a runner, in a Node or in the Edge, runs requests on a provider.

`build_adapter` picks one by `type`:

- `base`: the seam, the `Adapter` protocol and the `Upstream` a probe dials;
- `openai_http`: `OpenAIAdapter` (`type: openai`), any OpenAI-compatible HTTP server, over
  `upstreams`, a lean HTTP/1.1 client; `streamdecoding` reads its answers (a body's JSON
  object, a stream's events as run events) and `upstreamfailures` turns what goes wrong into
  the run's `RunFailed`, once;
- `fake`: `FakeAdapter` (`type: fake`), a deterministic generator in the runner's process.
"""

from __future__ import annotations

from pydantic import TypeAdapter, ValidationError

from iop.edgeconfig import (
    AdapterSettings,
    FakeAdapterSettings,
    OpenAIAdapterSettings,
    ProviderPayload,
    UpstreamPolicy,
)

from .base import Adapter, Upstream
from .fake import FakeAdapter
from .openai_http import OpenAIAdapter

__all__ = ["Adapter", "AdapterError", "FakeAdapter", "OpenAIAdapter", "Upstream", "build_adapter"]


_SETTINGS: TypeAdapter[OpenAIAdapterSettings | FakeAdapterSettings] = TypeAdapter(AdapterSettings)


class AdapterError(Exception):
    """A provider's adapter settings are invalid; the message names the provider and why
    (`provider_id`, and `problem`, the why alone)."""

    def __init__(self, provider_id: str, problem: str) -> None:
        super().__init__(f"provider {provider_id}: {problem}")
        self.provider_id = provider_id
        self.problem = problem


def build_adapter(provider: ProviderPayload, policy: UpstreamPolicy | None = None) -> Adapter:
    """The adapter for `provider`, validated with the same model the Edge's config used; one
    that `policy` refuses reports why as its `problem` and never calls its upstream."""
    try:
        settings = _SETTINGS.validate_python(provider.adapter)
    except ValidationError as exc:
        raise AdapterError(provider.id, f"invalid adapter settings: {_errors(exc)}") from exc
    if isinstance(settings, OpenAIAdapterSettings):
        return OpenAIAdapter(provider.id, settings, policy)
    return FakeAdapter(provider.id, settings)


def _errors(exc: ValidationError) -> str:
    """Each error of the settings, after its path when it has one (an unknown `type` has none)."""
    found = []
    for error in exc.errors(include_url=False):
        path = ".".join(str(p) for p in error["loc"])
        found.append(f"{path}: {error['msg']}" if path else error["msg"])
    return "; ".join(found)
