"""A container's environment and argv, as a kubelet and the image's config make them.

The kubelet's part (the container's `env` and `envFrom`, the Services' Docker-link variables,
KUBERNETES_SERVICE_*) is what `$(VAR)` references expand against, as in a kubelet; the runtime
then puts it over the image's Env (HOSTNAME first, PATH and HOME if still unset), and combines
the image's ENTRYPOINT/CMD with the container's command/args the Kubernetes way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .downward import DownwardError, field_value, resource_value
from .images import DEFAULT_PATH, ImageConfig
from .volumes import configmap_values, secret_values

Object = dict[str, Any]


class ConfigError(Exception):
    """The container cannot be configured (yet): CreateContainerConfigError."""


_REFERENCE = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names are replaced, $$ escapes, the rest stays."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _REFERENCE.sub(replace, text)


@dataclass(frozen=True)
class Context:
    pod: Object
    pod_ip: str
    host_ip: str
    api_host: str
    api_port: int
    configmaps: Mapping[tuple[str, str], Object]
    secrets: Mapping[tuple[str, str], Object]
    allocatable: Mapping[str, str]
    services: Iterable[Object] = ()


def _lookup(context: Context, kind: str, ref: Object, key: str | None) -> dict[str, str] | None:
    namespace = context.pod["metadata"]["namespace"]
    if kind == "configmap":
        obj = context.configmaps.get((namespace, ref["name"]))
        values = configmap_values(obj) if obj is not None else None
    else:
        obj = context.secrets.get((namespace, ref["name"]))
        values = secret_values(obj) if obj is not None else None
    if values is None:
        if ref.get("optional"):
            return None
        raise ConfigError(f"{kind} {ref['name']!r} not found")
    if key is not None and key not in values:
        if ref.get("optional"):
            return None
        raise ConfigError(f"couldn't find key {key} in {kind} {namespace}/{ref['name']}")
    return {name: value.decode(errors="replace") for name, value in values.items()}


def service_links(services: Iterable[Object]) -> dict[str, str]:
    """The Docker-link variables a kubelet gives for each Service with a ClusterIP in the pod's
    namespace (unless the pod sets enableServiceLinks: false): MY_SVC_SERVICE_HOST, MY_SVC_PORT,
    ... A chart whose program reads, say, EDGE_PORT meets them in a real cluster, so here too."""
    env: dict[str, str] = {}
    for service in sorted(services, key=lambda s: s["metadata"]["name"]):
        spec = service.get("spec") or {}
        ip, ports = spec.get("clusterIP"), spec.get("ports") or []
        if not ip or ip == "None" or not ports:
            continue
        name = service["metadata"]["name"].upper().replace("-", "_")
        first = ports[0]
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(first["port"])
        env[f"{name}_PORT"] = f"{first.get('protocol', 'TCP').lower()}://{ip}:{first['port']}"
        for port in ports:
            proto = port.get("protocol", "TCP")
            if port.get("name"):
                env[f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(
                    port["port"]
                )
            prefix = f"{name}_PORT_{port['port']}_{proto}"
            env[prefix] = f"{proto.lower()}://{ip}:{port['port']}"
            env[f"{prefix}_PROTO"] = proto.lower()
            env[f"{prefix}_PORT"] = str(port["port"])
            env[f"{prefix}_ADDR"] = ip
    return env


def environment(container: Object, context: Context) -> dict[str, str]:
    """The kubelet's variables for `container`: what `$(VAR)` expands against."""
    pod = context.pod
    host, port = context.api_host, context.api_port
    links = service_links(context.services) if pod["spec"].get("enableServiceLinks", True) else {}
    env: dict[str, str] = {
        **links,
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": str(port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
        "KUBERNETES_PORT": f"tcp://{host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP": f"tcp://{host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
        f"KUBERNETES_PORT_{port}_TCP_ADDR": host,
        f"KUBERNETES_PORT_{port}_TCP_PORT": str(port),
    }
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            values = _lookup(context, "configmap", source["configMapRef"], None)
        else:
            values = _lookup(context, "secret", source["secretRef"], None)
        for name, value in (values or {}).items():
            env[prefix + name] = value
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        try:
            if "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                env[name] = field_value(pod, path, context.pod_ip, context.host_ip)
            elif "resourceFieldRef" in source:
                env[name] = resource_value(
                    container, source["resourceFieldRef"], dict(context.allocatable)
                )
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                values = _lookup(context, "configmap", ref, ref["key"])
                if values is not None:
                    env[name] = values[ref["key"]]
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                values = _lookup(context, "secret", ref, ref["key"])
                if values is not None:
                    env[name] = values[ref["key"]]
            else:
                raise ConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
        except DownwardError as error:
            raise ConfigError(f"env {name}: {error}") from None
    return env


def process_environment(
    kubelet_env: Mapping[str, str], image: ImageConfig, hostname: str, home: str
) -> dict[str, str]:
    """The process's environment: HOSTNAME, the image's Env, then the kubelet's variables;
    PATH and HOME as a runtime sets them when neither gave them."""
    env = {"HOSTNAME": hostname, **dict(image.env), **kubelet_env}
    env.setdefault("PATH", DEFAULT_PATH)
    env.setdefault("HOME", home)
    return env


def argv(container: Object, image: ImageConfig, env: Mapping[str, str]) -> list[str]:
    """`command` replaces the image's ENTRYPOINT and drops its CMD; `args` replace CMD."""
    command = [expand(part, env) for part in container.get("command") or []]
    args = [expand(part, env) for part in container.get("args") or []]
    if command:
        result = command + args
    else:
        result = list(image.entrypoint) + (args or list(image.cmd))
    if not result:
        raise ConfigError("no command specified: the image has no ENTRYPOINT or CMD")
    return result
