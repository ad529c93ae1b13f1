"""The repository's shape: the product is the `iop` package under src/, and only that.

Nothing of the product imports from the repository root: `operator` there is the standard
library's, and `edge`, `wire`, `node`, `cli` are not importable as top-level packages. The tests,
the end-to-end tests and the benchmarks import each other as packages from the root (`e2e.cluster`,
`tests.waiting`, `bench`), never by editing `sys.path`.
"""

from __future__ import annotations

import ast
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
        env={"PYTHONPATH": f"{source}:{REPO}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0, result.stdout
    assert f"iop.edge.{room}.newcomer" in result.stdout
    assert "Edge: the server" in result.stdout and "BROKEN" in result.stdout


def sys_path_edits(tree: ast.AST) -> list[int]:
    """The lines of `tree` that change `sys.path`: a call of its list methods, or an
    assignment to it or to a slice of it."""

    def is_sys_path(node: ast.AST) -> bool:
        if isinstance(node, ast.Subscript):
            node = node.value
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        )

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_sys_path(node.func.value) and node.func.attr != "index":
                lines.append(node.lineno)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(target) for target in targets):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize(
    ("source", "edits"),
    [
        pytest.param("import sys\nsys.path.insert(0, 'x')", [2], id="insert"),
        pytest.param("import sys\nsys.path[0:0] = ['x']", [2], id="slice"),
        pytest.param("import sys\nsys.path += ['x']", [2], id="augmented"),
        pytest.param("import sys\nprint(sys.path.index('x'), sys.path[0])", [], id="reading"),
    ],
)
def test_sys_path_edits_are_found(source: str, edits: list[int]) -> None:
    assert sys_path_edits(ast.parse(source)) == edits


def test_nothing_edits_sys_path() -> None:
    found = [
        f"{path.relative_to(REPO)}:{line}"
        for folder in ("src", "tests", "e2e", "bench")
        for path in sorted((REPO / folder).rglob("*.py"))
        for line in sys_path_edits(ast.parse(path.read_text(), str(path)))
    ]
    assert found == []
