"""One pod's life on this node: sandbox, volumes, containers, status, and graceful deletion.

A `PodWorker` owns everything one pod has here: its network namespace and address, its folder
(volumes, /etc files, logs), its container processes and the task that writes its status. The
kubelet hands it every new version of the pod object; a deletionTimestamp starts the graceful
stop (SIGTERM, the grace period, SIGKILL), after which the worker removes what it made and
deletes the pod object for good (gracePeriodSeconds=0), as the kubelet does.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .apiclient import ApiError
from .containers import Container, Launch, now
from .contexts import PodContext
from .envs import ConfigError, Context, argv, environment, process_environment
from .images import Image, ImageError, image_file
from .securitycontexts import SecurityError, identity, verify_run_as_non_root
from .volumes import PodVolumes, VolumeError, read_only_kind

Object = dict[str, Any]
log = logging.getLogger("kubelet.pods")

ETC_FILES = ("hosts", "hostname", "resolv.conf")


@dataclass
class Condition:
    status: str = "False"
    since: str = ""
    reason: str = ""


class PodWorker:
    def __init__(self, kubelet: PodContext, pod: Object) -> None:
        self.kubelet = kubelet
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.key = f"{meta['namespace']}/{meta['name']}"
        self.dir = kubelet.config.pods_dir / self.uid
        self.log_dir = kubelet.config.logs_dir / f"{meta['namespace']}_{meta['name']}_{self.uid}"
        self.address: ipaddress.IPv4Address | None = None
        self.started_at = now()
        self.volumes = PodVolumes(self.dir / "volumes", pod, kubelet.sources)
        self.init_containers = [self._container(c) for c in pod["spec"].get("initContainers") or []]
        self.containers = [self._container(c) for c in pod["spec"]["containers"]]
        self.initialized = not self.init_containers
        self.sandbox_ready = False
        self.conditions: dict[str, Condition] = {}
        self.deleting = asyncio.Event()
        self.grace = 30.0
        self.gone_from_api = False
        self._dirty = asyncio.Event()
        self._last_status: Object | None = None
        self._volume_sync = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []

    def _container(self, spec: Object) -> Container:
        return Container(spec=spec, log_dir=self.log_dir / spec["name"], changed=self.changed)

    # -- events from the kubelet

    def update(self, pod: Object) -> None:
        self.pod = pod
        self.volumes.pod = pod
        meta = pod["metadata"]
        if meta.get("deletionTimestamp") and not self.deleting.is_set():
            self.grace = float(meta.get("deletionGracePeriodSeconds", 30))
            log.info("%s: deleting (grace %.0fs)", self.key, self.grace)
            self.deleting.set()

    def removed(self) -> None:
        """The pod object is gone (force-deleted): stop at once, nothing left to delete."""
        self.gone_from_api = True
        self.grace = min(self.grace, 2.0)
        self.deleting.set()

    def sources_changed(self) -> None:
        self._volume_sync.set()

    def changed(self) -> None:
        self._dirty.set()

    # -- the pod's life

    async def run(self) -> None:
        tasks: list[asyncio.Task[Any]] = []
        try:
            if not self.deleting.is_set():
                loop = asyncio.get_running_loop()
                tasks.append(loop.create_task(self._write_status(), name=f"status:{self.key}"))
                life = loop.create_task(self._live(), name=f"pod:{self.key}")
                tasks.append(life)
                deleting = loop.create_task(self.deleting.wait(), name=f"deleting:{self.key}")
                await asyncio.wait({life, deleting}, return_when=asyncio.FIRST_COMPLETED)
                if life.done() and not life.cancelled() and life.exception() is not None:
                    error = life.exception()
                    log.error("%s: pod failed: %r", self.key, error, exc_info=error)
                    for container in self.containers:
                        if container.pid is None:
                            container.wait("RunContainerError", f"kubelet error: {error!r}")
                if not deleting.done():  # every container finished for good: keep the status
                    await self.deleting.wait()
                deleting.cancel()
                # No restarts from here on: the containers' supervision ends, then they stop.
                life.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await life
                await self._stop_containers()
        finally:
            tasks += self._background
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._teardown()
        if not self.gone_from_api:
            await self._delete_object()

    async def _live(self) -> None:
        config = self.kubelet.config
        try:
            self.address = await self.kubelet.network.create(self.uid)
        except Exception as error:
            log.exception("%s: pod network failed", self.key)
            for container in self.containers:
                container.wait("CreatePodSandboxError", str(error))
            await asyncio.Event().wait()
        self.volumes.pod_ip = str(self.address)
        self.volumes.host_ip = config.node_ip
        self.sandbox_ready = True
        self._write_etc_files()
        loop = asyncio.get_running_loop()
        syncer = loop.create_task(self._sync_volumes_forever(), name=f"volumes:{self.key}")
        self._background.append(syncer)
        await self._volumes_ready()
        for container in self.init_containers:
            if not await self._run_container(container, init=True):
                return
        self.initialized = True
        self.changed()
        await asyncio.gather(*(self._run_container(c, init=False) for c in self.containers))

    async def _volumes_ready(self) -> None:
        delay = 0.5
        while True:
            try:
                await self.volumes.sync()
                return
            except (VolumeError, ApiError) as error:
                message = f"MountVolume.SetUp failed: {error}"
                for container in self.containers:
                    container.wait("ContainerCreating", message)
                # Try again when a ConfigMap or Secret it reads changes, or after a while.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._volume_sync.wait(), delay)
                self._volume_sync.clear()
                delay = min(delay * 2, 5.0)

    async def _sync_volumes_forever(self) -> None:
        """Follow ConfigMap/Secret changes at once; refresh tokens (and everything) each minute."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._volume_sync.wait(), 60)
            self._volume_sync.clear()
            try:
                await self.volumes.sync()
            except (VolumeError, ApiError) as error:
                log.warning("%s: volume sync failed: %s", self.key, error)
            except Exception:  # a long-lived loop logs the unexpected and carries on
                log.exception("%s: volume sync failed", self.key)

    async def _run_container(self, container: Container, *, init: bool) -> bool:
        """Run one container per restartPolicy; True when an init container succeeded."""
        image = await self._image(container)
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if init and policy == "Always":
            policy = "OnFailure"
        attempt = 0
        while True:
            try:
                verify_run_as_non_root(self.pod, container.spec, image.config.user)
                layers = await self.kubelet.config.images.layers(image)
                launch = self._launch(container, image, layers)
            except (ConfigError, VolumeError, SecurityError) as error:
                container.wait("CreateContainerConfigError", str(error))
                await asyncio.sleep(1)
                continue
            except ImageError as error:
                container.wait("CreateContainerError", f"unpacking {image.reference}: {error}")
                await asyncio.sleep(5)
                continue
            began = time.monotonic()
            code = await container.run_once(launch, str(self.address), self.kubelet.http)
            if container.finished(code, policy):
                return code == 0
            ran_for = time.monotonic() - began
            attempt = 0 if ran_for >= 60 else attempt + 1
            await container.back_off(ran_for, attempt - 1 if attempt else 0)

    async def _image(self, container: Container) -> Image:
        """The container's image, from this node's image list; this node never pulls, so an
        image it lacks waits as a kubelet's does under imagePullPolicy: Never."""
        reference = container.spec.get("image", "")
        images = self.kubelet.config.images
        while True:
            try:
                image = images.find(reference)
            except (ImageError, OSError, ValueError) as error:
                container.wait("InvalidImageName", f"{reference}: {error}")
            else:
                if image is not None:
                    container.image_id = image.image_id
                    return image
                have = ", ".join(images.names()) or "none"
                container.wait(
                    "ErrImageNeverPull",
                    f"Container image {reference!r} is not present on this node, which never "
                    f"pulls: it has {have} (e2e/cluster/README.md)",
                )
            await asyncio.sleep(2)

    def _launch(self, container: Container, image: Image, layers: list[Path]) -> Launch:
        config = self.kubelet.config
        context = Context(
            pod=self.pod,
            pod_ip=str(self.address),
            host_ip=config.node_ip,
            api_host=config.api_host,
            api_port=config.api_port,
            configmaps=self.kubelet.sources.configmaps,
            secrets=self.kubelet.sources.secrets,
            allocatable=self.kubelet.sources.allocatable,
            services=[
                service
                for (namespace, _), service in self.kubelet.services.items()
                if namespace == self.pod["metadata"]["namespace"]
            ],
        )
        kubelet_env = environment(container.spec, context)

        def read_etc(name: str) -> str | None:
            path = image_file(layers, f"etc/{name}")
            return path.read_text(errors="replace") if path is not None else None

        who = identity(self.pod, container.spec, image.config.user, read_etc)
        hostname = self.pod["spec"].get("hostname") or self.pod["metadata"]["name"]
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes") or []}
        mounts = []
        for mount in container.spec.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is None:
                raise ConfigError(f"volumeMount {mount['name']!r} names no volume")
            source = self.volumes.host_path(volume) or str(self.volumes.path(mount["name"]))
            sub_path = mount.get("subPath")
            if sub_path:
                source = os.path.join(source, sub_path)
                if not os.path.exists(source):
                    Path(source).mkdir(parents=True)
            mounts.append(
                {
                    "source": source,
                    "target": mount["mountPath"],
                    # ConfigMap, Secret, downward API and projected volumes are always mounted
                    # read-only by a kubelet, whatever the volumeMount says.
                    "read_only": bool(mount.get("readOnly")) or read_only_kind(volume),
                }
            )
        layer = self.dir / "layers" / container.name
        shutil.rmtree(layer, ignore_errors=True)  # a new container gets a new writable layer
        return Launch(
            netns=self.kubelet.network.netns_path(self.uid),
            hostname=hostname,
            layers=[str(layer) for layer in layers],
            layer=str(layer),
            root=str(self.dir / "root" / container.name),
            files={f"/etc/{name}": str(self.dir / "etc" / name) for name in ETC_FILES},
            mounts=mounts,
            argv=argv(container.spec, image.config, kubelet_env),
            env=process_environment(kubelet_env, image.config, hostname, who.home),
            workdir=container.spec.get("workingDir") or image.config.working_dir or "/",
            user={"uid": who.uid, "gid": who.gid, "groups": list(who.groups)},
            capabilities=list(who.capabilities),
            no_new_privs=who.no_new_privs,
            read_only_root=who.read_only_root,
        )

    def _write_etc_files(self) -> None:
        config = self.kubelet.config
        meta, spec = self.pod["metadata"], self.pod["spec"]
        hostname = spec.get("hostname") or meta["name"]
        etc = self.dir / "etc"
        etc.mkdir(parents=True, exist_ok=True)
        fqdn = ""
        if spec.get("subdomain"):
            fqdn = f"{hostname}.{spec['subdomain']}.{meta['namespace']}.svc.{config.cluster_domain}"
        (etc / "hostname").write_text(hostname + "\n")
        (etc / "hosts").write_text(
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{self.address}\t{' '.join(filter(None, [fqdn, hostname]))}\n"
        )
        policy = spec.get("dnsPolicy", "ClusterFirst")
        if policy in ("ClusterFirst", "ClusterFirstWithHostNet"):
            domain = config.cluster_domain
            search = f"{meta['namespace']}.svc.{domain} svc.{domain} {domain}"
            resolv = f"search {search}\nnameserver {config.cluster_dns}\noptions ndots:5\n"
        else:
            resolv = Path("/etc/resolv.conf").read_text()
        dns_config = spec.get("dnsConfig") or {}
        for server in dns_config.get("nameservers") or []:
            resolv += f"nameserver {server}\n"
        (etc / "resolv.conf").write_text(resolv)

    # -- stopping

    async def _stop_containers(self) -> None:
        grace = self.grace
        await asyncio.gather(*(c.stop(grace) for c in self.containers + self.init_containers))

    async def _teardown(self) -> None:
        """Whatever still runs in the pod's namespace dies; then the namespace and files go."""
        network = self.kubelet.network
        for pid in await network.pids(self.uid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await network.delete(self.uid, self.address)
        shutil.rmtree(self.dir, ignore_errors=True)

    async def _delete_object(self) -> None:
        meta = self.pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}}
        for _ in range(10):
            try:
                await self.kubelet.api.call("DELETE", path, body)
                return
            except ApiError as error:
                if error.status in (404, 409):
                    return
                log.warning("%s: final delete failed: %s", self.key, error)
                await asyncio.sleep(1)

    # -- status

    def _condition(self, kind: str, true: bool) -> Object:
        status = "True" if true else "False"
        condition = self.conditions.setdefault(kind, Condition())
        if condition.status != status or not condition.since:
            condition.status, condition.since = status, now()
        entry: Object = {"type": kind, "status": status, "lastTransitionTime": condition.since,
                         "lastProbeTime": None}  # fmt: skip
        if not true and kind in ("Ready", "ContainersReady"):
            entry["reason"] = "ContainersNotReady"
            waiting = [c.name for c in self.containers if not c.ready]
            entry["message"] = f"containers with unready status: [{' '.join(waiting)}]"
        return entry

    def _phase(self) -> str:
        states = [c.state for c in self.containers]
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if all("terminated" in s for s in states) and policy != "Always":
            failed = any(s["terminated"]["exitCode"] != 0 for s in states)
            return "Failed" if failed else "Succeeded"
        if self.initialized and any("running" in s or c.restart_count for s, c in
                                    zip(states, self.containers, strict=True)):  # fmt: skip
            return "Running"
        return "Pending"

    def status(self) -> Object:
        scheduled = next(
            (c for c in (self.pod.get("status") or {}).get("conditions") or []
             if c.get("type") == "PodScheduled"),
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": self.started_at},
        )  # fmt: skip
        all_ready = self.initialized and all(c.ready for c in self.containers)
        status: Object = {
            "phase": self._phase(),
            "hostIP": self.kubelet.config.node_ip,
            "hostIPs": [{"ip": self.kubelet.config.node_ip}],
            "startTime": self.started_at,
            "conditions": [
                self._condition("PodReadyToStartContainers", self.sandbox_ready),
                self._condition("Initialized", self.initialized),
                self._condition("Ready", all_ready),
                self._condition("ContainersReady", all_ready),
                scheduled,
            ],
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.init_containers:
            status["initContainerStatuses"] = [c.status() for c in self.init_containers]
        if self.address is not None:
            status["podIP"] = str(self.address)
            status["podIPs"] = [{"ip": str(self.address)}]
        return status

    async def _write_status(self) -> None:
        meta = self.pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        self.changed()
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            status = self.status()
            if status == self._last_status:
                continue
            try:
                await self.kubelet.api.merge_patch(path, {"status": status})
                self._last_status = status
            except ApiError as error:
                if error.status == 404:
                    return
                log.warning("%s: status update failed: %s", self.key, error)
                await asyncio.sleep(1)
                self.changed()
            except Exception:  # a long-lived loop logs the unexpected and carries on
                log.exception("%s: status update failed", self.key)
                await asyncio.sleep(1)
                self.changed()
            await asyncio.sleep(0.05)  # coalesce bursts of changes
