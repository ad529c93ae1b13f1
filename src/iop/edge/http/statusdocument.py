"""The documents of the admin API's reads: `GET /status` (each node, its providers' health
and load, dispatch, priority classes) and `GET /config` (`redacted`: secrets and URL
credentials replaced); docs/refresh.md, "The admin API".
"""

from __future__ import annotations

import re
import time
from typing import Any, Final

from iop.edgeconfig import EdgeConfig, is_secret_field

from ..hub import Hub, NodeStatus, ProviderLink, provider_health
from ..pool import Dispatcher
from ..refresh import Refresher

_REDACTED: Final = "<redacted>"
#: A URL's user and password.
_URL_USERINFO: Final = re.compile(r"(?<=://)[^/@\s]+@")
#: Every query value of a URL (`?api_key=...`, `&token=...`): any of them may be a credential.
_URL_QUERY_VALUE: Final = re.compile(r"(?<=[?&])([^=&#\s]*)=[^&#\s]*")
#: A fragment may carry a credential too (`#access_token=...`).
_URL_FRAGMENT: Final = re.compile(r"#\S*$")


def status_document(refresher: Refresher, hub: Hub | None) -> dict[str, Any]:
    """The refresher's status (the config in use; each node's payload: current or not) with
    each node's instances, drain and providers' health."""
    document = refresher.status()
    snapshot = refresher.current
    connected = hub.nodes() if hub is not None else {}
    links = hub.connected_providers() if hub is not None else {}
    nodes_of = {pid: limits.node_id for pid, limits in snapshot.providers.items()}
    health = provider_health(nodes_of, links)
    providers_of = {node.id: node.providers for node in snapshot.config.nodes}
    dispatcher = refresher.dispatcher
    for entry in document["nodes"]:
        node_id = entry["node_id"]
        providers = sorted(providers_of[node_id], key=lambda p: p.id)
        entry.update(
            _node_status(node_id, connected.get(node_id), [health[p.id] for p in providers])
        )
        for provider in entry["providers"]:
            provider["load"] = _load_status(dispatcher, provider["provider_id"])
    document["dispatch"] = _dispatch_status(dispatcher)
    document["priority_classes"] = _priority_status(dispatcher)
    return document


def _node_status(
    node_id: str, status: NodeStatus | None, providers: list[ProviderLink]
) -> dict[str, Any]:
    """One node of `GET /status`."""
    document: dict[str, Any] = {
        "node_id": node_id,
        "connected": status is not None,
        "ready": status is not None and status.ready,
        "instance_id": status.instance_id if status is not None else "",
        "applied_generation": status.applied_generation if status is not None else 0,
        "applied_hash": status.applied_hash if status is not None else "",
        "runs_in_flight": status.runs_in_flight if status is not None else 0,
        "draining": status is not None and status.draining,
        "shutting_down": status is not None and status.drain.shutting_down,
        "draining_runs": status.draining_runs() if status is not None else {},
        "superseded": [
            {
                "instance_id": older.instance_id,
                "runs_in_flight": older.runs_in_flight,
                "shutting_down": older.drain.shutting_down,
                "draining_runs": dict(older.drain.runs_left),
            }
            for older in (status.superseded if status is not None else ())
        ],
        "providers": [
            {
                "provider_id": link.provider_id,
                "healthy": link.healthy,
                "reason": link.reason,
                "detail": _redact(link.detail),
            }
            for link in providers
        ],
    }
    return document


def _load_status(dispatcher: Dispatcher, provider_id: str) -> dict[str, Any]:
    """One provider's load in `GET /status`: what least_load reads and where it comes from."""
    report = dispatcher.reported_load(provider_id)
    server = report.server if report is not None else None
    return {
        "load": dispatcher.load(provider_id),
        "edge_in_flight": dispatcher.in_flight(provider_id),
        "node_in_flight": report.node_in_flight if report is not None else None,
        "other_edges_in_flight": report.elsewhere if report is not None else None,
        "reported_s_ago": (
            round(time.monotonic() - report.reported_at, 3) if report is not None else None
        ),
        "server": (
            {
                "running": server.running,
                "waiting": server.waiting,
                "not_ours": server.not_ours,
                "kv_cache_usage": round(server.kv_cache_usage, 4),
                "age_s": round(server.age_s, 3),
                **(
                    {
                        "running_adapters": list(server.running_adapters),
                        "waiting_adapters": list(server.waiting_adapters),
                        "max_loras": server.max_loras,
                    }
                    if server.max_loras
                    else {}
                ),
            }
            if server is not None
            else None
        ),
        **_adapter_status(dispatcher, provider_id),
    }


