"""Every package and module of `iop` declares its public surface, and all of it is documented.

For each name in an `__all__`: it imports, and a reader can learn what it is. Classes, functions
and modules carry a docstring of their own; a constant or a type alias carries a `#:` comment on
the lines above its assignment, or its package docstring names it.
"""

from __future__ import annotations

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
