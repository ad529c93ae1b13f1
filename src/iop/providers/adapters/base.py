"""The adapter seam: what a runner (in a Node or in the Edge) needs to run an OpenAI request.

An adapter turns a `RunRequest` into the wire's events and owns whatever it talks through (an
HTTP connection pool, a generator). It translates its own failures into a terminal `RunFailed`
at this boundary; an exception escaping `run` is a bug, which the runner reports as
`internal_error`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from iop.wire import ProviderHealth, RunEvent, RunRequest


@dataclass(frozen=True, slots=True)
class Upstream:
    """Where an adapter's model server is, and the headers it sends there: what a probe dials."""

    base_url: str
    #: May hold the API key: never shown.
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)


class Adapter(Protocol):
    """One provider's way of running requests; built from its payload, closed after draining."""

    @property
    def problem(self) -> str:
        """Why the adapter cannot run on this node, from its settings and the node's own
        environment (an API key variable unset or malformed); empty when it can. A model server
        that is down is no problem of this kind: probes and failing runs judge that."""
        ...

    @property
    def health(self) -> ProviderHealth:
        """What the adapter knows about its provider's health from its settings alone (reason
        `adapter_error` when it cannot run: its `problem`, or it is closed); probes and failing
        runs judge the rest."""
        ...

    @property
    def upstream(self) -> Upstream | None:
        """The model server the adapter talks to; None when it has none (nothing to probe)."""
        ...

    def run(self, request: RunRequest) -> AsyncGenerator[RunEvent, None]:
        """The run's events, in order, ending with exactly one `RunDone` or `RunFailed`.

        Cancelling the consuming task (the Edge's Cancel) must abort upstream work at once.
        """
        ...

    async def aclose(self) -> None:
        """Release what the adapter holds; called once no run uses it (or the drain timed out)."""
        ...


def client_wants_usage(document: dict[str, Any]) -> bool:
    """Whether a streaming request's client asked for the usage-only chunk itself."""
    options = document.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def usage_from(document: dict[str, Any]) -> tuple[int, int, int] | None:
    """(prompt, completion, total) tokens of an OpenAI object's `usage`, when it has one (an
    embeddings answer's has no completion tokens: 0; a Responses answer's are its input and
    output tokens)."""
    usage = document.get("usage")
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" in usage:
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens", 0)
    else:
        prompt = usage.get("input_tokens")
        completion = usage.get("output_tokens", 0)
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    total = usage.get("total_tokens")
    return prompt, completion, total if isinstance(total, int) else prompt + completion
