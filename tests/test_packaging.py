"""The wheel and the sdist hold every module of the package, and a missing folder fails the build.

Both are built from a copy of exactly what a container build context copies (pyproject.toml,
README.md, LICENSE and src/), and compared with the source tree, not with a list kept by hand.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONTEXT = ("pyproject.toml", "README.md", "LICENSE")

pytestmark = pytest.mark.slow


def build_context(target: Path) -> Path:
    target.mkdir()
    for name in CONTEXT:
        shutil.copy2(REPO / name, target / name)
    shutil.copytree(
        REPO / "src",
        target / "src",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"),
    )
    return target


def build(context: Path, out: Path) -> subprocess.CompletedProcess[str]:
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    return subprocess.run(
        [uv, "build", "--sdist", "--wheel", "--out-dir", str(out), str(context)],
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
    assert any(name.endswith("edge/serving.py") for name in expected)

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
    assert {f"{root}/{name}" for name in CONTEXT} <= set(names)


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
