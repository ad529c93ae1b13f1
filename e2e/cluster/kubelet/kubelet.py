"""The process kubelet: one Node object, and a PodWorker for every pod bound to it.

It registers its Node (with the pod CIDR `up` allocated), keeps the node Lease fresh every 10 s
and the Ready condition's heartbeat every 60 s, watches the pods bound to it, and keeps copies
of all ConfigMaps and Secrets (it is a cluster admin; a real kubelet is limited by the Node
authorizer to what its pods reference) so volumes and env vars resolve locally and a change
reaches mounted files at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import platform
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from .apiclient import ApiClient, ApiError, Credentials, Handler, Informer
from .images import NodeImages
from .logserver import LogServer
from .networking import PodNetwork
from .pods import PodWorker
from .volumes import Sources, Token

Object = dict[str, Any]
log = logging.getLogger("kubelet")

LEASE_SECONDS = 40
LEASE_RENEW = 10.0
STATUS_EVERY = 60.0
SHUTDOWN_GRACE = 5.0
VERSION = "v1.37.2-iop"


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


def now_micro() -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        + f".{time.time_ns() // 1000 % 10**6:06d}Z"
    )


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def allocatable() -> dict[str, str]:
    memory_kib = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_kib = int(line.split()[1])
    return {
        "cpu": str(os.cpu_count() or 1),
        "memory": f"{memory_kib}Ki",
        "pods": "110",
        "ephemeral-storage": "10Gi",
    }


class Kubelet:
    def __init__(self, config: Config, api: ApiClient, http: aiohttp.ClientSession) -> None:
        self.config = config
        self.api = api
        self.http = http
        self.images = config.images
        self.network = PodNetwork(
            node_netns=config.node_netns,
            bridge=config.bridge,
            pod_cidr=config.pod_cidr,
            gateway=config.gateway,
            netns_prefix=config.netns_prefix,
        )
        self.configmaps = Informer(api, "/api/v1/configmaps", self._source_handler("configmap"))
        self.secrets = Informer(api, "/api/v1/secrets", self._source_handler("secret"))
        self.services = Informer(api, "/api/v1/services", self._ignore)
        self.pods = Informer(
            api, "/api/v1/pods", self._pod_event, fieldSelector=f"spec.nodeName={config.node_name}"
        )
        self.sources = Sources(
            configmaps=self.configmaps.objects,
            secrets=self.secrets.objects,
            request_token=self._request_token,
            allocatable=allocatable(),
        )
        self._since = now()
        self.workers: dict[str, PodWorker] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    # -- the Node

    def node_status(self) -> Object:
        stamp = now()
        conditions = [
            ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID"),
            ("Ready", "True", "KubeletReady"),
        ]
        return {
            "capacity": self.sources.allocatable,
            "allocatable": self.sources.allocatable,
            "conditions": [
                {
                    "type": kind,
                    "status": status,
                    "reason": reason,
                    "message": f"process kubelet: {reason}",
                    "lastHeartbeatTime": stamp,
                    "lastTransitionTime": self._since,
                }
                for kind, status, reason in conditions
            ],
            "addresses": [
                {"type": "InternalIP", "address": self.config.node_ip},
                {"type": "Hostname", "address": self.config.node_name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.config.serving_port}},
            "nodeInfo": {
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kernelVersion": platform.release(),
                "osImage": "iop-edge process node",
                "containerRuntimeVersion": "iop://0.1",
                "kubeletVersion": VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    async def register(self) -> None:
        name = self.config.node_name
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "node.kubernetes.io/instance-type": "iop-process",
                },
            },
            "spec": {"podCIDR": str(self.config.pod_cidr), "podCIDRs": [str(self.config.pod_cidr)]},
        }
        with contextlib.suppress(ApiError):
            await self.api.call("POST", "/api/v1/nodes", node)
        await self.api.merge_patch(f"/api/v1/nodes/{name}/status", {"status": self.node_status()})
        log.info("registered node %s (pod CIDR %s)", name, self.config.pod_cidr)

    async def keep_lease(self) -> None:
        name = self.config.node_name
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        lease: dict[str, Any] = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS},
        }
        last_status = time.monotonic()
        while True:
            try:
                try:
                    await self.api.merge_patch(path, {"spec": {"renewTime": now_micro()}})
                except ApiError as error:
                    if error.status != 404:
                        raise
                    lease["spec"]["renewTime"] = now_micro()
                    collection = path.rsplit("/", 1)[0]
                    await self.api.call("POST", collection, lease)
                if time.monotonic() - last_status >= STATUS_EVERY:
                    status = {"status": self.node_status()}
                    await self.api.merge_patch(f"/api/v1/nodes/{name}/status", status)
                    last_status = time.monotonic()
            except ApiError as error:
                log.warning("lease/heartbeat failed: %s", error)
            except Exception:  # a long-lived loop logs the unexpected and carries on
                log.exception("lease/heartbeat failed")
            await asyncio.sleep(LEASE_RENEW)

    # -- tokens

    async def _request_token(self, pod: Object, audience: str, expiration: int) -> Token:
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [audience] if audience else [],
                "expirationSeconds": expiration,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        response = await self.api.call("POST", path, body)
        started = time.time()
        return Token(
            value=response["status"]["token"],
            expires=started + expiration,
            refresh_at=started + 0.8 * expiration,
        )

    # -- events

    async def _ignore(self, _kind: str, _obj: Object) -> None:
        """Services are only read when a container starts (its Docker-link variables)."""

    def _source_handler(self, what: str) -> Handler:
        async def changed(_kind: str, obj: Object) -> None:
            meta = obj["metadata"]
            reference = (what, meta.get("namespace", ""), meta["name"])
            for worker in self.workers.values():
                if reference in worker.volumes.references():
                    worker.sources_changed()

        return changed

    async def _pod_event(self, kind: str, pod: Object) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if kind == "DELETED":
            if worker is not None:
                worker.removed()
            return
        if worker is None:
            await self._wait_for_sources()
            worker = PodWorker(self, pod)
            self.workers[uid] = worker
            worker.update(pod)
            task = asyncio.get_running_loop().create_task(self._guard(worker), name=f"pod:{uid}")
            self.tasks[uid] = task
            log.info("%s: admitted", worker.key)
        else:
            worker.update(pod)

    async def _wait_for_sources(self) -> None:
        await self.configmaps.synced.wait()
        await self.secrets.synced.wait()
        await self.services.synced.wait()

    async def _guard(self, worker: PodWorker) -> None:
        try:
            await worker.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: pod worker failed", worker.key)
        finally:
            self.workers.pop(worker.uid, None)
            self.tasks.pop(worker.uid, None)
            log.info("%s: gone", worker.key)

    async def shutdown(self) -> None:
        """Stop every pod (short grace) and remove their namespaces; the pod objects stay."""
        for worker in self.workers.values():
            worker.gone_from_api = True
            worker.grace = min(worker.grace, SHUTDOWN_GRACE)
            worker.deleting.set()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


async def serve(config: Config) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    config.pods_dir.mkdir(parents=True, exist_ok=True)
    config.logs_dir.mkdir(parents=True, exist_ok=True)
    async with (
        ApiClient(config.credentials) as api,
        aiohttp.ClientSession(trust_env=False) as http,
    ):
        kubelet = Kubelet(config, api, http)
        await kubelet.register()
        logs = LogServer(kubelet)
        await logs.start()
        tasks = [
            loop.create_task(kubelet.keep_lease(), name="lease"),
            loop.create_task(kubelet.configmaps.run(), name="watch:configmaps"),
            loop.create_task(kubelet.secrets.run(), name="watch:secrets"),
            loop.create_task(kubelet.services.run(), name="watch:services"),
            loop.create_task(kubelet.pods.run(), name="watch:pods"),
        ]
        log.info("serving node %s", config.node_name)
        await stop.wait()
        log.info("shutting down")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await kubelet.shutdown()
        await logs.stop()
