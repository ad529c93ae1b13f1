"""The repository's shape: the operator/ folder never shadows the standard library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import iop.operator

REPO = Path(__file__).resolve().parents[1]


def test_operator_folder_is_not_importable_as_operator() -> None:
    # From the repository root, where the folder sits, `import operator` is the stdlib's.
    result = subprocess.run(
        [sys.executable, "-c", "import operator; print(operator.__file__)"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "site-packages" not in result.stdout
    assert not result.stdout.startswith(str(REPO))


def test_operator_package_is_iop_operator() -> None:
    assert [Path(p).resolve() for p in iop.operator.__path__] == [REPO / "operator"]
    assert not (REPO / "operator" / "__init__.py").exists()


def test_every_product_folder_is_linked_into_the_iop_package() -> None:
    for link in (REPO / "src" / "iop").iterdir():
        if link.is_symlink():
            assert link.resolve() == REPO / link.name, link
