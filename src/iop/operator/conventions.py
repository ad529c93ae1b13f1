"""The names the operator and the Helm chart agree on (docs/operator.md, "The contract").

Everything the operator looks up or writes in the cluster is named here, from the EdgeConfig's
name, so the chart (another codebase) and the operator can never drift on a string.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

#: The API group of the EdgeConfig resource.
GROUP: Final = "iop.dev"
#: Its one served and stored version.
VERSION: Final = "v1alpha1"
#: Its kind.
KIND: Final = "EdgeConfig"
#: Its plural name (the REST path).
PLURAL: Final = "edgeconfigs"
#: Its singular name.
SINGULAR: Final = "edgeconfig"

#: The label every workload and pod of an EdgeConfig carries: the EdgeConfig's name.
EDGECONFIG_LABEL: Final = "iop.dev/edgeconfig"
#: The label that says which part a workload is: `edge` or `node`.
COMPONENT_LABEL: Final = "app.kubernetes.io/component"
#: `COMPONENT_LABEL` of the Edge workload(s).
COMPONENT_EDGE: Final = "edge"
#: `COMPONENT_LABEL` of a Node workload.
COMPONENT_NODE: Final = "node"
#: The label of a Node workload that names its node id (the restart scope `node:<id>`).
NODE_ID_LABEL: Final = "iop.dev/node-id"

#: The stamp on a workload's pod template (never on the EdgeConfig): the config hash that the
#: workload was last rolled for. Changing it rolls the workload; an equal stamp never rolls again.
CONFIG_HASH_ANNOTATION: Final = "iop.dev/config-hash"

#: The emergency pin, an annotation on the EdgeConfig: `stable` holds it on its stable revision
#: (the newest config that came through), a revision number (`"7"`, as the history shows it) on
#: that revision's config while the operator keeps it, whatever the spec says, until the
#: annotation goes.
PIN_ANNOTATION: Final = "iop.dev/pin-revision"
#: The pin's value that holds the stable revision.
PIN_STABLE: Final = "stable"
_PIN_NUMBER: Final = re.compile(r"[1-9][0-9]{0,8}")


def pin_of(body: Mapping[str, Any]) -> str | None:
    """The EdgeConfig's pin annotation as set (None: not pinned)."""
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(PIN_ANNOTATION)
    return str(value) if value is not None else None


def pinned_revision(pin: str) -> int | None:
    """The revision number a pin names (None: `stable`, or not a pin at all)."""
    return int(pin) if _PIN_NUMBER.fullmatch(pin) else None


def is_pin(value: str) -> bool:
    """Whether `value` is a pin the operator takes: `stable` or a revision number (1 or more)."""
    return value == PIN_STABLE or pinned_revision(value) is not None


#: The key of the Edge ConfigMap that holds the rendered config (mounted as a file).
CONFIG_KEY: Final = "edge.yaml"
#: The key of the admin token Secret.
ADMIN_TOKEN_KEY: Final = "token"


def edge_configmap_name(name: str) -> str:
    """The ConfigMap the Edge reads its config from (`--config .../edge.yaml`)."""
    return f"{name}-edge"


def admin_secret_name(name: str) -> str:
    """The Secret holding the Edge's admin API token (key `token`)."""
    return f"{name}-edge-admin"


def state_configmap_name(name: str) -> str:
    """The operator's own record for one EdgeConfig: the config last applied (compressed) and
    the stamps it wrote. Owned by the EdgeConfig, so it goes when the EdgeConfig goes."""
    return f"{name}-edge-applied"


def revisions_configmap_name(name: str) -> str:
    """The configs of the cluster revisions, kept for a pin to a revision number (compressed,
    by config hash, within a byte budget). Owned by the EdgeConfig."""
    return f"{name}-edge-revisions"


def edge_selector(name: str) -> str:
    """The label selector of the Edge workload(s) and their pods."""
    return f"{EDGECONFIG_LABEL}={name},{COMPONENT_LABEL}={COMPONENT_EDGE}"


def nodes_selector(name: str) -> str:
    """The label selector of every Node workload of the EdgeConfig."""
    return f"{EDGECONFIG_LABEL}={name},{COMPONENT_LABEL}={COMPONENT_NODE}"


def node_selector(name: str, node_id: str) -> str:
    """The label selector of one node's workload."""
    return f"{nodes_selector(name)},{NODE_ID_LABEL}={node_id}"
