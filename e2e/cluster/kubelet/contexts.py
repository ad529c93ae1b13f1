"""What the kubelet's parts are given: its settings (`Config`) and, for each pod's worker and the
log server, the few things of the kubelet they use (`PodContext`, `LogContext`) rather than the
whole kubelet, so that `kubelet.py` imports them and none of them imports it back.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from .apiclient import ApiClient, Credentials
from .images import NodeImages
from .networking import PodNetwork
from .volumes import Sources

if TYPE_CHECKING:
    from .pods import PodWorker

Object = dict[str, Any]


@dataclass(frozen=True)
class Config:
    node_name: str
    node_ip: str
    pod_cidr: ipaddress.IPv4Network
    node_netns: str
    bridge: str
    netns_prefix: str
    cluster_dns: str
    cluster_domain: str
    api_host: str
    api_port: int
    credentials: Credentials
    serving_cert: str
    serving_key: str
    serving_port: int
    state: Path
    images: NodeImages

    @property
    def pods_dir(self) -> Path:
        return self.state / "pods"

    @property
    def logs_dir(self) -> Path:
        return self.state / "logs"

    @property
    def gateway(self) -> ipaddress.IPv4Address:
        return next(self.pod_cidr.hosts())


@dataclass(frozen=True)
class PodContext:
    """What a pod's worker uses of its kubelet: the settings, the API and an HTTP client (for
    probes), the pod network, the ConfigMaps and Secrets its volumes and env read, and the
    Services (the informer's live map, (namespace, name) -> object) its env vars name."""

    config: Config
    api: ApiClient
    http: aiohttp.ClientSession
    network: PodNetwork
    sources: Sources
    services: Mapping[tuple[str, str], Object]


@dataclass(frozen=True)
class LogContext:
    """What the log server uses of its kubelet: the settings and the pods' workers now."""

    config: Config
    workers: Callable[[], Iterable[PodWorker]]
