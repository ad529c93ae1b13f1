"""Protobuf messages <-> the wire's values and the config payloads, for both ends of the stream.

These are the conversions of what a run, a health report, a drain, a load, a payload and the
liveness settings carry; the envelopes around them (hello, welcome, heartbeats, cancels, acks)
are built and read at the two ends themselves: the Edge's `hub/nodehub.py`,
`hub/nodesessions.py` and `hub/runstreams.py`, the Node's `connecting.py`. Nothing above those
ends sees a message.

These functions run for every run and event on both sides, so they stay plain: no reflection,
no intermediate dicts.
"""

from __future__ import annotations

import time
from typing import Final

import orjson
from pydantic import ValidationError

from iop.edgeconfig import HealthPolicy, NodePayload, ProviderPayload
from iop.tracing import valid_traceparent

from . import runtime_pb2 as pb
from .liveness import Liveness
from .nodestates import MAX_ADAPTERS, ConfigAck, DrainProgress, ServerLoad
from .runs import (
    ProviderHealth,
    RunChunk,
    RunDone,
    RunEvent,
    RunFailed,
    RunKind,
    RunRequest,
    RunUsage,
)
from .texts import MAX_ID_CHARS, bounded

_KIND_TO_PROTO: Final[dict[str, pb.RunKind.ValueType]] = {
    "chat": pb.RUN_KIND_CHAT,
    "completion": pb.RUN_KIND_COMPLETION,
    "embedding": pb.RUN_KIND_EMBEDDING,
    "response": pb.RUN_KIND_RESPONSE,
    "response_retrieve": pb.RUN_KIND_RESPONSE_RETRIEVE,
    "response_delete": pb.RUN_KIND_RESPONSE_DELETE,
    "response_cancel": pb.RUN_KIND_RESPONSE_CANCEL,
}
_KIND_FROM_PROTO: Final[dict[int, RunKind]] = {
    pb.RUN_KIND_CHAT: "chat",
    pb.RUN_KIND_COMPLETION: "completion",
    pb.RUN_KIND_EMBEDDING: "embedding",
    pb.RUN_KIND_RESPONSE: "response",
    pb.RUN_KIND_RESPONSE_RETRIEVE: "response_retrieve",
    pb.RUN_KIND_RESPONSE_DELETE: "response_delete",
    pb.RUN_KIND_RESPONSE_CANCEL: "response_cancel",
}
#: A deadline already past still travels as a tiny positive timeout (0 means none on the wire).
_EXPIRED: Final = 1e-6


def request_to_proto(request: RunRequest, now: float | None = None) -> pb.RunRequest:
    """The protobuf of a run; the deadline travels as seconds remaining (clocks differ)."""
    timeout = 0.0
    if request.deadline is not None:
        timeout = max(request.deadline - (time.time() if now is None else now), _EXPIRED)
    return pb.RunRequest(
        run_id=request.run_id,
        provider_id=request.provider_id,
        served_model=request.served_model,
        kind=_KIND_TO_PROTO[request.kind],
        body=request.body,
        stream=request.stream,
        timeout_s=timeout,
        long_context=request.long_context,
        max_response_bytes=request.max_response_bytes or 0,
        sse_chunks=request.sse_chunks,
        traceparent=request.traceparent or "",
        response_id=request.response_id,
    )


def request_from_proto(message: pb.RunRequest, now: float | None = None) -> RunRequest:
    """The request as the receiving host sees it: its deadline is on the local clock.

    Raises ValueError for a request kind this side does not know.
    """
    kind = _KIND_FROM_PROTO.get(message.kind)
    if kind is None:
        raise ValueError(f"unknown run kind {message.kind}")
    deadline = None
    if message.timeout_s > 0:
        deadline = (time.time() if now is None else now) + message.timeout_s
    return RunRequest(
        run_id=message.run_id,
        provider_id=message.provider_id,
        served_model=message.served_model,
        kind=kind,
        body=message.body,
        stream=message.stream,
        deadline=deadline,
        long_context=message.long_context,
        max_response_bytes=message.max_response_bytes or None,
        sse_chunks=message.sse_chunks,
        traceparent=valid_traceparent(message.traceparent),
        response_id=message.response_id,
    )


