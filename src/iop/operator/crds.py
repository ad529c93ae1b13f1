"""The EdgeConfig CustomResourceDefinition, generated from the config model.

The model in `iop.edgeconfig` is the one source of truth: this module turns its JSON schema
(camelCase, the Kubernetes spelling) into a *structural* OpenAPI v3 schema the API server
accepts, so `kubectl explain edgeconfig.spec.nodes.providers.capacity` prints the field's own
description, which ends with whether a change is live or needs a restart. `iop operator crd`
prints it; `deploy/crds/edgeconfigs.iop.dev.yaml` is that output, and a test fails when the
committed file is stale.

What the conversion does, and why:

- `$ref`s are inlined and `anyOf: [X, null]` becomes `X` with `nullable: true` (structural
  schemas allow neither references nor type unions).
- The adapter's discriminated union becomes one object with the union of both kinds' fields,
  `type` as an enum, and a CEL rule for the field a kind requires (structural schemas cannot
  branch on a value).
- Lists of items with an id are `x-kubernetes-list-type: map` keyed by that id, so the API
  server refuses duplicates and server-side apply merges items by id.
- Defaults are *not* put in the schema: the API server would write them into every stored
  object (growing it, and hiding what the user set); the model fills them in, and each
  description says its default so `kubectl explain` still shows it.
- CEL only for cheap invariants within one object (`longContextSlots <= capacity`, an openai
  adapter needs `baseUrl`); everything that relates objects to each other (provider references,
  unique provider ids across nodes, secrets) stays in the operator and its webhook, which report
  every problem with its path.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Final

import yaml

from iop.edgeconfig import EdgeConfig

from . import conventions

__all__ = ["crd_yaml", "edgeconfig_crd", "spec_schema", "status_schema"]

#: Keys of the pydantic JSON schema that a CRD schema either forbids or does not need.
_DROPPED: Final = frozenset({"title", "default", "x-iop-apply", "discriminator", "$defs"})
#: The key that identifies items of each keyed list (every other list of objects uses `id`).
_LIST_KEYS: Final = {"principalTokens": "tokenRef"}
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
        "(the same document as edge.yaml, in camelCase). Each field's description says whether "
        "a change applies live or needs a restart, and of what. docs/config.md lists every field."
    )
    return schema


def _convert(node: dict[str, Any], defs: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """One JSON-schema node -> its structural OpenAPI form (see the module docstring)."""
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
                "maximum", "minimum", "enum"):  # fmt: skip
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


def _condition_schema() -> dict[str, Any]:
    """metav1.Condition, as every Kubernetes API spells it."""
    return {
        "type": "object",
        "required": ["type", "status", "reason", "message", "lastTransitionTime"],
        "properties": {
            "type": {
                "type": "string",
                "description": "Valid, Applied, Progressing, Degraded or Ready.",
            },
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string", "description": "Why, in one CamelCase word."},
            "message": {"type": "string", "description": "Why, for people."},
            "observedGeneration": {
                "type": "integer",
                "description": "The .metadata.generation this condition was set for.",
            },
            "lastTransitionTime": {
                "type": "string",
                "format": "date-time",
                "description": "When the status last changed.",
            },
        },
    }


def _strings(description: str) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "string"}, "description": description}


def status_schema() -> dict[str, Any]:
    """The schema of `.status`, written only by the operator (docs/operator.md, "Status")."""
    restart_path = {
        "type": "object",
        "properties": {"path": {"type": "string"}, "scope": {"type": "string"}},
    }
    return {
        "type": "object",
        "description": "What the operator made of the spec; written only by the operator.",
        "properties": {
            "observedGeneration": {
                "type": "integer",
                "description": "The .metadata.generation the operator last acted on.",
            },
            "conditions": {
                "type": "array",
                "description": "Valid, Applied, Progressing, Degraded and the summary Ready.",
                "items": _condition_schema(),
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "desiredConfigHash": {
                "type": "string",
                "description": "SHA-256 of the config the spec asks for.",
            },
            "appliedConfigHash": {
                "type": "string",
                "description": "SHA-256 of the config last applied in full (every Edge replica "
                "runs it and every restart it needed is done).",
            },
            "configShortHash": {
                "type": "string",
                "description": "The first 12 characters of appliedConfigHash.",
            },
            "pendingRestart": {
                "type": "string",
                "description": "The restart scopes not done yet (edge, node:<id>), or none.",
            },
            "nodesAcked": {
                "type": "string",
                "description": "Nodes running the desired config on every Edge replica / nodes "
                "in the config.",
            },
            "problems": {
                "type": "array",
                "description": "Every problem of an invalid spec, with its path.",
                "items": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "message": {"type": "string"}},
                },
            },
            "lastChange": {
                "type": "object",
                "description": "The last change the operator acted on, as classified against "
                "the config last applied.",
                "properties": {
                    "generation": {"type": "integer"},
                    "fromConfigHash": {"type": "string"},
                    "toConfigHash": {"type": "string"},
                    "livePaths": _strings("Paths that apply live."),
                    "restartPaths": {
                        "type": "array",
                        "description": "Paths that need a restart, with its scope.",
                        "items": restart_path,
                    },
                    "restartScopes": _strings("The restarts the change needs."),
                    "changedNodes": _strings("Nodes the change touches."),
                    "changedProviders": _strings("Providers the change touches."),
                    "changedModels": _strings("Models the change touches."),
                    "omittedPaths": {
                        "type": "integer",
                        "description": "Paths left out of the lists above to keep status small.",
                    },
                },
            },
            "replicas": {
                "type": "array",
                "description": "Each Edge replica (pod) and the outcome of the last apply on it.",
                "items": {
                    "type": "object",
                    "properties": {
                        "pod": {"type": "string"},
                        "address": {"type": "string"},
                        "state": {
                            "type": "string",
                            "enum": [
                                "Applied",
                                "Failed",
                                "Unreachable",
                                "Replaced",
                                "AwaitingRestart",
                            ],
                        },
                        "configHash": {"type": "string"},
                        "generation": {"type": "integer"},
                        "reason": {"type": "string"},
                    },
                },
            },
            "nodes": {
                "type": "array",
                "description": "Each node of the config: Acked (runs the desired payload on "
                "every Edge replica), Failed (with the reason), NotConnected, or Restarting; "
                "drainingRuns while processes of it drain (a rollout's old pod, a SIGTERM).",
                "items": {
                    "type": "object",
                    "properties": {
                        "nodeId": {"type": "string"},
                        "state": {
                            "type": "string",
                            "enum": ["Acked", "Failed", "NotConnected", "Restarting"],
                        },
                        "reason": {"type": "string"},
                        "drainingRuns": {
                            "type": "integer",
                            "description": "Runs the node's draining processes still finish "
                            "(the most any Edge replica reports); absent when none drains.",
                        },
                    },
                },
            },
            "omittedNodes": {
                "type": "integer",
                "description": "Nodes left out of .nodes to keep status small (all Acked).",
            },
            "rollouts": {
                "type": "array",
                "description": "Workloads the operator rolled for restart scopes, and how far.",
                "items": {
                    "type": "object",
                    "properties": {
                        "scope": {"type": "string"},
                        "workload": {"type": "string"},
                        "configHash": {"type": "string"},
                        "state": {
                            "type": "string",
                            "enum": ["Progressing", "Complete", "Stalled", "Missing"],
                        },
                        "message": {"type": "string"},
                    },
                },
            },
        },
    }


def _printer_columns() -> list[dict[str, Any]]:
    def condition(kind: str) -> str:
        return f'.status.conditions[?(@.type=="{kind}")].status'

    return [
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
