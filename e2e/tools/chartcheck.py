"""kubeconform, built from its pinned Go module, and the schemas it validates the chart against.

The schemas are made here, never downloaded: the built-in kinds from the OpenAPI document of the
`k8s.io/kubernetes` release e2e/cluster pins, the EdgeConfig from `deploy/crds/`, the
ServiceMonitor from the Prometheus Operator's CRD (its module at PROMETHEUS_OPERATOR); each is
"strict", so a misspelt field in a template fails. gotools.py builds and caches kubeconform
(`kubeconform/go.mod`). Standard library only. e2e/tools/README.md ("kubeconform") says why.

    python3 -m e2e.tools.chartcheck build                 build kubeconform; print its path
    python3 -m e2e.tools.chartcheck schemas DIR [CRD...]  write the schemas into DIR
    python3 -m e2e.tools.chartcheck validate [FILE...]    kubeconform -strict (stdin: `-`)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# The cluster's Go toolchain and pins; its cache, lock and errors.
from e2e.cluster import gobuilding, layout

from . import gotools

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CLUSTER_DIR = REPO / "e2e" / "cluster"

KUBECONFORM_DIR = HERE / "kubeconform"
KUBECONFORM_PACKAGE = "github.com/yannh/kubeconform/cmd/kubeconform"

#: The module whose example/ folder holds the Prometheus Operator's CRDs (ServiceMonitor).
PROMETHEUS_OPERATOR = "github.com/prometheus-operator/prometheus-operator@v0.90.1"
PROMETHEUS_CRDS = ("example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml",)
EDGECONFIG_CRD = REPO / "deploy" / "crds" / "edgeconfigs.iop.dev.yaml"


class CheckError(Exception):
    """A failure the user must see: the message says what failed."""


def log(message: str) -> None:
    print(f"chartcheck: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# kubeconform

KUBECONFORM = gotools.GoTool(
    "kubeconform", package=KUBECONFORM_PACKAGE, module="github.com/yannh/kubeconform"
)


def build_kubeconform() -> Path:
    """The kubeconform binary for the pin, built first if the cache does not have it."""
    return KUBECONFORM.build()


# --------------------------------------------------------------------------------------------
# Schemas


def module_dir(module_at_version: str, cwd: Path) -> Path:
    """Where the Go module cache holds `module@version` (downloaded through the proxy if not)."""
    result = subprocess.run(
        [gobuilding.go_command(), "mod", "download", "-json", module_at_version],
        cwd=cwd,
        env=gobuilding.go_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        info = json.loads(result.stdout)
    except ValueError:
        info = {}
    if result.returncode != 0 or "Dir" not in info:
        raise CheckError(f"go mod download {module_at_version} failed:\n{result.stderr.strip()}")
    return Path(info["Dir"])


def kubernetes_openapi() -> dict[str, Any]:
    """The swagger.json of the Kubernetes release the local cluster's API server is built from."""
    version = gobuilding.module_versions(layout.GO_MOD.read_text())["k8s.io/kubernetes"]
    folder = module_dir(f"k8s.io/kubernetes@{version}", CLUSTER_DIR)
    document: dict[str, Any] = json.loads(
        (folder / "api" / "openapi-spec" / "swagger.json").read_text()
    )
    return document


def schema_file_name(kind: str, api_version: str) -> str:
    """kubeconform's `{{ .ResourceKind }}{{ .KindSuffix }}.json` (pkg/registry/registry.go)."""
    group, _, version = api_version.rpartition("/")
    suffix = f"-{group.split('.')[0].lower()}-{version.lower()}" if group else f"-{version.lower()}"
    return f"{kind.lower()}{suffix}.json"


