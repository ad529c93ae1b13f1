"""Volumes as files: ConfigMap, Secret, projected (ServiceAccount token), downward API, emptyDir.

Each volume is a folder under the pod's directory, bind-mounted at its mountPath by podinit.py.
Payload volumes are written the way the kubelet's atomic writer does: the files live in a
timestamped folder, `..data` is a symlink to it, and each key is a symlink through `..data`; an
update writes a new folder and renames a new `..data` over the old one, so a reader sees the old
set or the new one, never half of each (keys mounted with subPath do not follow updates). As in
a kubelet, an emptyDir is world-writable, the others read-only, and a pod's `fsGroup` owns its
volumes (group read, and write for an emptyDir, setgid folders). e2e/cluster/README.md says more.
"""

from __future__ import annotations

import base64
import os
import shutil
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .downward import DownwardError, field_value, resource_value

Object = dict[str, Any]
Payload = dict[str, tuple[bytes, int]]  # relative path -> (content, mode)


class VolumeError(Exception):
    """The pod cannot start (yet): a missing object, an unsupported volume type."""


@dataclass
class Token:
    value: str
    expires: float
    refresh_at: float


@dataclass
class Sources:
    """What volumes are made of: the kubelet's copies of ConfigMaps and Secrets, and tokens."""

    configmaps: dict[tuple[str, str], Object]
    secrets: dict[tuple[str, str], Object]
    request_token: Callable[[Object, str, int], Awaitable[Token]]
    allocatable: dict[str, str]


#: Volume types a kubelet always mounts read-only.
READ_ONLY_KINDS = ("configMap", "secret", "downwardAPI", "projected")


def read_only_kind(volume: Object) -> bool:
    return any(kind in volume for kind in READ_ONLY_KINDS)


def set_ownership(folder: Path, gid: int, *, writable: bool) -> None:
    """The kubelet's SetVolumeOwnership: group `gid`, group read (and write), setgid folders."""
    mask = 0o660 if writable else 0o440
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        os.chown(path, -1, gid)
        mode = stat.S_IMODE(path.stat().st_mode) | mask
        if path.is_dir():
            mode |= stat.S_ISGID | 0o110
        path.chmod(mode)


def write_atomically(folder: Path, payload: Payload) -> bool:
    """Make `folder` hold exactly `payload`, swapping `..data` atomically. False if unchanged."""
    folder.mkdir(parents=True, exist_ok=True)
    data_link = folder / "..data"
    if data_link.is_symlink():
        current = folder / os.readlink(data_link)
        if _holds(current, payload):
            return False
    else:
        current = None
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime()) + f"{time.time_ns() % 10**9}"
    fresh = folder / stamp
    fresh.mkdir()
    for relative, (content, mode) in payload.items():
        target = fresh / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode)
    temporary = folder / "..data_tmp"
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(stamp)
    temporary.replace(data_link)
    tops = {relative.split("/", 1)[0] for relative in payload}
    for top in tops:
        link = folder / top
        if not link.is_symlink():
            link.symlink_to(f"..data/{top}")
    for entry in folder.iterdir():
        if entry.name.startswith(".."):
            continue
        if entry.name not in tops and entry.is_symlink():
            entry.unlink()
    if current is not None and current.name != stamp:
        shutil.rmtree(current, ignore_errors=True)
    return True


def _holds(folder: Path, payload: Payload) -> bool:
    try:
        present = {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}
        if present != set(payload):
            return False
        return all(
            (folder / rel).read_bytes() == content and (folder / rel).stat().st_mode & 0o777 == mode
            for rel, (content, mode) in payload.items()
        )
    except OSError:
        return False


def _select(
    values: dict[str, bytes], items: list[Object] | None, default_mode: int, what: str
) -> Payload:
    if not items:
        return {key: (value, default_mode) for key, value in values.items()}
    payload: Payload = {}
    for item in items:
        if item["key"] not in values:
            raise VolumeError(f"{what} has no key {item['key']!r}")
        payload[item["path"]] = (values[item["key"]], item.get("mode", default_mode))
    return payload


def configmap_values(configmap: Object) -> dict[str, bytes]:
    values = {key: value.encode() for key, value in (configmap.get("data") or {}).items()}
    for key, value in (configmap.get("binaryData") or {}).items():
        values[key] = base64.b64decode(value)
    return values


def secret_values(secret: Object) -> dict[str, bytes]:
    return {key: base64.b64decode(value) for key, value in (secret.get("data") or {}).items()}


