"""The process kubelet's images and security contexts (e2e/cluster/kubelet), without a cluster.

Which references a node's image list resolves, how a layer's whiteouts apply, how the image's
ENTRYPOINT/CMD/Env meet a container's command/args/env, and what a security context makes of
the process: its user, groups, capabilities, and the kubelet's refusals of runAsNonRoot. The
e2e tests (test_image_pods.py) prove the same on running pods.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster.kubelet.envs import ConfigError, argv, process_environment
from e2e.cluster.kubelet.images import (
    ImageConfig,
    ImageError,
    NodeImages,
    apply_layer,
    image_file,
    normalize,
    unpack,
)
from e2e.cluster.kubelet.securitycontexts import (
    CAPABILITIES,
    DEFAULT_CAPABILITIES,
    SecurityError,
    capabilities,
    identity,
    verify_run_as_non_root,
)
from e2e.cluster.kubelet.volumes import set_ownership

PROJECT = "ghcr.io/iop-edge/iop-edge:0.1.0"
IMAGE = ImageConfig(
    entrypoint=("iop",),
    cmd=("--help",),
    env=(("PATH", "/opt/iop/bin:/usr/bin"), ("PYTHONUNBUFFERED", "1")),
    user="10001:10001",
)
PASSWD = "root:x:0:0:root:/root:/bin/bash\niop:x:10001:10001::/nonexistent:/usr/sbin/nologin\n"
GROUP = "root:x:0:\niop:x:10001:\nmetrics:x:2000:iop\n"


@pytest.mark.parametrize(
    ("reference", "normalized"),
    [
        pytest.param("nginx", "docker.io/library/nginx:latest", id="docker-hub-official"),
        pytest.param("nginx:1.27", "docker.io/library/nginx:1.27", id="docker-hub-tag"),
        pytest.param("team/app", "docker.io/team/app:latest", id="docker-hub-user"),
        pytest.param(PROJECT, PROJECT, id="registry"),
        pytest.param("localhost:5000/app:1", "localhost:5000/app:1", id="registry-port"),
        pytest.param("ghcr.io/a/b@sha256:00", "ghcr.io/a/b@sha256:00", id="digest-no-tag"),
    ],
)
def test_references_are_normalized_as_a_runtime_stores_them(
    reference: str, normalized: str
) -> None:
    assert normalize(reference) == normalized


def _put_blob(layout: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}"


def _layer(entries: list[tuple[str, bytes | None, str]]) -> bytes:
    """A tar of (name, content or None for a folder, symlink target or "")."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, content, link in entries:
            info = tarfile.TarInfo(name)
            if link:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            elif content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode, info.uid, info.gid = len(content), 0o640, 10001, 10001
                tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def _node(tmp_path: Path, layers: list[bytes], config: dict[str, Any]) -> tuple[NodeImages, str]:
    layout = tmp_path / "oci"
    config_digest = _put_blob(layout, json.dumps({"config": config}).encode())
    manifest = {
        "schemaVersion": 2,
        "config": {"digest": config_digest},
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": _put_blob(layout, x)}
            for x in layers
        ],
    }
    digest = _put_blob(layout, json.dumps(manifest).encode())
    listing = tmp_path / "images.json"
    listing.write_text(json.dumps({"layout": str(layout), "images": {PROJECT: digest}}))
    return NodeImages(listing, tmp_path / "rootfs"), digest


def test_a_node_finds_its_images_by_tag_or_digest_and_nothing_else(tmp_path: Path) -> None:
    config = {"Entrypoint": ["iop"], "Cmd": ["--help"], "User": "10001:10001", "Env": ["A=1=2"]}
    images, digest = _node(tmp_path, [], config)

    found = images.find(PROJECT)
    assert found is not None
    assert found.config == ImageConfig(("iop",), ("--help",), (("A", "1=2"),), "", "10001:10001")
    assert found.image_id == f"ghcr.io/iop-edge/iop-edge@{digest}"
    assert images.find(f"ghcr.io/iop-edge/iop-edge@{digest}") is not None
    assert images.find("ghcr.io/iop-edge/iop-edge@sha256:" + "0" * 64) is None
    assert images.find("ghcr.io/iop-edge/iop-edge:0.2.0") is None
    assert images.find("nginx:1.27") is None


