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
