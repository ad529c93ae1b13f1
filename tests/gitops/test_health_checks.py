"""kstatus and the Argo CD health check read every state the operator writes alike.

The objects are EdgeConfigs as the API server serves them, with the status the operator writes
(docs/operator.md, "Status"): `Ready` the summary, `Reconciling` and `Stalled` abnormal-true
(kstatus conventions), the product's `Valid`, `Applied`, `Progressing` and `Degraded`, and a
top-level `observedGeneration` written at the start of every pass on a new generation. Each is
read by kstatus itself (`sigs.k8s.io/cli-utils`, built from its pinned module: what Flux, Helm 4's
`--wait` and kstatus-based CI run) and by `deploy/argocd/edgeconfig-health.lua` in Lua 5.1 with
only what Argo CD gives a health check; the two must say the same (Current = Healthy,
InProgress = Progressing, Failed = Degraded).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.tools.healthcheck import ArgoHealth, HealthError, HealthReaders

REPO = Path(__file__).resolve().parents[2]
LUA = REPO / "deploy" / "argocd" / "edgeconfig-health.lua"
ARGOCD_KEY = "resource.customizations.health.iop.dev_EdgeConfig"
HASH_1 = "3f2a9c0d41be7e55c4b1f0a9d2e6c8b7a1f3e5d7c9b2a4f6e8d0c1b3a5f7e9d2"
HASH_2 = "9b7e1d3c5a2f4e6d8c0b1a3f5e7d9c2b4a6f8e0d1c3b5a7f9e2d4c6b8a0f1e3d"
T0, T1 = "2026-05-09T07:00:05Z", "2026-05-09T07:12:41Z"

SPEC: dict[str, Any] = {
    "edge": {
        "id": "edge-a",
        "listen": "0.0.0.0:7443",
        "admin": {"listen": "0.0.0.0:9090", "tokenFile": "/etc/iop/admin/token"},
    },
    "openai": {"listen": "0.0.0.0:8080"},
    "models": [{"id": "demo-echo", "providers": {"fake-a": "echo"}}],
    "nodes": [
        {
            "id": "node-1",
            "tokenHashSha256": "5e" * 32,
            "providers": [
                {"id": "fake-a", "adapter": {"type": "fake"}, "servedModels": ["echo"]},
            ],
        }
    ],
}

#: The conditions of an EdgeConfig whose config is in effect and serving, in the operator's order.
READY: dict[str, tuple[str, str, str]] = {
    "Valid": ("True", "Valid", "the spec passes every check"),
    "Applied": ("True", "Applied", f"config {HASH_1[:12]} is in effect"),
    "Progressing": ("False", "Idle", "no rollout under way"),
    "Degraded": ("False", "AsExpected", "nothing failed"),
    "Ready": ("True", "Ready", f"config {HASH_1[:12]} is in effect"),
    "Reconciling": ("False", "Ready", f"config {HASH_1[:12]} is in effect"),
    "Stalled": ("False", "AsExpected", "nothing is stuck"),
}

# Messages the operator would write in each state (their wording is the operator's; these tests
# only need both tools to carry the same one through).
NEW_GENERATION = "generation 2 observed; working towards it"
LIVE_APPLY = "applying config 9b7e1d3c5a2f live to 2 Edge replicas"
ROLLING = "edge: Deployment/demo-edge 1 of 2 updated replicas"
WAITING_FOR_NODES = "the restarted Edge serves; waiting for its Nodes: 1/3 connected"
RETRYING = "replica demo-edge-7d9f-x2k4 refused the apply (503); retrying in 4 s"
INVALID = (
    '2 problems in the spec: models[0].providers.zz: unknown provider "zz"; '
    "nodes[0].providers[0].capacity: must be >= 1, got 0"
)
DEADLINE = (
    "edge: Deployment/demo-edge exceeded its progress deadline (600 s): "
    'ReplicaSet "demo-edge-5c8d" has timed out progressing'
)


def conditions(
    generation: int,
    *,
    older: dict[str, int] | None = None,
    omit: tuple[str, ...] = (),
    **changed: tuple[str, str, str],
) -> list[dict[str, Any]]:
    """READY's conditions with `changed` ones, all of `generation` but those in `older`."""
    found = []
    for kind, (status, reason, message) in {**READY, **changed}.items():
        if kind in omit:
            continue
        found.append(
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "observedGeneration": (older or {}).get(kind, generation),
                "lastTransitionTime": T1 if kind in changed else T0,
            }
        )
    return found


