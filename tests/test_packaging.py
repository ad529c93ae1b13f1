"""The wheel and the sdist hold every module of the package, and a missing folder fails the build.

Both are built from a copy of exactly the files the Dockerfile copies from its build context (read
from the Dockerfile itself, so the two cannot drift), and compared with the source tree, not with
a list kept by hand. The image's install step (`uv sync --frozen --no-dev --no-editable`) runs
here on the same files, and the `iop` it installs must run: that is the part of the image build
this machine can do without a container engine. .dockerignore must let in exactly those files.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def dockerfile_sources() -> list[str]:
    """What the Dockerfile's COPY instructions take from the build context (not `--from`)."""
    sources: list[str] = []
    for line in (REPO / "Dockerfile").read_text().splitlines():
        words = line.split()
        if not words or words[0] != "COPY" or any(w.startswith("--from") for w in words):
            continue
        sources += [word.rstrip("/") for word in words[1:-1] if not word.startswith("--")]
    return sources


CONTEXT = dockerfile_sources()
FILES = tuple(name for name in CONTEXT if (REPO / name).is_file())


def build_context(target: Path) -> Path:
    target.mkdir()
    for name in CONTEXT:
        if (REPO / name).is_dir():
            shutil.copytree(
                REPO / name,
                target / name,
                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"),
            )
        else:
            shutil.copy2(REPO / name, target / name)
    return target


def uv() -> str:
    return shutil.which("uv") or str(Path(sys.executable).with_name("uv"))


def test_the_dockerfile_copies_what_the_package_needs() -> None:
    assert sorted(CONTEXT) == ["LICENSE", "README.md", "pyproject.toml", "src", "uv.lock"]


def test_dockerignore_lets_in_exactly_what_the_dockerfile_copies() -> None:
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "an allowlist: everything out, then each source back in"
    allowed = sorted(line[1:].rstrip("/") for line in lines if line.startswith("!"))
    assert allowed == sorted(CONTEXT)
    assert {"**/__pycache__", "**/*.pyc"} <= set(lines)


def build(context: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [uv(), "build", "--sdist", "--wheel", "--out-dir", str(out), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def package_files(src: Path) -> set[str]:
    """Every file the package must ship, as `iop/...` paths."""
    return {
        path.relative_to(src).as_posix()
        for path in (src / "iop").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


def test_wheel_and_sdist_hold_every_module(tmp_path: Path) -> None:
    context = build_context(tmp_path / "context")
    result = build(context, tmp_path / "dist")
    assert result.returncode == 0, result.stderr
    expected = package_files(context / "src")
    assert any(name.endswith("edge/http/openaiapp.py") for name in expected)

    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = {name for name in archive.namelist() if name.startswith("iop/")}
    assert in_wheel == expected

    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        members = archive.getmembers()
    names = [member.name for member in members]
    root = names[0].split("/")[0]
    in_sdist = {
        member.name.removeprefix(f"{root}/src/")
        for member in members
        if member.name.startswith(f"{root}/src/iop/") and member.isfile()
    }
    assert in_sdist == expected
    assert {f"{root}/{name}" for name in FILES if name != "uv.lock"} <= set(names)


def test_the_image_install_holds_every_module_and_runs_iop(tmp_path: Path) -> None:
    # The Dockerfile's install step, on exactly its files: locked dependencies without the dev
    # group, the project itself as a regular (non-editable) package.
    context = build_context(tmp_path / "context")
    venv = tmp_path / "image-venv"
    env = {
        **os.environ,
        "UV_PROJECT_ENVIRONMENT": str(venv),
        "UV_COMPILE_BYTECODE": "1",
        "UV_PYTHON": sys.executable,
        "VIRTUAL_ENV": "",
    }
    result = subprocess.run(
        [uv(), "sync", "--frozen", "--no-dev", "--no-editable", "--quiet"],
        cwd=context,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (site,) = venv.glob("lib/python*/site-packages")
    installed = {
        path.relative_to(site).as_posix()
        for path in (site / "iop").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert installed == package_files(context / "src")
    # No dev tool came along (the image has no mypy, pytest or grpc_tools).
    assert not list(site.glob("mypy*")) and not list(site.glob("_pytest"))
    assert not (site / "grpc_tools").exists()
    # The console script runs from the installed package, not from the source tree.
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert version is not None
    shutil.rmtree(context / "src")
    ran = subprocess.run(
        [str(venv / "bin" / "iop"), "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == f"iop {version.group(1)}"
    # Each workload's command imports what it needs (the operator: kopf) from the install.
    for command in ("edge", "node", "operator"):
        helped = subprocess.run(
            [str(venv / "bin" / "iop"), command, "run", "--help"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert helped.returncode == 0, (command, helped.stderr)


def test_a_missing_package_folder_fails_the_build(tmp_path: Path) -> None:
    context = build_context(tmp_path / "context")
    shutil.rmtree(context / "src" / "iop" / "edge")
    result = build(context, tmp_path / "dist")
    assert result.returncode != 0
    assert "iop.edge" in result.stderr or "src/iop/edge" in result.stderr, result.stderr
    assert not list((tmp_path / "dist").glob("*.whl"))


def test_a_package_left_out_of_the_list_is_caught(tmp_path: Path) -> None:
    # A new subpackage nobody added to [tool.setuptools] packages would be silently missing
    # from the wheel; the comparison with the source tree is what catches it.
    context = build_context(tmp_path / "context")
    extra = context / "src" / "iop" / "edge" / "unlisted"
    extra.mkdir()
    (extra / "__init__.py").write_text('"""Not in the package list."""\n')
    result = build(context, tmp_path / "dist")
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = {name for name in archive.namelist() if name.startswith("iop/")}
    assert package_files(context / "src") - in_wheel == {"iop/edge/unlisted/__init__.py"}