def event_to_proto(run_id: str, event: RunEvent) -> pb.RunEvent:
    """The protobuf of one event of run `run_id`."""
    if isinstance(event, RunChunk):
        return pb.RunEvent(
            run_id=run_id,
            chunk=pb.RunChunk(data=event.data, usage_only=event.usage_only, sse=event.sse),
        )
    if isinstance(event, RunUsage):
        return pb.RunEvent(
            run_id=run_id,
            usage=pb.RunUsage(
                prompt_tokens=event.prompt_tokens,
                completion_tokens=event.completion_tokens,
                total_tokens=event.total_tokens,
            ),
        )
    if isinstance(event, RunDone):
        return pb.RunEvent(run_id=run_id, done=pb.RunDone(finish_reason=event.finish_reason or ""))
    return pb.RunEvent(
        run_id=run_id,
        error=pb.RunError(
            code=event.code,
            message=event.message,
            retryable=event.retryable,
            status=event.status or 0,
        ),
    )


def chunk_to_pieces(run_id: str, chunk: RunChunk, piece_bytes: int) -> list[pb.RunEvent]:
    """A chunk whose data is larger than `piece_bytes`, as chunk events of at most that much
    data each, all but the last marked `more` (the Edge joins them)."""
    data = memoryview(chunk.data)
    starts = range(0, len(data), piece_bytes)
    last = starts[-1]
    return [
        pb.RunEvent(
            run_id=run_id,
            chunk=pb.RunChunk(
                data=bytes(data[start : start + piece_bytes]),
                usage_only=chunk.usage_only,
                more=start != last,
                sse=chunk.sse,
            ),
        )
        for start in starts
    ]


def event_from_proto(message: pb.RunEvent) -> RunEvent:
    """The event of `message` (its run id is `message.run_id`); an error's message is cut to
    `texts.MAX_TEXT_CHARS` (the Node's words). A chunk's `more` (a piece of a larger object) is
    the caller's to join: it reads `message.chunk.more`.

    Raises ValueError for an event with no kind set.
    """
    which = message.WhichOneof("event")
    if which == "chunk":
        chunk = message.chunk
        return RunChunk(chunk.data, chunk.usage_only, chunk.sse)
    if which == "usage":
        usage = message.usage
        return RunUsage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
    if which == "done":
        return RunDone(message.done.finish_reason or None)
    if which == "error":
        error = message.error
        code, text = bounded(error.code, MAX_ID_CHARS), bounded(error.message)
        return RunFailed(code, text, error.retryable, error.status or None)
    raise ValueError(f"run {message.run_id!r}: an event without a kind")


def health_to_proto(health: ProviderHealth) -> pb.ProviderHealth:
    """The protobuf of a provider's health."""
    return pb.ProviderHealth(
        provider_id=health.provider_id,
        healthy=health.healthy,
        detail=health.detail,
        reason=health.reason,
    )


def health_from_proto(message: pb.ProviderHealth) -> ProviderHealth:
    """A provider's health from its protobuf, its words cut (`texts.py`)."""
    return ProviderHealth(
        bounded(message.provider_id, MAX_ID_CHARS),
        message.healthy,
        bounded(message.detail),
        bounded(message.reason, MAX_ID_CHARS),
    )


def drain_to_proto(progress: DrainProgress) -> pb.DrainProgress:
    """The protobuf of a Node's drain progress."""
    return pb.DrainProgress(shutting_down=progress.shutting_down, runs_left=progress.runs_left)


def ack_from_proto(message: pb.ConfigAck) -> ConfigAck:
    """A Node's answer to a config payload, its words cut before anyone logs or keeps them."""
    return ConfigAck(
        generation=message.generation,
        config_hash=bounded(message.config_hash, MAX_ID_CHARS),
        ok=message.ok,
        error=bounded(message.error),
        pending=message.pending,
        in_use_hash=bounded(message.in_use_hash, MAX_ID_CHARS),
    )


def drain_from_proto(message: pb.DrainProgress) -> DrainProgress:
    """A Node's drain progress from its protobuf (providers with no run left are left out)."""
    runs_left = {pid: n for pid, n in message.runs_left.items() if n}
    return DrainProgress(message.shutting_down, runs_left)


def server_load_to_proto(load: ServerLoad, age_s: float | None = None) -> pb.ServerLoad:
    """The protobuf of a server's load; `age_s` overrides the reading's age (now vs. read)."""
    return pb.ServerLoad(
        running=max(0, load.running),
        waiting=max(0, load.waiting),
        kv_cache_usage=load.kv_cache_usage,
        age_s=load.age_s if age_s is None else age_s,
        not_ours=max(0, load.not_ours),
        running_adapters=load.running_adapters,
        waiting_adapters=load.waiting_adapters,
        max_loras=max(0, load.max_loras),
    )


