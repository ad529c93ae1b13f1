"""What a container's security context means for its process, decided before it starts.

The pod's securityContext and the container's merge as in a kubelet (the container's field
wins). From them and the image's USER come the process's user, group and supplementary groups
(`runAsUser`/`runAsGroup`, else the image's user looked up in the image's own /etc/passwd and
/etc/group, as runc does; `fsGroup` and `supplementalGroups` join the groups), its capability
bounding set (the runtime's default set, less `drop`, plus `add`; every capability when
`privileged`), no_new_privs (`allowPrivilegeEscalation: false`) and a read-only root
(`readOnlyRootFilesystem`). `runAsNonRoot` is refused with the kubelet's own messages
(pkg/kubelet/kuberuntime/security_context_others.go), which become the container's
CreateContainerConfigError. podinit.py applies the result; this module only decides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Object = dict[str, Any]

#: Linux capability numbers (linux/capability.h), by the names a securityContext uses.
CAPABILITIES = {
    name: number
    for number, name in enumerate(
        "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP "
        "LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER "
        "SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE "
        "SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP "
        "MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF "
        "CHECKPOINT_RESTORE".split()
    )
}
#: containerd's and Docker's default set for a container that is not privileged.
DEFAULT_CAPABILITIES = (
    "CHOWN DAC_OVERRIDE FSETID FOWNER MKNOD NET_RAW SETGID SETUID SETFCAP SETPCAP "
    "NET_BIND_SERVICE SYS_CHROOT KILL AUDIT_WRITE".split()
)
#: Fields a container's securityContext overrides from the pod's.
_SHARED = ("runAsUser", "runAsGroup", "runAsNonRoot", "seLinuxOptions", "seccompProfile")


class SecurityError(Exception):
    """The container cannot start as its security context says: CreateContainerConfigError."""


@dataclass(frozen=True)
class Identity:
    """Who the container's process is, and what it may do (applied by podinit.py)."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    capabilities: tuple[int, ...]
    no_new_privs: bool
    read_only_root: bool


def effective(pod: Object, container: Object) -> Object:
    """The container's security context with the pod's shared fields under it."""
    pod_context = pod["spec"].get("securityContext") or {}
    merged = {key: pod_context[key] for key in _SHARED if key in pod_context}
    merged.update(container.get("securityContext") or {})
    return merged


def image_user(user: str) -> tuple[int | None, str]:
    """(uid, "") for a numeric image USER, (None, name) for a name, (0, "") when unset: the
    kubelet treats an image without a user as root."""
    name = user.partition(":")[0]
    if not name:
        return 0, ""
    if name.isdigit():
        return int(name), ""
    return None, name


def _format_pod(pod: Object) -> str:
    meta = pod["metadata"]
    return f"{meta['name']}_{meta['namespace']}({meta.get('uid', '')})"


def verify_run_as_non_root(pod: Object, container: Object, user: str) -> None:
    """Refuse a container that `runAsNonRoot` forbids, as the kubelet words it."""
    context = effective(pod, container)
    if not context.get("runAsNonRoot"):
        return
    where = f'(pod: "{_format_pod(pod)}", container: {container["name"]})'
    if context.get("runAsUser") is not None:
        if int(context["runAsUser"]) == 0:
            raise SecurityError(f"container's runAsUser breaks non-root policy {where}")
        return
    uid, name = image_user(user)
    if uid == 0:
        raise SecurityError(f"container has runAsNonRoot and image will run as root {where}")
    if uid is None:
        raise SecurityError(
            f"container has runAsNonRoot and image has non-numeric user ({name}), "
            f"cannot verify user is non-root {where}"
        )


def capabilities(context: Object) -> tuple[int, ...]:
    """The capability bounding set: every one when privileged, else the default set less
    `drop` plus `add` (`ALL` allowed in both)."""
    if context.get("privileged"):
        return tuple(sorted(CAPABILITIES.values()))
    wanted = context.get("capabilities") or {}

    def names(key: str) -> set[str]:
        found = set()
        for raw in wanted.get(key) or []:
            name = raw.upper().removeprefix("CAP_")
            if name != "ALL" and name not in CAPABILITIES:
                raise SecurityError(f"unknown capability {raw!r} in capabilities.{key}")
            found.add(name)
        return found

    dropped, added = names("drop"), names("add")
    kept = set() if "ALL" in dropped else set(DEFAULT_CAPABILITIES) - dropped
    kept |= set(CAPABILITIES) if "ALL" in added else added
    return tuple(sorted(CAPABILITIES[name] for name in kept))


def _entries(text: str | None) -> list[list[str]]:
    return [line.split(":") for line in (text or "").splitlines() if line and line[0] != "#"]


def identity(
    pod: Object, container: Object, user: str, read_etc: Callable[[str], str | None]
) -> Identity:
    """The container's identity; `read_etc("passwd")` reads the image's /etc files."""
    context = effective(pod, container)
    passwd, group = _entries(read_etc("passwd")), _entries(read_etc("group"))
    user_part, _, group_part = user.partition(":")
    entry: list[str] | None = None
    if context.get("runAsUser") is not None:
        uid = int(context["runAsUser"])
        entry = next((e for e in passwd if len(e) > 3 and e[2] == str(uid)), None)
    elif user_part and not user_part.isdigit():
        entry = next((e for e in passwd if e[0] == user_part), None)
        if entry is None:
            raise SecurityError(
                f"unable to find user {user_part}: no matching entries in passwd file"
            )
        uid = int(entry[2])
    else:
        uid = int(user_part or 0)
        entry = next((e for e in passwd if len(e) > 3 and e[2] == str(uid)), None)
    if context.get("runAsGroup") is not None:
        gid = int(context["runAsGroup"])
    elif group_part:
        if group_part.isdigit():
            gid = int(group_part)
        else:
            found = next((e for e in group if e[0] == group_part), None)
            if found is None:
                raise SecurityError(
                    f"unable to find group {group_part}: no matching entries in group file"
                )
            gid = int(found[2])
    else:
        gid = int(entry[3]) if entry is not None else 0
    groups = []
    if entry is not None:  # the user's memberships in the image's /etc/group
        groups += [int(e[2]) for e in group if len(e) > 3 and entry[0] in e[3].split(",")]
    pod_context = pod["spec"].get("securityContext") or {}
    groups += [int(g) for g in pod_context.get("supplementalGroups") or []]
    if pod_context.get("fsGroup") is not None:
        groups.append(int(pod_context["fsGroup"]))
    return Identity(
        uid=uid,
        gid=gid,
        groups=tuple(sorted(set(groups))),
        home=entry[5] if entry is not None and len(entry) > 5 and entry[5] else "/",
        capabilities=capabilities(context),
        no_new_privs=context.get("allowPrivilegeEscalation") is False
        and not context.get("privileged"),
        read_only_root=bool(context.get("readOnlyRootFilesystem")),
    )