def _adapter_status(dispatcher: Dispatcher, provider_id: str) -> dict[str, Any]:
    """What this Edge knows of a provider's LoRA adapters: its runs by adapter, the adapters it
    sent there lately (latest last); nothing for a provider that never ran one."""
    runs, recent = dispatcher.adapter_runs(provider_id)
    if not recent:
        return {}
    return {"edge_adapter_runs": dict(runs), "edge_recent_adapters": list(recent)}


def _dispatch_status(dispatcher: Dispatcher) -> dict[str, Any]:
    """`dispatch` in `GET /status`: each model's policy and the choices it made, by reason."""
    decisions: dict[str, dict[str, int]] = {}
    for (model_id, policy, reason), count in dispatcher.decisions().items():
        key = f"{policy}/{reason}"
        decisions.setdefault(model_id, {})[key] = count
    waiting: dict[str, dict[str, int]] = {}
    for (model_id, name), count in dispatcher.queue_depths_by_class().items():
        waiting.setdefault(model_id, {})[name] = count
    return {
        model_id: {
            "policy": pool_model.dispatch.policy,
            "load_factor": pool_model.dispatch.load_factor,
            "choices": dict(sorted(decisions.get(model_id, {}).items())),
            "prefix_points": dispatcher.prefix_homes(model_id),
            "waiting": dispatcher.queue_depth(model_id),
            "waiting_by_class": dict(sorted(waiting.get(model_id, {}).items())),
            "saturated": dispatcher.saturated(model_id),
        }
        for model_id, pool_model in dispatcher.snapshot.models.items()
    }


def _priority_status(dispatcher: Dispatcher) -> dict[str, Any]:
    """`priority_classes` in `GET /status`: each class of the config in use (and any class
    that counted requests since the Edge started) with what its requests came to."""
    tally = dispatcher.classes
    classes = dispatcher.snapshot.priorities.classes
    shed: dict[str, dict[str, int]] = {}
    for (name, reason), count in tally.shed.items():
        shed.setdefault(name, {})[reason] = count
    document: dict[str, Any] = {}
    for name in sorted({*classes, *tally.admitted, *tally.queued, *shed}):
        klass = classes.get(name)
        wait = klass.max_wait_s if klass is not None else None
        waits = tally.waits.get(name)
        document[name] = {
            "priority": klass.level if klass is not None else None,
            "max_queue_wait_ms": round(wait * 1000) if wait is not None else None,
            "admitted": tally.admitted.get(name, 0),
            "queued": tally.queued.get(name, 0),
            # Of the queued, those given a slot, and the time they waited in all.
            "waited": sum(waits.counts) if waits is not None else 0,
            "waited_ms_total": round(waits.total * 1000, 1) if waits is not None else 0.0,
            "shed": dict(sorted(shed.get(name, {}).items())),
            # Shed requests that came back when told, queued though the model was saturated.
            "came_back": tally.came_back.get(name, 0),
        }
    return document


def redacted(config: EdgeConfig) -> dict[str, Any]:
    """The config as a document, with token hashes and URL credentials replaced."""
    result = _redact(config.model_dump(mode="json"))
    assert isinstance(result, dict)
    return result


def _redact(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _redact(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v, key) for v in value]
    if isinstance(value, str):
        if is_secret_field(key):
            return _REDACTED
        if "://" in value:
            value = _URL_USERINFO.sub(f"{_REDACTED}@", value)
            value = _URL_QUERY_VALUE.sub(rf"\1={_REDACTED}", value)
            value = _URL_FRAGMENT.sub(f"#{_REDACTED}", value)
        return value
    return value