def test_layers_unpack_once_each_and_overlay_with_their_whiteouts(tmp_path: Path) -> None:
    lower = _layer(
        [
            ("etc", None, ""),
            ("etc/passwd", b"root", ""),
            ("etc/gone", b"x", ""),
            ("cache", None, ""),
            ("cache/old", b"x", ""),
            ("usr", None, ""),
            ("usr/python", b"py", ""),
            ("python", None, "usr/python"),
        ]
    )
    upper = _layer(
        [
            ("etc/.wh.gone", b"", ""),
            ("cache/.wh..wh..opq", b"", ""),
            ("cache/new", b"y", ""),
            ("etc/passwd", b"root\niop", ""),
        ]
    )
    images, _ = _node(tmp_path, [lower, upper], {})
    image = images.find(PROJECT)
    assert image is not None

    layers = unpack(image, tmp_path / "rootfs")

    assert [layer.name for layer in layers] == [blob.name for blob in image.layers]
    assert (layers[0] / "etc" / "passwd").stat().st_uid == 10001
    assert (layers[0] / "etc" / "passwd").stat().st_mode & 0o777 == 0o640
    assert os.readlink(layers[0] / "python") == "usr/python"
    gone = (layers[1] / "etc" / "gone").lstat()
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0  # overlayfs' whiteout
    assert os.getxattr(layers[1] / "cache", "trusted.overlay.opaque") == b"y"
    assert image_file(layers, "etc/passwd") == layers[1] / "etc" / "passwd"
    assert image_file(layers, "etc/gone") is None
    # What a container sees: the overlay of both, the top layer first.
    merged = tmp_path / "merged"
    merged.mkdir()
    lower_dirs = f"{layers[1]}:{layers[0]}"
    listing = subprocess.run(
        ["unshare", "--mount", "sh", "-c",
         f"mount -t overlay overlay -o lowerdir={lower_dirs} {merged} && "
         f"ls {merged}/etc && ls {merged}/cache && cat {merged}/etc/passwd"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert listing == ["passwd", "new", "root", "iop"]
    (layers[0] / "marker").write_text("kept")
    assert unpack(image, tmp_path / "rootfs") == layers
    assert (layers[0] / "marker").exists()  # not unpacked again


@pytest.mark.parametrize(
    "entries",
    [
        pytest.param([("../escape", b"x", "")], id="dot-dot"),
        pytest.param([("link", None, "/"), ("link/etc", None, "")], id="through-a-symlink"),
    ],
)
def test_a_layer_cannot_write_outside_the_root(
    tmp_path: Path, entries: list[tuple[str, bytes | None, str]]
) -> None:
    archive = tmp_path / "layer.tar"
    archive.write_bytes(_layer(entries))
    (tmp_path / "root").mkdir()
    with pytest.raises(ImageError):
        apply_layer(archive, tmp_path / "root")
    assert not (tmp_path / "escape").exists()


@pytest.mark.parametrize(
    ("container", "expected"),
    [
        pytest.param({}, ["iop", "--help"], id="entrypoint-and-cmd"),
        pytest.param({"args": ["edge", "run"]}, ["iop", "edge", "run"], id="args-replace-cmd"),
        pytest.param({"command": ["python"]}, ["python"], id="command-drops-cmd"),
        pytest.param(
            {"command": ["sh", "-c"], "args": ["echo $(NAME)"]},
            ["sh", "-c", "echo pod"],
            id="command-and-args",
        ),
    ],
)
def test_command_and_args_meet_entrypoint_and_cmd_the_kubernetes_way(
    container: dict[str, Any], expected: list[str]
) -> None:
    assert argv(container, IMAGE, {"NAME": "pod"}) == expected


def test_an_image_without_entrypoint_or_cmd_needs_a_command() -> None:
    with pytest.raises(ConfigError, match="no command specified"):
        argv({}, ImageConfig(), {})


def test_the_process_environment_puts_the_kubelets_over_the_images() -> None:
    env = process_environment({"PYTHONUNBUFFERED": "0", "A": "1"}, IMAGE, "pod-1", "/nonexistent")
    assert env == {
        "HOSTNAME": "pod-1",
        "PATH": "/opt/iop/bin:/usr/bin",
        "PYTHONUNBUFFERED": "0",
        "A": "1",
        "HOME": "/nonexistent",
    }
    bare = process_environment({}, ImageConfig(), "pod-1", "/")
    assert bare["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _pod(pod_context: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": "web", "namespace": "ns", "uid": "u-1"},
        "spec": {"securityContext": pod_context or {}},
    }


@pytest.mark.parametrize(
    ("pod_context", "container_context", "user", "message"),
    [
        pytest.param(
            {"runAsNonRoot": True}, {}, "", "container has runAsNonRoot and image will run as root",
            id="image-without-user",
        ),
        pytest.param(
            {"runAsNonRoot": True}, {}, "0:0", "container has runAsNonRoot and image will run "
            "as root", id="image-user-0",
        ),
        pytest.param(
            {}, {"runAsNonRoot": True, "runAsUser": 0}, "10001",
            "container's runAsUser breaks non-root policy", id="run-as-user-0",
        ),
        pytest.param(
            {"runAsNonRoot": True}, {}, "iop", "container has runAsNonRoot and image has "
            "non-numeric user (iop), cannot verify user is non-root", id="named-user",
        ),
    ],
)  # fmt: skip
def test_run_as_non_root_is_refused_with_the_kubelets_reason(
    pod_context: dict[str, Any], container_context: dict[str, Any], user: str, message: str
) -> None:
    container = {"name": "app", "securityContext": container_context}
    with pytest.raises(SecurityError) as refused:
        verify_run_as_non_root(_pod(pod_context), container, user)
    assert str(refused.value) == f'{message} (pod: "web_ns(u-1)", container: app)'


@pytest.mark.parametrize(
    ("pod_context", "container_context", "user"),
    [
        pytest.param({"runAsNonRoot": True}, {}, "10001:10001", id="numeric-image-user"),
        pytest.param({"runAsNonRoot": True}, {"runAsUser": 5}, "", id="run-as-user-wins"),
        pytest.param({"runAsNonRoot": True}, {"runAsNonRoot": False}, "", id="container-wins"),
        pytest.param({}, {}, "", id="not-asked"),
    ],
)
def test_run_as_non_root_admits_a_user_it_can_verify(
    pod_context: dict[str, Any], container_context: dict[str, Any], user: str
) -> None:
    container = {"name": "app", "securityContext": container_context}
    verify_run_as_non_root(_pod(pod_context), container, user)


def _read_etc(name: str) -> str | None:
    return {"passwd": PASSWD, "group": GROUP}.get(name)


def test_the_chart_security_context_runs_as_the_image_user_without_capabilities() -> None:
    pod = _pod({"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001, "runAsNonRoot": True})
    container = {
        "name": "app",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    who = identity(pod, container, "10001:10001", _read_etc)
    assert (who.uid, who.gid, who.home) == (10001, 10001, "/nonexistent")
    assert who.groups == (2000, 10001)  # its membership in the image's /etc/group; fsGroup
    assert who.capabilities == ()
    assert who.no_new_privs and who.read_only_root


def test_the_image_user_by_name_and_a_run_as_user_override() -> None:
    by_name = identity(_pod({"supplementalGroups": [7]}), {"name": "a"}, "iop", _read_etc)
    assert (by_name.uid, by_name.gid, by_name.groups) == (10001, 10001, (7, 2000))
    override = identity(
        _pod(), {"name": "a", "securityContext": {"runAsUser": 0}}, "iop", _read_etc
    )
    assert (override.uid, override.gid, override.home) == (0, 0, "/root")
    assert not override.no_new_privs and not override.read_only_root
    with pytest.raises(SecurityError, match="unable to find user nobody"):
        identity(_pod(), {"name": "a"}, "nobody", _read_etc)


def test_capabilities_are_the_default_set_less_drop_plus_add() -> None:
    default = {CAPABILITIES[name] for name in DEFAULT_CAPABILITIES}
    assert set(capabilities({})) == default
    dropped = capabilities({"capabilities": {"drop": ["NET_RAW", "CAP_CHOWN"]}})
    assert set(dropped) == default - {CAPABILITIES["NET_RAW"], CAPABILITIES["CHOWN"]}
    only = capabilities({"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}})
    assert only == (CAPABILITIES["NET_BIND_SERVICE"],)
    assert len(capabilities({"privileged": True})) == len(CAPABILITIES)
    with pytest.raises(SecurityError, match="unknown capability 'NET_FLY'"):
        capabilities({"capabilities": {"add": ["NET_FLY"]}})


def test_fs_group_owns_a_volume_as_a_kubelet_sets_it(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    (volume / "sub").mkdir(parents=True)
    (volume / "sub" / "file").write_text("x")
    (volume / "sub" / "file").chmod(0o600)

    set_ownership(volume, 2000, writable=True)

    assert (volume / "sub" / "file").stat().st_gid == 2000
    assert (volume / "sub" / "file").stat().st_mode & 0o777 == 0o660
    assert (volume / "sub").stat().st_mode & 0o2000  # setgid: new files get the group
