"""Every package and module of `iop` declares its public surface, and all of it is documented.

For each name in an `__all__`: it imports, and a reader can learn what it is. Classes, functions
and modules carry a docstring of their own; a constant or a type alias carries a `#:` comment on
the lines above its assignment, or its package docstring names it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import types
from pathlib import Path

import pytest

import iop

SKIPPED = re.compile(r"\.__main__$")  # runs on import


def modules() -> list[str]:
    found = ["iop"]
    for info in pkgutil.walk_packages(iop.__path__, prefix="iop."):
        if not SKIPPED.search(info.name):
            found.append(info.name)
    return sorted(found)


def packages() -> list[str]:
    return [name for name in modules() if hasattr(importlib.import_module(name), "__path__")]


def documented_by_comment(module: types.ModuleType, name: str) -> bool:
    """True when `name = ...` (or `name: T = ...`) in `module` follows a `#:` comment."""
    try:
        source = Path(inspect.getfile(module)).read_text()
    except (OSError, TypeError):
        return False
    lines = source.splitlines()
    assignment = re.compile(rf"^{re.escape(name)}\s*(:[^=]*)?=")
    for index, line in enumerate(lines):
        if assignment.match(line):
            above = index - 1
            while above >= 0 and lines[above].startswith("#:"):
                return True
    return False


def defining_module(package: types.ModuleType, name: str) -> types.ModuleType | None:
    """The module of `package` whose source assigns `name` (for constants and aliases)."""
    candidates = [package]
    if hasattr(package, "__path__"):
        candidates += [
            importlib.import_module(info.name)
            for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}.")
            if not SKIPPED.search(info.name)
        ]
    for module in candidates:
        if documented_by_comment(module, name):
            return module
    return None


@pytest.mark.parametrize("name", packages())
def test_every_package_declares_its_surface(name: str) -> None:
    package = importlib.import_module(name)
    assert (package.__doc__ or "").strip(), f"{name} has no docstring"
    assert isinstance(getattr(package, "__all__", None), list), f"{name} has no __all__"


@pytest.mark.parametrize("name", modules())
def test_every_exported_name_imports_and_is_documented(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", [])
    assert len(exported) == len(set(exported)), f"{name}.__all__ repeats a name"
    undocumented = []
    for public in exported:
        assert hasattr(module, public), f"{name}.__all__ names {public!r}, which does not import"
        value = getattr(module, public)
        if inspect.isclass(value) or inspect.isfunction(value) or inspect.ismodule(value):
            if not (value.__doc__ or "").strip():
                undocumented.append(public)
            continue
        if public in (module.__doc__ or ""):
            continue
        if defining_module(module, public) is None:
            undocumented.append(public)
    assert undocumented == [], f"{name}: exported without documentation: {undocumented}"


def _imports(folder: str) -> list[tuple[str, str, ast.ImportFrom]]:
    """(importing module, absolute target, node) for every `from ... import` of a module of
    `iop` in `folder` (src, tests, bench, e2e) of the repository."""
    repo = Path(iop.__file__).resolve().parents[2]
    names = set(modules())
    found = []
    for path in (repo / folder).rglob("*.py"):
        parts = path.relative_to(repo / folder).with_suffix("").parts
        here = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = here if parts[-1] == "__init__" else here.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target in names:
                found.append((here, target, node))
    return found


def _owner(module: str) -> str:
    """The package a module belongs to (a package owns itself)."""
    if hasattr(importlib.import_module(module), "__path__"):
        return module
    return module.rpartition(".")[0]


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _users_outside() -> set[tuple[str, str]]:
    """(package, name) for every name imported from a package of `iop`, or from one of its
    modules, by code outside that package: the product's other packages, tests, benchmarks."""
    found: set[tuple[str, str]] = set()
    for folder in ("src", "tests", "bench", "e2e"):
        for here, target, node in _imports(folder):
            owner = _owner(target)
            if folder == "src" and _inside(here, owner):
                continue
            found.update((owner, alias.name) for alias in node.names)
    return found


def test_every_exported_name_has_a_user_outside_its_package() -> None:
    users = _users_outside()
    unused = [
        f"{name}.{public}"
        for name in packages()
        for public in importlib.import_module(name).__all__
        if (name, public) not in users
    ]
    assert unused == []


@pytest.mark.parametrize("name", [m for m in modules() if m not in packages()])
def test_only_packages_declare_a_surface(name: str) -> None:
    """Modules are private to their package: what others use, its `__init__` exports."""
    assert not hasattr(importlib.import_module(name), "__all__")


#: Modules imported by name across packages on purpose: uvicorn loads only where HTTP is served,
#: grpc and aiohttp for the fake collector only where spans are received; the generated stubs
#: are their own surface.
_MODULES_IMPORTED_DIRECTLY = {
    "iop.aiokits.asgiserving",
    "iop.fakes.collector",
    "iop.wire.runtime_pb2",
    "iop.wire.runtime_pb2_grpc",
}


def test_the_product_imports_another_package_through_its_surface() -> None:
    """Inside `src/`, a name from another package comes from that package, never one of its
    modules: the package's `__init__` is the one place its surface is kept."""
    names = set(modules())
    through_modules = [
        f"{here}: from {target} import ..."
        for here, target, node in _imports("src")
        if target not in _MODULES_IMPORTED_DIRECTLY
        and _owner(target) != target
        and not _inside(here, _owner(target))
        and not all(f"{target}.{alias.name}" in names for alias in node.names)
    ]
    assert through_modules == []


def _children(package: types.ModuleType) -> set[str]:
    return {
        info.name
        for info in pkgutil.iter_modules(package.__path__)
        if info.name != "__main__" and not info.name.endswith(("_pb2", "_pb2_grpc"))
    }


@pytest.mark.parametrize("name", packages())
def test_every_package_docstring_names_exactly_its_modules(name: str) -> None:
    """A package's docstring is its map: every module and sub-package in it is named (in
    backticks), and no file it names (`x.py`, `x/`) is missing."""
    package = importlib.import_module(name)
    doc = package.__doc__ or ""
    quoted = set(re.findall(r"`([\w./]+)`", doc))
    children = _children(package)
    mentioned = {q.split(".")[0].rstrip("/") for q in quoted}
    missing = sorted(children - mentioned)
    files = {q.removesuffix(".py").rstrip("/") for q in quoted if q.endswith((".py", "/"))}
    stale = sorted(f for f in files if "/" not in f and f not in children)
    assert (missing, stale) == ([], []), f"{name}: not named {missing}; named but absent {stale}"