def strict(schema: Any) -> Any:
    """A copy where every object with `properties` refuses unknown keys, and int-or-string is
    spelled as JSON Schema understands it; `x-kubernetes-preserve-unknown-fields` keeps a
    subtree open, as the API server does."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if schema.get("format") == "int-or-string" or schema.get("x-kubernetes-int-or-string"):
        dropped = ("format", "type", "x-kubernetes-int-or-string")
        rest = {k: v for k, v in schema.items() if k not in dropped}
        return {**strict(rest), "anyOf": [{"type": "integer"}, {"type": "string"}]}
    keep_open = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
    out = {key: strict(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema and not keep_open:
        out["additionalProperties"] = False
    return out


def closure(definitions: dict[str, Any], root: str) -> dict[str, Any]:
    """The definitions `root` reaches through `$ref`s (itself included)."""
    found: dict[str, Any] = {}
    pending = [root]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found[name] = definitions[name]
        text = json.dumps(definitions[name])
        pending += re.findall(r'"#/definitions/([^"]+)"', text)
    return found


def builtin_schemas(openapi: dict[str, Any]) -> dict[str, Any]:
    """File name -> schema for every kind of the OpenAPI document."""
    definitions = openapi["definitions"]
    schemas: dict[str, Any] = {}
    for name, definition in definitions.items():
        for gvk in definition.get("x-kubernetes-group-version-kind", []):
            api_version = f"{gvk['group']}/{gvk['version']}" if gvk["group"] else gvk["version"]
            reached = closure(definitions, name)
            schema = {
                **strict(definition),
                "definitions": {key: strict(value) for key, value in reached.items()},
            }
            # apiVersion and kind must be the ones this file is for (kubeconform chose the file
            # by them; a document could still carry a different casing or group).
            properties = schema.setdefault("properties", {})
            properties["apiVersion"] = {"type": "string", "enum": [api_version]}
            properties["kind"] = {"type": "string", "enum": [gvk["kind"]]}
            schemas[schema_file_name(gvk["kind"], api_version)] = schema
    return schemas


def crd_schemas(documents: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """File name -> schema for every served version of each CustomResourceDefinition."""
    schemas: dict[str, Any] = {}
    for crd in documents:
        if crd.get("kind") != "CustomResourceDefinition":
            continue
        spec = crd["spec"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            api_version = f"{spec['group']}/{version['name']}"
            schema = strict(version["schema"]["openAPIV3Schema"])
            properties = schema.setdefault("properties", {})
            properties["apiVersion"] = {"type": "string", "enum": [api_version]}
            properties["kind"] = {"type": "string", "enum": [spec["names"]["kind"]]}
            # Every object has metadata; a CRD's schema may leave it out.
            properties.setdefault("metadata", {"type": "object"})
            schema["additionalProperties"] = False
            schemas[schema_file_name(spec["names"]["kind"], api_version)] = schema
    return schemas


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    """The documents of a YAML file, parsed by the project's PyYAML when run from its venv, or by
    a `python3 -c` of the checkout's venv otherwise (this module itself is standard library)."""
    try:
        import yaml
    except ImportError:
        venv_python = REPO / ".venv" / "bin" / "python"
        script = (
            "import json, sys, yaml; "
            "json.dump([d for d in yaml.safe_load_all(open(sys.argv[1])) if d], sys.stdout)"
        )
        result = subprocess.run(
            [str(venv_python), "-c", script, str(path)], capture_output=True, text=True, check=True
        )
        loaded: list[dict[str, Any]] = json.loads(result.stdout)
        return loaded
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def write_schemas(target: Path, crds: Sequence[Path] = (EDGECONFIG_CRD,)) -> Path:
    """Write every schema kubeconform needs for the chart into `target`; returns `target`."""
    target.mkdir(parents=True, exist_ok=True)
    prometheus = module_dir(PROMETHEUS_OPERATOR, KUBECONFORM_DIR)
    documents: list[dict[str, Any]] = []
    for path in [*crds, *(prometheus / name for name in PROMETHEUS_CRDS)]:
        documents += load_yaml_documents(path)
    schemas = {**builtin_schemas(kubernetes_openapi()), **crd_schemas(documents)}
    for name, schema in schemas.items():
        (target / name).write_text(json.dumps(schema))
    return target


def location(schemas: Path) -> str:
    """kubeconform's -schema-location for a folder written by write_schemas."""
    return f"{schemas}/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json"


def validate(paths: Sequence[str], schemas: Path, kubeconform: Path) -> int:
    command = [
        str(kubeconform),
        "-strict",
        "-summary",
        "-output=text",
        f"-schema-location={location(schemas)}",
        *paths,
    ]
    return subprocess.run(command, check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chartcheck", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build kubeconform unless up to date; print its path")
    schemas = sub.add_parser("schemas", help="write the schemas into a folder")
    schemas.add_argument("folder", type=Path)
    schemas.add_argument("crds", nargs="*", type=Path, default=[EDGECONFIG_CRD])
    check = sub.add_parser("validate", help="kubeconform -strict on files (or - for stdin)")
    check.add_argument("paths", nargs="*", default=["-"])
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(build_kubeconform())
            return 0
        if args.command == "schemas":
            write_schemas(args.folder, args.crds)
            return 0
        binary = build_kubeconform()
        with tempfile.TemporaryDirectory(prefix="iop-schemas-") as folder:
            return validate(args.paths, write_schemas(Path(folder)), binary)
    except (CheckError, gotools.ToolError, layout.ClusterError) as error:
        log(str(error))
        return 1


if __name__ == "__main__":
    sys.exit(main())
