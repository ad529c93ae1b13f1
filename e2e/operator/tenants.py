"""The tenant of the security tests: a ServiceAccount that may create and edit EdgeConfigs in
one namespace and nothing else (no Secrets, no pods), whom `kubectl --as` impersonates.

docs/operator.md ("Who may do what") says what such an editor can and cannot do; the tests
that play the tenant (`test_tenant.py`) hold the product to it.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from e2e.conftest import KubeCluster

#: The rights of an EdgeConfig editor: the resource and its status to read, the spec to write.
EDITOR_RULES = [
    {
        "apiGroups": ["iop.dev"],
        "resources": ["edgeconfigs"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    },
    {"apiGroups": ["iop.dev"], "resources": ["edgeconfigs/status"], "verbs": ["get"]},
]


@dataclass(frozen=True)
class Tenant:
    """`kubectl` as the tenant's ServiceAccount in `namespace`."""

    cluster: KubeCluster
    namespace: str
    name: str = "tenant"

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.name}"

    def kubectl(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """`kubectl --as` the tenant; never raises (a test looks at what was refused)."""
        return self.cluster.kubectl(
            "--as", self.user, "-n", self.namespace, *args, stdin=stdin, check=False
        )

    def apply(self, manifest: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return self.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))

    def can(self, verb: str, resource: str) -> bool:
        """`kubectl auth can-i` as the tenant."""
        answer = self.kubectl("auth", "can-i", verb, resource)
        return answer.stdout.strip() == "yes"


def make_tenant(cluster: KubeCluster, namespace: str, name: str = "tenant") -> Tenant:
    """Create the tenant's ServiceAccount, a Role of `EDITOR_RULES` and its binding."""
    meta = {"name": name, "namespace": namespace}
    for manifest in (
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": EDITOR_RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ):
        cluster.apply(manifest)
    tenant = Tenant(cluster, namespace, name)
    if tenant.can("get", "secrets") or not tenant.can("patch", "edgeconfigs"):
        raise AssertionError(f"{tenant.user} must edit EdgeConfigs and read no Secret")
    return tenant
