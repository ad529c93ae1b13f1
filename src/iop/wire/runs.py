"""The values a run is made of: the request the Edge sends and the events the Node sends back.

Both sides and the dispatch layer speak these frozen dataclasses; only `converting.py` knows the
protobuf messages they travel in. A run yields its events in order and ends with exactly one
terminal event, `RunDone` or `RunFailed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

#: The largest answer a Node reads for a run that names no bound of its own (the default of the
#: Edge's `openai.max_response_bytes`, and what a Node applies for an Edge that predates it).
DEFAULT_MAX_RESPONSE_BYTES: Final = 32 * 1024 * 1024

#: The OpenAI endpoint a run is for: /v1/chat/completions, /v1/completions or /v1/embeddings.
RunKind: TypeAlias = Literal["chat", "completion", "embedding"]


@dataclass(frozen=True, slots=True)
class RunRequest:
    """One OpenAI request for one provider.

    `body` is the OpenAI JSON request body, already rewritten by the Edge (served model name,
    generation policy); `stream_options` stays as the client sent it, so the Node knows whether
    the client wants the usage-only chunk. `deadline` is `time.time()` seconds (the wire carries
    the time left, so clocks of different hosts never matter). `long_context` makes the run hold
    one of the provider's long-context slots too. `max_response_bytes` bounds the answer the
    Node reads and sends (a whole body, or one event of a stream); None: the Node's default,
    `DEFAULT_MAX_RESPONSE_BYTES`. `sse_chunks`: the Edge takes a stream's chunks as whole
    server-sent events (`RunChunk.sse`).
    """

    run_id: str
    provider_id: str
    served_model: str
    kind: RunKind
    body: bytes
    stream: bool
    deadline: float | None = None
    long_context: bool = False
    max_response_bytes: int | None = None
    sse_chunks: bool = False
    #: The W3C `traceparent` the run continues (`iop.tracing`), well formed; None: no trace.
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class RunChunk:
    """One OpenAI JSON object, or whole server-sent events of a stream.

    The whole response body when the run does not stream, or one chunk object (the JSON after
    `data: `) when it does. `usage_only` marks the final usage-only chunk (empty `choices`) of a
    stream whose client asked for `stream_options.include_usage`; when the client did not ask,
    the Node drops that chunk (it always asks the upstream, to meter) and sends only `RunUsage`.

    `sse`: `data` is one or more whole events of a stream, framed as the client gets them
    (`data: {...}\n\n` each), passed through as the upstream wrote them in one read (for a run
    whose request has `sse_chunks`). It never holds the usage-only chunk the client did not ask
    for, nor `data: [DONE]`, which the Edge writes.
    """

    data: bytes
    usage_only: bool = False
    sse: bool = False


@dataclass(frozen=True, slots=True)
class RunUsage:
    """Token counts, sent once before `RunDone` whenever the upstream reported them."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True, slots=True)
class RunDone:
    """The run finished; `finish_reason` as the upstream gave it (stop, length, ...)."""

    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class RunFailed:
    """The run ended in an error; the codes and what they mean are in `statuses.py`.

    `retryable` means nothing reached the client yet and another candidate may serve the run
    (`provider_busy` is the capacity refusal: try another candidate or wait, never fail the
    request). `status` is the upstream's HTTP status when there was one.
    """

    code: str
    message: str
    retryable: bool
    status: int | None = None


#: One event of a run, in order; exactly one terminal event ends each run.
RunEvent: TypeAlias = RunChunk | RunUsage | RunDone | RunFailed

#: The events that end a run.
TERMINAL_EVENTS: Final = (RunDone, RunFailed)


@dataclass(frozen=True, slots=True)
class ProviderHealth:
    """What a Node says about one of its providers: `reason` is a code of `nodestates.py`
    (empty when healthy), `detail` the sentence for people."""

    provider_id: str
    healthy: bool
    detail: str = ""
    reason: str = ""
