"""The one error the config layer raises: every problem found, each with its path.

Loading never stops at the first mistake. Whatever goes wrong (YAML syntax, types, bounds,
references between sections, secrets pasted where only hashes belong) becomes a `Problem`, and
a config with any problem is rejected whole, so nothing is ever half-loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

_MAX_VALUE_CHARS = 80


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a config: where (`nodes[2].providers[0].capacity`) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message}


class ConfigError(ValueError):
    """A config was rejected; `problems` lists every reason, in document order."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems: tuple[Problem, ...] = tuple(problems)
        count = len(self.problems)
        head = f"{count} problem{'s' if count != 1 else ''} in the config"
        super().__init__("\n".join([head, *(f"  {p}" for p in self.problems)]))


def render_value(value: object) -> str:
    """A short, JSON-like rendering of an offending value for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > _MAX_VALUE_CHARS:
        text = text[: _MAX_VALUE_CHARS - 1] + "…"
    return text
