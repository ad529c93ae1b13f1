"""The EdgeConfig CustomResourceDefinition, generated from the config model.

The model in `iop.edgeconfig` is the one source of truth: this module turns its JSON schema
(camelCase) into a structural OpenAPI v3 schema the API server accepts (references inlined,
nullables, the adapter's union as one object with a CEL rule, lists keyed by id, no defaults),
so `kubectl explain` prints each field's own description. `iop operator crd` prints it;
`deploy/crds/edgeconfigs.iop.dev.yaml` is that output, and a test fails when it is stale.
docs/operator.md, "The CRD, generated from the model", says why each conversion is so.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Final

import yaml

from iop.edgeconfig import EdgeConfig

from . import conventions
from .status import EdgeConfigStatus

#: Keys of the pydantic JSON schema that a CRD schema either forbids or does not need.
_DROPPED: Final = frozenset({"title", "default", "x-iop-apply", "discriminator", "$defs"})
#: The key that identifies items of each keyed list (every other list of objects uses `id`).
_LIST_KEYS: Final = {
    "principalTokens": "tokenRef",
    "conditions": "type",
    "classes": "name",
    "principals": "principalRef",
}
#: Upper bounds on list sizes: the API server's CEL cost estimate needs them, and they are far
#: beyond what fits in one object (about 1.5 MiB in etcd), so they never refuse a real config.
_MAX_ITEMS: Final = {"nodes": 5000, "providers": 64, "models": 10000, "principalTokens": 10000}
_ADAPTER_RULES: Final = [
    {
        "rule": "self.type != 'openai' || has(self.baseUrl)",
        "message": "baseUrl is required when type is openai",
        "fieldPath": ".baseUrl",
        "reason": "FieldValueRequired",
    },
]
_PROVIDER_RULES: Final = [
    {
        "rule": "!has(self.longContextSlots) || "
        "self.longContextSlots <= (has(self.capacity) ? self.capacity : 1)",
        "message": "longContextSlots must be <= capacity",
        "fieldPath": ".longContextSlots",
    },
]


def spec_schema() -> dict[str, Any]:
    """The structural OpenAPI schema of `.spec`: the config model in camelCase."""
    source = EdgeConfig.model_json_schema(by_alias=True)
    definitions: dict[str, Any] = source.get("$defs", {})
    schema = _convert(source, definitions, path=())
    schema["description"] = (
        "The whole configuration of one Edge: its listeners, models, nodes and providers "
        "(the same document as edge.yaml, in camelCase). Each field's description ends with "
        "whether a change applies live or needs a restart, and of what; a field without a rule "
        "of its own follows the nearest one above it (so `nodes` says Restart-required for adding "
        "or removing a node, while most fields below it are live). docs/config.md lists every "
        "field."
    )
    return schema


def _convert(node: dict[str, Any], defs: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """One JSON-schema node -> its structural OpenAPI form (docs/operator.md, "The CRD")."""
    node = _resolved(node, defs)
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) == 1 and len(branches) < len(node["anyOf"]):
            merged = {
                **{k: v for k, v in node.items() if k != "anyOf"},
                **_resolved(branches[0], defs),
            }
            if "description" in node:
                merged["description"] = node["description"]
            nullable = _convert(merged, defs, path)
            nullable["nullable"] = True
            return nullable
        raise ValueError(f"{'.'.join(path)}: a union the CRD schema cannot express: {node}")
    if "oneOf" in node:
        return _merged_union(node, defs, path)

    result: dict[str, Any] = {}
    description = node.get("description")
    if description is not None:
        result["description"] = _with_default(description, node)
    kind = node.get("type")
    if "const" in node:
        result["type"] = kind or "string"
        result["enum"] = [node["const"]]
    elif kind is not None:
        result["type"] = kind
    for key in ("pattern", "minLength", "maxLength", "minItems", "maxItems", "minProperties",
                "maximum", "minimum", "enum", "format"):  # fmt: skip
        if key in node:
            result[key] = node[key]
    for strict, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if strict in node:  # JSON Schema 2020 gives the bound; OpenAPI 3.0 a flag beside it
            result[plain] = node[strict]
            result[strict] = True

    if kind == "object":
        properties = node.get("properties")
        if properties is not None:
            result["properties"] = {
                name: _convert(value, defs, (*path, name)) for name, value in properties.items()
            }
            required = node.get("required")
            if required:
                result["required"] = list(required)
        values = node.get("patternProperties") or {}
        extra = node.get("additionalProperties")
        if values:  # a map: CRD schemas have no patternProperties; its keys are checked later
            (value,) = values.values()
            result["additionalProperties"] = _convert(value, defs, (*path, "*"))
        elif isinstance(extra, dict):
            result["additionalProperties"] = _convert(extra, defs, (*path, "*"))
    elif kind == "array":
        items = _convert(node["items"], defs, (*path, "[]"))
        result["items"] = items
        name = path[-1] if path else ""
        key = _LIST_KEYS.get(name, "id")
        if items.get("type") == "object" and key in items.get("properties", {}):
            result["x-kubernetes-list-type"] = "map"
            result["x-kubernetes-list-map-keys"] = [key]
            items.setdefault("required", [])
            if key not in items["required"]:
                items["required"].insert(0, key)
        if name in _MAX_ITEMS:
            result["maxItems"] = _MAX_ITEMS[name]
        if name == "providers" and items.get("type") == "object":
            items["x-kubernetes-validations"] = copy.deepcopy(_PROVIDER_RULES)
    return result


def _resolved(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """`node` with its `$ref` replaced by the definition (the node's own keys win)."""
    ref = node.get("$ref")
    if ref is None:
        return node
    target = defs[ref.rsplit("/", 1)[-1]]
    merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return _resolved(merged, defs) if "$ref" in target else merged


def _merged_union(
    node: dict[str, Any], defs: dict[str, Any], path: tuple[str, ...]
) -> dict[str, Any]:
    """A discriminated union as one object: every kind's fields, `type` as an enum."""
    kinds = [_resolved(branch, defs) for branch in node["oneOf"]]
    properties: dict[str, Any] = {}
    tags: list[str] = []
    for kind in kinds:
        tag = kind["properties"]["type"]["const"]
        tags.append(tag)
        for name, value in kind["properties"].items():
            if name == "type" or name in properties:
                continue
            converted = _convert(value, defs, (*path, name))
            converted["description"] = f"(type {tag}) {converted.get('description', '')}".strip()
            properties[name] = converted
    type_field = {
        "type": "string",
        "enum": tags,
        "description": "Which adapter: "
        + "; ".join(
            f"{tag}: {(k.get('description') or '').rstrip('.')}"
            for tag, k in zip(tags, kinds, strict=True)
        )
        + ". Restart-required: a change rolls this node's workload.",
    }
    return {
        "type": "object",
        "description": _with_default(node.get("description", ""), node),
        "required": ["type"],
        "properties": {"type": type_field, **properties},
        "x-kubernetes-validations": copy.deepcopy(_ADAPTER_RULES),
    }


def _with_default(description: str, node: dict[str, Any]) -> str:
    """The description, with the model's default said (the schema itself carries none)."""
    if "default" not in node or isinstance(node["default"], dict):
        return description
    default = node["default"]
    if default is None or default == [] or default == "":
        return description
    said = f"Default: {json.dumps(default)}."
    for marker in (" Live: ", " Restart-required: "):  # keep the apply rule the last sentence
        head, found, tail = description.rpartition(marker)
        if found:
            return f"{head} {said}{marker}{tail}"
    return f"{description} {said}"


def status_schema() -> dict[str, Any]:
    """The schema of `.status`, from the status model the operator writes (`status/model.py`).

    The status defaults to `{observedGeneration: 0}`: an EdgeConfig the operator has not looked
    at yet then reads as not observed (kstatus: InProgress), not as Current for want of a status.
    """
    source = _without_defaults(EdgeConfigStatus.model_json_schema(by_alias=True))
    schema = _convert(source, source.get("$defs", {}), path=())
    schema["default"] = {"observedGeneration": 0}
    return schema


def _without_defaults(node: Any) -> Any:
    """A JSON schema without its `default`s (the model's own; the API server must not write
    them into stored objects)."""
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_without_defaults(item) for item in node]
    return node