@dataclass
class PodVolumes:
    """The volumes of one pod, kept in sync with their sources by `sync()`."""

    root: Path
    pod: Object
    sources: Sources
    pod_ip: str = ""
    host_ip: str = ""
    tokens: dict[str, Token] = field(default_factory=dict)

    def path(self, name: str) -> Path:
        return self.root / name

    @property
    def namespace(self) -> str:
        namespace: str = self.pod["metadata"]["namespace"]
        return namespace

    def references(self) -> set[tuple[str, str, str]]:
        """("configmap"|"secret", namespace, name) of every object the volumes read."""
        found = set()
        for volume in self.pod["spec"].get("volumes") or []:
            sources = [volume] + [s for s in (volume.get("projected") or {}).get("sources") or []]
            for source in sources:
                if "configMap" in source:
                    found.add(("configmap", self.namespace, source["configMap"]["name"]))
                if "secret" in source:
                    secret = source["secret"]
                    found.add(
                        ("secret", self.namespace, secret.get("secretName") or secret["name"])
                    )
        return found

    @property
    def fs_group(self) -> int | None:
        value = (self.pod["spec"].get("securityContext") or {}).get("fsGroup")
        return None if value is None else int(value)

    async def sync(self) -> None:
        """Write every volume's current content; raises VolumeError naming what is missing."""
        fs_group = self.fs_group
        for volume in self.pod["spec"].get("volumes") or []:
            name = volume["name"]
            folder = self.path(name)
            if "emptyDir" in volume:
                if not folder.is_dir():
                    folder.mkdir(parents=True)
                    folder.chmod(0o777)
                    if fs_group is not None:
                        set_ownership(folder, fs_group, writable=True)
            elif "hostPath" in volume:
                continue  # bound straight from the host, see host_path()
            elif "configMap" in volume or "secret" in volume or "downwardAPI" in volume:
                payload = await self._payload(volume, volume.get("defaultMode", 0o644), name)
                if payload is not None and write_atomically(folder, payload):
                    if fs_group is not None:
                        set_ownership(folder, fs_group, writable=False)
            elif "projected" in volume:
                projected = volume["projected"]
                mode = projected.get("defaultMode", 0o644)
                payload = {}
                for index, source in enumerate(projected.get("sources") or []):
                    part = await self._payload(source, mode, f"{name}[{index}]")
                    payload.update(part or {})
                if write_atomically(folder, payload) and fs_group is not None:
                    set_ownership(folder, fs_group, writable=False)
            else:
                kinds = sorted(set(volume) - {"name"})
                raise VolumeError(f"volume {name!r}: unsupported type {', '.join(kinds)}")

    def host_path(self, volume: Object) -> str | None:
        if "hostPath" not in volume:
            return None
        path: str = volume["hostPath"]["path"]
        if volume["hostPath"].get("type") == "DirectoryOrCreate":
            Path(path).mkdir(parents=True, exist_ok=True)
        return path

    async def _payload(self, source: Object, mode: int, what: str) -> Payload | None:
        if "configMap" in source:
            ref = source["configMap"]
            obj = self.sources.configmaps.get((self.namespace, ref["name"]))
            if obj is None:
                if ref.get("optional"):
                    return {}
                raise VolumeError(f"configmap {ref['name']!r} not found")
            values = configmap_values(obj)
            return _select(values, ref.get("items"), ref.get("defaultMode", mode), what)
        if "secret" in source:
            ref = source["secret"]
            secret_name = ref.get("secretName") or ref["name"]
            obj = self.sources.secrets.get((self.namespace, secret_name))
            if obj is None:
                if ref.get("optional"):
                    return {}
                raise VolumeError(f"secret {secret_name!r} not found")
            values = secret_values(obj)
            return _select(values, ref.get("items"), ref.get("defaultMode", mode), what)
        if "downwardAPI" in source:
            payload: Payload = {}
            for item in source["downwardAPI"].get("items") or []:
                try:
                    if "fieldRef" in item:
                        value = field_value(
                            self.pod, item["fieldRef"]["fieldPath"], self.pod_ip, self.host_ip
                        )
                    else:
                        ref = item["resourceFieldRef"]
                        container = next(
                            c for c in self.pod["spec"]["containers"]
                            if c["name"] == ref.get("containerName")
                        )  # fmt: skip
                        value = resource_value(container, ref, self.sources.allocatable)
                except (DownwardError, StopIteration) as error:
                    raise VolumeError(f"{what}: {error}") from None
                payload[item["path"]] = (value.encode(), item.get("mode", mode))
            return payload
        if "serviceAccountToken" in source:
            ref = source["serviceAccountToken"]
            key = f"{ref.get('audience', '')}|{ref['path']}"
            token = self.tokens.get(key)
            if token is None or time.time() >= token.refresh_at:
                expiration = int(ref.get("expirationSeconds", 3600))
                token = await self.sources.request_token(
                    self.pod, ref.get("audience", ""), expiration
                )
                self.tokens[key] = token
            return {ref["path"]: (token.value.encode(), mode)}
        if "clusterTrustBundle" in source or "podCertificate" in source:
            raise VolumeError(f"{what}: unsupported projected source")
        return None
