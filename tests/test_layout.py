"""The repository's shape: the product is the `iop` package under src/, and only that.

Nothing of the product imports from the repository root: `operator` there is the standard
library's, and `edge`, `wire`, `node`, `cli` are not importable as top-level packages.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import iop
import iop.operator

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "iop"


def test_operator_from_the_repository_root_is_the_standard_library() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import operator; print(operator.__file__)"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(result.stdout.strip()).parent == Path(subprocess.__file__).parent


@pytest.mark.parametrize("name", ["edge", "node", "wire", "cli", "edgeconfig", "fakes"])
def test_product_folders_do_not_import_from_the_repository_root(name: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", f"import {name}"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "ModuleNotFoundError" in result.stderr


def test_the_package_is_imported_from_src_without_links() -> None:
    assert Path(iop.__file__).resolve() == PACKAGE / "__init__.py"
    assert [Path(p) for p in iop.operator.__path__] == [PACKAGE / "operator"]
    links = [path for path in REPO.rglob("*") if path.is_symlink() and ".venv" not in path.parts]
    assert links == []


@pytest.mark.parametrize(
    ("room", "imports"),
    [
        pytest.param("pool", "from ..http import asgi", id="pool-imports-http"),
        pytest.param("hub", "from ..pool import dispatching", id="hub-imports-pool"),
        pytest.param("limits", "from ..refresh import reports", id="limits-imports-refresh"),
    ],
)
def test_a_new_module_is_held_to_the_layers_of_the_room_it_lands_in(
    tmp_path: Path, room: str, imports: str
) -> None:
    """The Edge's import contract names rooms, not modules: a module added to a room that
    imports a room above it breaks the contract, with no change to the contract."""
    source = tmp_path / "src"
    subprocess.run(["cp", "-r", str(REPO / "src"), str(source)], check=True)
    (source / "iop" / "edge" / room / "newcomer.py").write_text(f"{imports}  # noqa\n")
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), "--no-cache"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(source), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0, result.stdout
    assert f"iop.edge.{room}.newcomer" in result.stdout
    assert "Edge: the server" in result.stdout and "BROKEN" in result.stdout