def server_load_from_proto(message: pb.ServerLoad) -> ServerLoad:
    """A server's load as the Edge receives it."""
    return ServerLoad(
        message.running,
        message.waiting,
        message.kv_cache_usage,
        max(0.0, message.age_s),
        message.not_ours,
        tuple(message.running_adapters[:MAX_ADAPTERS]),
        tuple(message.waiting_adapters[:MAX_ADAPTERS]),
        message.max_loras,
    )


def payload_to_proto(
    payload: NodePayload, generation: int, digest: str | None = None
) -> pb.NodeConfig:
    """The wire form of `payload`; `digest` is its `.digest`, when the caller has it already."""
    config = pb.NodeConfig(
        generation=generation,
        config_hash=payload.digest if digest is None else digest,
        node_id=payload.node_id,
        alias=payload.alias or "",
    )
    for provider in payload.providers:
        item = config.providers.add(
            id=provider.id,
            adapter_json=orjson.dumps(provider.adapter, option=orjson.OPT_SORT_KEYS),
            served_models=provider.served_models,
            enabled=provider.enabled,
            capacity=provider.capacity,
        )
        if provider.long_context_slots is not None:
            item.long_context_slots = provider.long_context_slots
        if provider.health is not None:
            policy = provider.health
            item.health.CopyFrom(
                pb.HealthPolicy(
                    path=policy.path or "",
                    interval_ms=policy.interval_ms,
                    timeout_ms=policy.timeout_ms,
                    failure_threshold=policy.failure_threshold,
                    success_threshold=policy.success_threshold,
                    request_failure_threshold=policy.request_failure_threshold,
                )
            )
    return config


def payload_from_proto(message: pb.NodeConfig) -> tuple[NodePayload, int]:
    """The payload and its generation. Raises ValueError when the payload is malformed.

    The adapter settings are only decoded here; the Node validates them when it builds the
    adapter, so one bad provider does not stop the others.
    """
    providers = []
    for item in message.providers:
        try:
            adapter = orjson.loads(item.adapter_json)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"provider {item.id!r}: adapter settings are not JSON") from exc
        if not isinstance(adapter, dict):
            raise ValueError(f"provider {item.id!r}: adapter settings must be a JSON object")
        providers.append(
            ProviderPayload(
                id=item.id,
                adapter=adapter,
                served_models=tuple(item.served_models),
                enabled=item.enabled,
                capacity=item.capacity,
                long_context_slots=(
                    item.long_context_slots if item.HasField("long_context_slots") else None
                ),
                health=_health_policy(item) if item.HasField("health") else None,
            )
        )
    payload = NodePayload(
        node_id=message.node_id, alias=message.alias or None, providers=tuple(providers)
    )
    return payload, message.generation


def _health_policy(item: pb.ProviderConfig) -> HealthPolicy:
    """The provider's health policy, checked with the config's own model (ValueError if bad)."""
    message = item.health
    try:
        return HealthPolicy(
            path=message.path or None,
            interval_ms=message.interval_ms,
            timeout_ms=message.timeout_ms,
            failure_threshold=message.failure_threshold,
            success_threshold=message.success_threshold,
            request_failure_threshold=message.request_failure_threshold,
        )
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
            for error in exc.errors(include_url=False)
        )
        raise ValueError(f"provider {item.id!r}: invalid health policy: {problems}") from exc


def liveness_to_proto(liveness: Liveness) -> pb.Liveness:
    """The wire form of the Edge's liveness values (what its welcome carries)."""
    return pb.Liveness(
        heartbeat_interval_ms=round(liveness.heartbeat_interval * 1000),
        heartbeat_timeout_ms=round(liveness.heartbeat_timeout * 1000),
        idle_interval_ms=round(liveness.idle_interval * 1000),
        idle_timeout_ms=round(liveness.idle_timeout * 1000),
    )


def liveness_from_proto(message: pb.Liveness, default: Liveness) -> Liveness:
    """The Edge's liveness values; `default` when it sent none or values that make no sense."""
    try:
        fast = Liveness(message.heartbeat_interval_ms / 1000, message.heartbeat_timeout_ms / 1000)
    except ValueError:
        return default
    try:  # (an Edge that predates quiet links sends no idle values: none)
        return Liveness(
            fast.heartbeat_interval,
            fast.heartbeat_timeout,
            message.idle_interval_ms / 1000,
            message.idle_timeout_ms / 1000,
        )
    except ValueError:
        return fast