def _printer_columns() -> list[dict[str, Any]]:
    def condition(kind: str) -> str:
        return f'.status.conditions[?(@.type=="{kind}")].status'

    return [
        {"name": "Ready", "type": "string", "jsonPath": condition("Ready")},
        {"name": "Valid", "type": "string", "jsonPath": condition("Valid")},
        {"name": "Applied", "type": "string", "jsonPath": condition("Applied")},
        {"name": "Restart", "type": "string", "jsonPath": ".status.pendingRestart"},
        {"name": "Nodes", "type": "string", "jsonPath": ".status.nodesAcked"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {
            "name": "Generation",
            "type": "integer",
            "jsonPath": ".metadata.generation",
            "priority": 1,
        },
        {
            "name": "Observed",
            "type": "integer",
            "jsonPath": ".status.observedGeneration",
            "priority": 1,
        },
        {"name": "Config", "type": "string", "jsonPath": ".status.configShortHash", "priority": 1},
        {
            "name": "Revision",
            "type": "integer",
            "jsonPath": ".status.revision",
            "priority": 1,
        },
        {"name": "Rollout", "type": "string", "jsonPath": ".status.rollout.state", "priority": 1},
        {
            "name": "Message",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Ready")].message',
            "priority": 1,
        },
    ]


def edgeconfig_crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{conventions.PLURAL}.{conventions.GROUP}"},
        "spec": {
            "group": conventions.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": conventions.KIND,
                "listKind": f"{conventions.KIND}List",
                "plural": conventions.PLURAL,
                "singular": conventions.SINGULAR,
                "shortNames": ["ec"],
                "categories": ["iop"],
            },
            "versions": [
                {
                    "name": conventions.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _printer_columns(),
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "EdgeConfig: the whole configuration of one IOP "
                            "Edge and its Nodes. The operator validates every change, applies "
                            "live changes without a restart and rolls only the workloads a "
                            "restart-required change needs (docs/operator.md).",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The CRD as the YAML file committed under deploy/crds/."""
    header = (
        "# Generated by `iop operator crd` from the config model (iop.edgeconfig); do not edit.\n"
        "# tests/operator/test_crds.py fails when this file is stale.\n"
    )
    body = yaml.safe_dump(edgeconfig_crd(), sort_keys=False, width=100, allow_unicode=True)
    return header + body
