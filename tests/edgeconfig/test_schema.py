"""Every field of the model documents itself and carries its apply rule."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from iop.edgeconfig import EdgeConfig
from iop.edgeconfig.fields import APPLY_KEY


def fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    for name, field in model.model_fields.items():
        found.append((f"{prefix}{name}", field))
        for inner in _models_in(field.annotation):
            found += fields(inner, f"{prefix}{name}.")
    return found


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]


ALL_FIELDS = [f for f in fields(EdgeConfig) if not f[0].endswith(".type")]


@pytest.mark.parametrize(("path", "field"), ALL_FIELDS, ids=[p for p, _ in ALL_FIELDS])
def test_field_says_what_it_controls_and_how_it_applies(path: str, field: Any) -> None:
    extra = field.json_schema_extra
    assert isinstance(extra, dict) and extra[APPLY_KEY] in ("live", "restart:edge", "restart:node")
    description = field.description or ""
    assert len(description) > 30
    assert description.endswith(("applies without a restart.", "rolls the Edge.", "workload."))


def test_camel_aliases_are_the_crd_spelling() -> None:
    schema = EdgeConfig.model_json_schema(by_alias=True)
    assert "controlPlane" in schema["properties"]
    assert "principalTokens" in schema["$defs"]["OpenAISection"]["properties"]
    assert "tokenHashSha256" in schema["$defs"]["NodeSpec"]["properties"]