def status(observed: int, found: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A status as the operator writes it around `found` conditions."""
    return {
        "observedGeneration": observed,
        "conditions": found,
        "problems": [],
        "desiredConfigHash": HASH_1,
        "appliedConfigHash": HASH_1,
        "configShortHash": HASH_1[:12],
        "pendingRestart": "none",
        "nodesAcked": "1/1",
        "replicas": [
            {
                "pod": "demo-edge-7d9f-x2k4",
                "address": "http://10.250.7.12:9090",
                "state": "Applied",
                "configHash": HASH_1,
                "reason": "",
            }
        ],
        "nodes": [{"nodeId": "node-1", "state": "Acked", "reason": ""}],
        "omittedNodes": 0,
        "rollouts": [],
        **extra,
    }


def edgeconfig(generation: int, found: dict[str, Any] | None, **metadata: Any) -> dict[str, Any]:
    """An EdgeConfig as `kubectl get ec demo -o json` prints it."""
    obj: dict[str, Any] = {
        "apiVersion": "iop.dev/v1alpha1",
        "kind": "EdgeConfig",
        "metadata": {
            "name": "demo",
            "namespace": "iop",
            "uid": "0b6f8c52-4f43-4c8e-9d7e-2a1f5b3c9e10",
            "resourceVersion": str(4000 + generation),
            "generation": generation,
            "creationTimestamp": "2026-05-09T07:00:00Z",
            "labels": {"app.kubernetes.io/instance": "iop"},
            **metadata,
        },
        "spec": copy.deepcopy(SPEC),
    }
    if found is not None:
        obj["status"] = found
    return obj


@dataclass(frozen=True)
class State:
    obj: dict[str, Any]
    kstatus: str
    argocd: str
    #: The message both tools give, when both take it from the same condition.
    message: str | None = None


def gen1_older() -> dict[str, int]:
    return dict.fromkeys(("Valid", "Applied", "Progressing", "Degraded"), 1)


STATES = [
    pytest.param(
        State(edgeconfig(1, {"observedGeneration": 0}), "InProgress", "Progressing"),
        id="created-not-yet-observed",
    ),
    pytest.param(
        State(edgeconfig(2, status(1, conditions(1))), "InProgress", "Progressing"),
        id="new-generation-not-yet-observed",
    ),
    pytest.param(
        State(
            edgeconfig(
                2,
                status(
                    2,
                    conditions(
                        2,
                        older=gen1_older(),
                        Ready=("Unknown", "Reconciling", NEW_GENERATION),
                        Reconciling=("True", "NewGeneration", NEW_GENERATION),
                    ),
                ),
            ),
            "InProgress",
            "Progressing",
            NEW_GENERATION,
        ),
        id="new-generation-observed-at-the-start-of-the-pass",
    ),
    pytest.param(
        State(
            edgeconfig(
                2,
                status(
                    2,
                    conditions(
                        2,
                        Applied=("False", "Applying", LIVE_APPLY),
                        Ready=("False", "Applying", LIVE_APPLY),
                        Reconciling=("True", "Applying", LIVE_APPLY),
                    ),
                    desiredConfigHash=HASH_2,
                ),
            ),
            "InProgress",
            "Progressing",
            LIVE_APPLY,
        ),
        id="reconciling-live-apply",
    ),
    pytest.param(
        State(
            edgeconfig(
                2,
                status(
                    2,
                    conditions(
                        2,
                        Applied=("False", "RollingOut", ROLLING),
                        Progressing=("True", "RollingOut", ROLLING),
                        Ready=("False", "RollingOut", "config 9b7e1d3c5a2f is rolling out"),
                        Reconciling=("True", "RollingOut", ROLLING),
                    ),
                    desiredConfigHash=HASH_2,
                    pendingRestart="edge",
                    rollouts=[
                        {
                            "scope": "edge",
                            "workload": "Deployment/demo-edge",
                            "configHash": HASH_2,
                            "state": "Progressing",
                            "message": "1 of 2 updated replicas",
                        }
                    ],
                ),
            ),
            "InProgress",
            "Progressing",
            ROLLING,
        ),
        id="reconciling-rollout",
    ),
    pytest.param(
        State(
            edgeconfig(
                2,
                status(
                    2,
                    conditions(
                        2,
                        Applied=("True", "Applied", f"config {HASH_2[:12]} is in effect"),
                        Ready=("False", "WaitingForNodes", "the restarted Edge is not serving yet"),
                        Reconciling=("True", "WaitingForNodes", WAITING_FOR_NODES),
                    ),
                    nodesAcked="1/3",
                ),
            ),
            "InProgress",
            "Progressing",
            WAITING_FOR_NODES,
        ),
        id="reconciling-waiting-for-nodes-after-a-restart",
    ),
    pytest.param(
        State(
            edgeconfig(
                2,
                status(
                    2,
                    conditions(
                        2,
                        Applied=("False", "ApplyFailed", RETRYING),
                        Degraded=("True", "ApplyFailed", RETRYING),
                        Ready=("False", "ApplyFailed", RETRYING),
                        Reconciling=("True", "ApplyFailed", RETRYING),
                    ),
                ),
            ),
            "InProgress",
            "Progressing",
            RETRYING,
        ),
        id="reconciling-a-failure-it-retries",
    ),
    pytest.param(
        State(edgeconfig(2, status(2, conditions(2))), "Current", "Healthy"),
        id="ready",
    ),
    pytest.param(
        State(
            edgeconfig(2, status(2, conditions(2, omit=("Reconciling", "Stalled")))),
            "Current",
            "Healthy",
        ),
        id="ready-with-reconciling-and-stalled-absent",
    ),
    pytest.param(
        State(
            edgeconfig(
                2,
                status(
                    2,
                    conditions(
                        2,
                        older=gen1_older() | {"Valid": 2},
                        Valid=("False", "InvalidSpec", INVALID),
                        Ready=("False", "InvalidSpec", INVALID),
                        Stalled=("True", "InvalidSpec", INVALID),
                    ),
                    problems=[
                        {"path": "models[0].providers.zz", "message": 'unknown provider "zz"'},
                        {
                            "path": "nodes[0].providers[0].capacity",
                            "message": "must be >= 1, got 0",
                        },
                    ],
                ),
            ),
            "Failed",
            "Degraded",
            INVALID,
        ),
        id="stalled-invalid-spec",
    ),
    pytest.param(
        State(
            edgeconfig(
                2,
                status(
                    2,
                    conditions(
                        2,
                        Applied=("False", "ProgressDeadlineExceeded", DEADLINE),
                        Progressing=("False", "ProgressDeadlineExceeded", DEADLINE),
                        Degraded=("True", "ProgressDeadlineExceeded", DEADLINE),
                        Ready=("False", "ProgressDeadlineExceeded", DEADLINE),
                        Stalled=("True", "ProgressDeadlineExceeded", DEADLINE),
                    ),
                    desiredConfigHash=HASH_2,
                    pendingRestart="edge",
                ),
            ),
            "Failed",
            "Degraded",
            DEADLINE,
        ),
        id="stalled-rollout-past-its-progress-deadline",
    ),
    pytest.param(
        State(
            edgeconfig(
                3,
                status(
                    2,
                    conditions(
                        2,
                        Valid=("False", "InvalidSpec", INVALID),
                        Ready=("False", "InvalidSpec", INVALID),
                        Stalled=("True", "InvalidSpec", INVALID),
                    ),
                ),
            ),
            "InProgress",
            "Progressing",
        ),
        id="stalled-spec-fixed-not-yet-observed",
    ),
    pytest.param(
        State(
            edgeconfig(2, status(2, conditions(2)), deletionTimestamp=T1, finalizers=["x"]),
            "Terminating",
            "Progressing",
        ),
        id="being-deleted",
    ),
]


@pytest.mark.parametrize("state", STATES)
def test_kstatus_and_the_argocd_check_agree(health_readers: HealthReaders, state: State) -> None:
    reading = health_readers.read_one(state.obj)

    assert (reading.kstatus.status, reading.argocd.status) == (state.kstatus, state.argocd)
    assert reading.agree
    if state.message is not None:
        assert reading.kstatus.message == reading.argocd.message == state.message


def test_ready_means_the_ready_conditions_message_to_argocd(health_readers: HealthReaders) -> None:
    reading = health_readers.read_one(edgeconfig(2, status(2, conditions(2))))

    assert reading.kstatus.message == "Resource is Ready"
    assert reading.argocd.message == f"config {HASH_1[:12]} is in effect"


def test_a_generation_not_yet_observed_says_which(health_readers: HealthReaders) -> None:
    reading = health_readers.read_one(edgeconfig(3, status(2, conditions(2))))

    assert reading.kstatus.message == (
        "EdgeConfig generation is 3, but latest observed generation is 2"
    )
    assert reading.argocd.message == (
        "Waiting for the operator to observe generation 3 (the status is of generation 2)"
    )


@pytest.mark.parametrize("stalled_first", [True, False], ids=["stalled-first", "reconciling-first"])
def test_reconciling_and_stalled_both_true_the_first_in_the_list_wins_for_both(
    health_readers: HealthReaders, stalled_first: bool
) -> None:
    """The operator never writes both (Reconciling is False once Stalled); were it to, kstatus
    takes the first it meets, and the Lua does the same so the two still agree."""
    found = conditions(
        2,
        Reconciling=("True", "RollingOut", ROLLING),
        Stalled=("True", "ProgressDeadlineExceeded", DEADLINE),
    )
    kinds = [c["type"] for c in found]
    reconciling, stalled = found[kinds.index("Reconciling")], found[kinds.index("Stalled")]
    rest = [c for c in found if c["type"] not in {"Reconciling", "Stalled"}]
    ordered = [*rest, stalled, reconciling] if stalled_first else [*rest, reconciling, stalled]

    reading = health_readers.read_one(edgeconfig(2, status(2, ordered)))

    assert reading.agree
    assert reading.argocd.status == ("Degraded" if stalled_first else "Progressing")


DIVERGENT = [
    pytest.param(edgeconfig(1, None), id="no-status-at-all"),
    pytest.param(edgeconfig(1, {}), id="status-without-observed-generation"),
    pytest.param(
        edgeconfig(2, status(2, conditions(2, older={"Ready": 1}))),
        id="ready-true-of-an-older-generation",
    ),
]


@pytest.mark.parametrize("obj", DIVERGENT)
def test_where_kstatus_calls_current_what_the_operator_never_leaves_the_lua_holds_progressing(
    health_readers: HealthReaders, obj: dict[str, Any]
) -> None:
    """kstatus calls an object without conditions or observedGeneration Current, and reads
    no condition's own observedGeneration. The operator never leaves an EdgeConfig so: the CRD
    defaults the status of one it has not seen to "not observed" (the first case above), every
    status it writes carries observedGeneration, and a new generation gets Ready=Unknown in the
    pass's first write. Argo CD, which cannot know that, waits."""
    reading = health_readers.read_one(obj)

    assert (reading.kstatus.status, reading.argocd.status) == ("Current", "Progressing")


def test_kstatus_is_the_pinned_library(health_readers: HealthReaders) -> None:
    pinned = re.search(
        r"^\s*sigs\.k8s\.io/cli-utils (v\S+)$",
        (REPO / "e2e" / "tools" / "kstatus" / "go.mod").read_text(),
        flags=re.MULTILINE,
    )
    assert pinned is not None
    version = subprocess.run(
        [str(health_readers.kstatus_binary), "-version"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )

    assert version.stdout.strip() == f"sigs.k8s.io/cli-utils {pinned.group(1)}"


def test_kstatus_reads_lists_missing_objects_and_says_what_it_cannot_read(
    health_readers: HealthReaders,
) -> None:
    ready = edgeconfig(2, status(2, conditions(2)))
    listed = {"apiVersion": "v1", "kind": "List", "items": [ready]}
    missing = {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "reason": "NotFound",
        "message": 'edgeconfigs.iop.dev "gone" not found',
        "details": {"name": "gone", "group": "iop.dev", "kind": "edgeconfigs"},
        "code": 404,
    }
    unreadable = edgeconfig(2, {"observedGeneration": 2, "conditions": "Ready"})
    stream = "\n".join(json.dumps(document) for document in (listed, missing, unreadable))
    result = subprocess.run(
        [str(health_readers.kstatus_binary), "-o", "json"],
        input=stream,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )

    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(line["name"], line["status"]) for line in lines] == [
        ("demo", "Current"),
        ("gone", "NotFound"),
        ("demo", "Unknown"),
    ]
    assert lines[2]["message"]  # why it could not read it

    garbage = subprocess.run(
        [str(health_readers.kstatus_binary)],
        input="{not json",
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert garbage.returncode == 2
    assert "document 1: not JSON" in garbage.stderr


SANDBOXED = [
    pytest.param('return {status = string.format("%s", "Healthy")}', "string", id="string-library"),
    pytest.param('return {status = ("Healthy"):lower()}', "string value", id="string-methods"),
    pytest.param('return {status = "Healthy", n = math.floor(1.5)}', "math", id="math-library"),
    pytest.param('return {status = "Fine"}', "the status 'Fine'", id="invalid-status"),
]


@pytest.mark.parametrize(("source", "complaint"), SANDBOXED)
def test_the_lua_runs_with_only_what_argocd_gives_a_health_check(
    health_readers: HealthReaders, tmp_path: Path, source: str, complaint: str
) -> None:
    """Argo CD opens the base, table and a safe os library for a check from argocd-cm: a script
    that leans on more fails there, so it fails here too."""
    script = tmp_path / "check.lua"
    script.write_text(source)
    check = ArgoHealth(script)

    with pytest.raises(HealthError, match=re.escape(complaint)):
        check(edgeconfig(1, None))

    script.write_text('local t = {}\ntable.insert(t, os.time())\nreturn {status = "Healthy"}')
    assert type(health_readers.argocd)(script)(edgeconfig(1, None)).status == "Healthy"


README_SNIPPETS = [
    pytest.param(REPO / "deploy" / "argocd" / "README.md", id="deploy-argocd"),
    pytest.param(REPO / "deploy" / "helm" / "iop-edge" / "README.md", id="chart"),
]


@pytest.mark.parametrize("readme", README_SNIPPETS)
def test_the_readmes_argocd_cm_snippet_is_the_tested_health_check(readme: Path) -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", readme.read_text(), flags=re.DOTALL)
    snippets = [yaml.safe_load(block) for block in blocks if ARGOCD_KEY in block]

    assert len(snippets) == 1, f"{readme}: one argocd-cm snippet with {ARGOCD_KEY}"
    (config_map,) = snippets
    assert (config_map["kind"], config_map["metadata"]["name"]) == ("ConfigMap", "argocd-cm")
    assert config_map["metadata"]["namespace"] == "argocd"
    assert config_map["data"][ARGOCD_KEY] == LUA.read_text()
