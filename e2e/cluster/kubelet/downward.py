"""The downward API: pod fields and container resources as strings, for env vars and files."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

Object = dict[str, Any]


class DownwardError(Exception):
    pass


_SUFFIXES = {
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9, "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40, "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}  # fmt: skip


def quantity(text: str | int | float) -> Decimal:
    """A Kubernetes resource quantity ("500m", "2Gi", "1e3") as a number."""
    match = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?\d+)?)([a-zA-Z]*)", str(text).strip())
    if not match or match.group(2) not in _SUFFIXES:
        raise DownwardError(f"not a quantity: {text!r}")
    return Decimal(match.group(1)) * _SUFFIXES[match.group(2)]


def field_value(pod: Object, path: str, pod_ip: str, host_ip: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
    }
    if path in simple:
        return str(simple[path])
    match = re.fullmatch(r"metadata\.(labels|annotations)(?:\['(.+)'\])?", path)
    if match:
        values: dict[str, str] = meta.get(match.group(1)) or {}
        if match.group(2) is not None:
            return values.get(match.group(2), "")
        return "\n".join(f'{key}="{value}"' for key, value in sorted(values.items()))
    raise DownwardError(f"unsupported fieldRef.fieldPath {path!r}")


def resource_value(container: Object, ref: Object, allocatable: dict[str, str]) -> str:
    """`resourceFieldRef`: the container's limit (or request), the node's capacity if unset."""
    resource: str = ref["resource"]
    kind, _, name = resource.partition(".")
    resources = container.get("resources") or {}
    raw = (resources.get(kind) or {}).get(name)
    if raw is None and kind == "limits":
        raw = allocatable.get(name)
    if raw is None:
        raw = "0"
    divisor = quantity(ref.get("divisor") or "1")
    if divisor == 0:
        raise DownwardError(f"resourceFieldRef {resource}: divisor is zero")
    return str(math.ceil(quantity(raw) / divisor))
