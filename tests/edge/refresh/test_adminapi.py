"""The admin API: bodies and statuses, auth, the config it shows, the reports it keeps, and the
node pushes (who gets one, acks, failures, reconnects), against a real in-process Edge."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc.aio
import httpx
import pytest
import yaml

from iop.edge import EdgeServer
from iop.edge.http.adminauth import AdminAuthError
from iop.edgeconfig import config_hash, load_data, node_payloads, token_sha256
from iop.operator.adminapi import EdgeAdmin
from iop.operator.values import EdgeReplica
from iop.wire import PROTOCOL_VERSION
from iop.wire import runtime_pb2 as pb
from iop.wire.runtime_pb2_grpc import NodeRuntimeStub
from testkit import edge_document, provider

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

ADMIN_TOKEN = "admin-secret-token"
LIST_FIELDS = (
    "changed_nodes",
    "changed_providers",
    "changed_models",
    "live_paths",
    "restart_required_paths",
    "restart_scopes",
    "nodes_to_push",
    "pushes",
    "problems",
)


def lists_never_null(report: dict[str, Any]) -> None:
    for name in LIST_FIELDS:
        assert isinstance(report[name], list), (name, report)


@contextlib.asynccontextmanager
async def admin_client(
    edge: EdgeServer, token: str | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    assert edge.admin_url is not None
    async with httpx.AsyncClient(base_url=edge.admin_url, headers=headers, timeout=30) as client:
        yield client


# -- bodies and statuses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "says"),
    [
        pytest.param(b"not json", "Invalid JSON", id="not-json"),
        pytest.param(b"[]", "body: Input should be an object", id="not-an-object"),
        pytest.param(b'{"config": {}}', "mode: Field required", id="no-mode"),
        pytest.param(
            b'{"mode": "now"}', "mode: Input should be 'dry_run' or 'apply'", id="bad-mode"
        ),
        pytest.param(
            b'{"mode": "apply", "config": {}, "path": "/x"}',
            "at most one of config, config_yaml, path and revision",
            id="two-sources",
        ),
        pytest.param(b'{"mode": "apply", "force": true}', "force: Extra inputs", id="unknown-key"),
        pytest.param(
            b'{"mode": "apply", "config": "edge: {}"}', "config: Input should be", id="config-text"
        ),
        pytest.param(
            b'{"mode": "apply", "restarting": ["edge"]}',
            "the Edge cannot restart itself through its admin API; restarting takes node:<id>",
            id="edge-scope",
        ),
        pytest.param(
            b'{"mode": "apply", "restarting": ["node:Node_2"]}',
            "'node:Node_2' is not a scope: use node:<id>",
            id="bad-scope",
        ),
    ],
)
async def test_a_malformed_body_gets_400(start_edge, refresh_document, body, says) -> None:
    edge = await start_edge(refresh_document())
    async with admin_client(edge) as admin:
        response = await admin.post("/refresh", content=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "bad_request"
        assert says in error["message"]
        assert (await admin.get("/config")).json()["generation"] == 1


async def test_without_a_source_the_edge_rereads_its_own_file(
    start_edge, refresh_document, tmp_path: Path
) -> None:
    document = refresh_document()
    edge = await start_edge(document)
    async with admin_client(edge) as admin:
        response = await admin.post("/refresh", json={"mode": "apply"})
        assert response.status_code == 400
        assert "not started from a file" in response.json()["error"]["message"]

    path = tmp_path / "edge.yaml"
    path.write_text(yaml.safe_dump(document))
    edge = await start_edge(document, config_path=path)
    document["nodes"][0]["providers"][0]["priority"] = 5
    path.write_text(yaml.safe_dump(document))
    async with admin_client(edge) as admin:
        report = (await admin.post("/refresh", json={"mode": "apply"})).json()
    assert report["outcome"] == "applied"
    assert report["source"] == f"file {path}"
    assert report["live_paths"] == ["nodes[node-1].providers[pa].priority"]
    assert edge.dispatcher.snapshot.providers["pa"].priority == 5


async def test_yaml_text_and_a_path_are_candidates_too(
    start_edge, refresh_document, tmp_path: Path
) -> None:
    document = refresh_document()
    document["edge"]["admin"]["config_dir"] = str(tmp_path)  # where a refresh may read files
    edge = await start_edge(document)
    document["models"][0]["generation"] = {"max_tokens": 7}
    path = tmp_path / "candidate.yaml"
    path.write_text(yaml.safe_dump(document))
    async with admin_client(edge) as admin:
        by_text = await admin.post(
            "/refresh", json={"mode": "dry_run", "config_yaml": yaml.safe_dump(document)}
        )
        by_path = await admin.post("/refresh", json={"mode": "apply", "path": str(path)})
    assert by_text.status_code == by_path.status_code == 200
    assert (
        by_text.json()["live_paths"]
        == by_path.json()["live_paths"]
        == ["models[m].generation.max_tokens"]
    )
    assert by_text.json()["source"].startswith("YAML text (")
    assert by_path.json()["generation"] == 2


async def test_a_refused_path_says_which_setting_allows_it(start_edge, refresh_document) -> None:
    edge = await start_edge(refresh_document())  # no edge.admin.config_dir
    async with admin_client(edge) as admin:
        for path, says in (
            ("/etc/passwd", "(set edge.admin.config_dir to allow the files of a directory)"),
            ("other.yaml", "relative ones are taken in edge.admin.config_dir, which is not set"),
        ):
            answer = await admin.post("/refresh", json={"mode": "dry_run", "path": path})
            assert answer.status_code == 400
            assert says in answer.json()["error"]["message"]


async def test_an_invalid_candidate_gets_422_with_every_problem(start_edge, refresh_document):
    edge = await start_edge(refresh_document())
    candidate = refresh_document()
    candidate["nodes"][0]["providers"][0]["capacity"] = 0
    candidate["models"][0]["providers"]["nope"] = "served-a"
    candidate["openai"]["long_context_threshold_tokens"] = 0
    async with admin_client(edge) as admin:
        before = (await admin.get("/config")).json()
        for mode in ("dry_run", "apply"):
            response = await admin.post("/refresh", json={"mode": mode, "config": candidate})
            assert response.status_code == 422
            report = response.json()
            assert report["outcome"] == "invalid" and report["applied"] is False
            assert report["config_hash"] is None
            paths = [problem["path"] for problem in report["problems"]]
            assert paths == [
                "openai.long_context_threshold_tokens",
                "models[0].providers.nope",
                "nodes[0].providers[0].capacity",
            ]
            lists_never_null(report)
        broken = await admin.post("/refresh", json={"mode": "apply", "config_yaml": "edge: [1, 2"})
        assert broken.status_code == 422
        assert "invalid YAML" in broken.json()["problems"][0]["message"]
        assert (await admin.get("/config")).json() == before


async def test_routes_and_methods(start_edge, refresh_document) -> None:
    edge = await start_edge(refresh_document())
    async with admin_client(edge) as admin:
        assert (await admin.get("/healthz")).status_code == 200
        missing = await admin.get("/nope")
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
        wrong = await admin.get("/refresh")
        assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
        assert (await admin.post("/config")).status_code == 405


# -- auth ------------------------------------------------------------------------------------------


async def test_a_configured_token_is_required(start_edge, refresh_document, tmp_path: Path):
    document = refresh_document()
    token_file = tmp_path / "admin.token"
    token_file.write_text("file-token\n")
    document["edge"]["admin"].update(
        token_hash_sha256=token_sha256(ADMIN_TOKEN), token_file=str(token_file)
    )
    edge = await start_edge(document)
    for token, status in [
        (None, 401),
        ("wrong", 401),
        (ADMIN_TOKEN, 200),
        ("file-token", 200),
    ]:
        async with admin_client(edge, token) as admin:
            for response in (
                await admin.get("/config"),
                await admin.post("/refresh", json={"mode": "dry_run", "config": document}),
                await admin.get("/refresh/last"),
            ):
                assert response.status_code in ((401,) if status == 401 else (200, 404)), token
                if status == 401:
                    assert response.headers["www-authenticate"] == "Bearer"
            assert (await admin.get("/healthz")).status_code == 200
    async with admin_client(edge) as admin:
        response = await admin.get("/config", headers={"authorization": "Basic abc"})
        assert response.status_code == 401


async def test_a_rotated_token_file_is_taken_without_a_restart(
    start_edge, refresh_document, tmp_path: Path
) -> None:
    """A Secret mounted as the token file is swapped as the kubelet does it (a new file moved
    over the old path): the new token works at once, the old one no longer."""
    document = refresh_document()
    token_file = tmp_path / "admin.token"
    token_file.write_text("first-token\n")
    document["edge"]["admin"]["token_file"] = str(token_file)
    edge = await start_edge(document)
    async with admin_client(edge, "first-token") as admin:
        assert (await admin.get("/config")).status_code == 200

    swapped = tmp_path / "admin.token.new"
    swapped.write_text("second-token\n")
    swapped.replace(token_file)

    async with admin_client(edge, "second-token") as admin:
        assert (await admin.get("/config")).status_code == 200
    async with admin_client(edge, "first-token") as admin:
        assert (await admin.get("/config")).status_code == 401


async def test_off_loopback_the_edge_refuses_to_start_without_auth(
    refresh_document, tmp_path: Path
) -> None:
    config = load_data(refresh_document())
    with pytest.raises(AdminAuthError, match="off loopback, without auth"):
        EdgeServer(config, admin_listen="0.0.0.0:0")

    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    for token_file, says in [(empty, "is empty"), (tmp_path / "missing", "cannot read")]:
        document = refresh_document()
        document["edge"]["admin"]["token_file"] = str(token_file)
        with pytest.raises(AdminAuthError, match=says):
            EdgeServer(load_data(document), admin_listen="0.0.0.0:0")

    document = refresh_document()
    document["edge"]["admin"]["token_hash_sha256"] = token_sha256(ADMIN_TOKEN)
    EdgeServer(load_data(document), admin_listen="0.0.0.0:0")  # with auth it may


# -- what it shows ---------------------------------------------------------------------------------


async def test_config_is_shown_with_its_hash_and_secrets_redacted(start_edge, refresh_document):
    document = refresh_document()
    document["edge"]["admin"]["token_hash_sha256"] = token_sha256(ADMIN_TOKEN)
    edge = await start_edge(document)
    async with admin_client(edge, ADMIN_TOKEN) as admin:
        response = await admin.get("/config")
    shown = response.json()
    assert shown["config_hash"] == config_hash(load_data(document))
    assert shown["generation"] == 1
    for secret in (
        token_sha256(ADMIN_TOKEN),
        document["nodes"][0]["token_hash_sha256"],
        document["openai"]["principal_tokens"][0]["token_hash_sha256"],
    ):
        assert secret not in response.text
    assert shown["config"]["edge"]["admin"]["token_hash_sha256"] == "<redacted>"
    assert shown["config"]["nodes"][0]["token_hash_sha256"] == "<redacted>"
    token = shown["config"]["openai"]["principal_tokens"][0]
    assert token == {
        "token_ref": "search-chat",
        "token_hash_sha256": "<redacted>",
        "token_secret": None,
        "principal_ref": "team-search",
        "alias": None,
    }


async def test_the_last_report_is_kept(start_edge, refresh_document) -> None:
    document = refresh_document()
    edge = await start_edge(document)
    async with admin_client(edge) as admin:
        assert (await admin.get("/refresh/last")).status_code == 404
        dry = (await admin.post("/refresh", json={"mode": "dry_run", "config": document})).json()
        assert (await admin.get("/refresh/last")).json() == dry
        assert (await admin.get("/refresh/last", params={"mode": "apply"})).status_code == 404
        applied = (await admin.post("/refresh", json={"mode": "apply", "config": document})).json()
        assert (await admin.get("/refresh/last", params={"mode": "apply"})).json() == applied
        assert (await admin.get("/refresh/last", params={"mode": "x"})).status_code == 400
    assert dry["requested_by"].startswith("127.0.0.1:")
    assert dry["requested_by"].endswith("no auth (loopback)")
    # Each report is counted by mode and outcome: the dashboard's "config applies" panel.
    metrics = edge.metrics.render().decode()
    assert 'iop_edge_refreshes_total{mode="dry_run",outcome="valid"} 1.0' in metrics
    assert 'iop_edge_refreshes_total{mode="apply",outcome="applied"} 1.0' in metrics


# -- pushes ----------------------------------------------------------------------------------------


async def test_a_no_change_apply_swaps_and_pushes_nothing(refresh_stack, refresh_document):
    stack = await refresh_stack()
    (connection,) = stack.node.connections.values()
    before = await stack.current()
    reports = [
        await stack.refresh(refresh_document(), "dry_run"),
        await stack.refresh(refresh_document()),
    ]
    for report in reports:
        lists_never_null(report)
        assert report["changed"] is False
        assert report["pushes"] == report["nodes_to_push"] == report["live_paths"] == []
        assert report["config_hash"] == report["previous_config_hash"] == before["config_hash"]
    assert reports[0]["outcome"] == "valid" and reports[0]["generation"] == 1
    assert reports[1]["outcome"] == "applied" and reports[1]["applied"] is True
    assert (reports[1]["previous_generation"], reports[1]["generation"]) == (1, 2)
    assert "nothing pushed" in reports[1]["message"]
    assert stack.edge.hub.nodes()["node-1"].applied_generation == 1

    # A change for node-1 now: its push is acknowledged before the report returns, and the
    # stream keeps order, so a push of the no-change apply would have been counted before it.
    document = refresh_document()
    document["nodes"][0]["providers"][0]["capacity"] = 3
    report = await stack.refresh(document)
    assert [push["status"] for push in report["pushes"]] == ["acked"]
    assert connection.refreshes == 1
    assert stack.edge.hub.nodes()["node-1"].applied_generation == 3


async def test_a_node_placed_on_the_edge_is_applied_to_only_when_its_payload_changes(
    start_edge,
) -> None:
    """Issue 38: a limits-only or no-change apply reported the placed node as pushed."""
    document = edge_document(
        {"local": [provider("pa", capacity=2)]}, {"m": ["pa"]}, placement="edge", admin=True
    )
    edge = await start_edge(document)
    async with admin_client(edge) as admin:

        async def apply(changed: dict[str, Any]) -> dict[str, Any]:
            response = await admin.post("/refresh", json={"mode": "apply", "config": changed})
            assert response.status_code == 200, response.text
            report: dict[str, Any] = response.json()
            return report

        unchanged = await apply(document)
        limits_only = copy.deepcopy(document)
        limits_only["openai"]["retries"] = {"max_per_request": 1}
        limits = await apply(limits_only)
        for report in (unchanged, limits):
            assert report["pushes"] == report["nodes_to_push"] == [], report
        assert "nothing pushed" in unchanged["message"]
        assert "nothing to push" in limits["message"]
        capacity = copy.deepcopy(limits_only)
        capacity["nodes"][0]["providers"][0]["capacity"] = 3
        report = await apply(capacity)
        assert [(p["node_id"], p["status"]) for p in report["pushes"]] == [("local", "acked")]
        assert "pushed to 1 node: 1 acked" in report["message"]


async def test_lists_are_never_null_in_any_report(refresh_stack, refresh_document) -> None:
    stack = await refresh_stack()
    live = refresh_document()
    live["nodes"][0]["providers"][0]["capacity"] = 3
    restart = refresh_document()
    restart["edge"]["id"] = "edge-other"
    reports = [
        await stack.refresh(live, "dry_run"),
        await stack.refresh(restart, "dry_run"),
        await stack.refresh(restart, status=409),
        await stack.refresh({"edge": {}}, status=422),
        await stack.refresh(live),
    ]
    for report in reports:
        lists_never_null(report)
    assert reports[-1]["pushes"][0]["status"] == "acked"


async def test_only_nodes_whose_payload_changed_get_a_push(refresh_stack, refresh_document):
    stack = await refresh_stack()
    (connection,) = stack.node.connections.values()
    document = refresh_document()
    document["nodes"][1]["providers"][0]["capacity"] = 5  # pc, on node-2 (never connected)
    report = await stack.refresh(document)
    assert report["nodes_to_push"] == ["node-2"]
    (push,) = report["pushes"]
    assert (push["node_id"], push["status"]) == ("node-2", "not_connected")
    assert "when it connects" in push["reason"]
    assert "1 not connected" in report["message"]

    document["nodes"][0]["providers"][1]["capacity"] = 5  # pb, on node-1
    report = await stack.refresh(document)
    (push,) = report["pushes"]
    digest = node_payloads(load_data(document))["node-1"].digest
    assert push == {
        "node_id": "node-1",
        "status": "acked",
        "reason": "",
        "generation": 3,
        "config_hash": digest,
    }
    # Acked before the report returned, on an ordered stream: the first push node-1 ever got,
    # so the apply that changed only node-2 sent node-1 nothing.
    assert connection.refreshes == 1
    assert stack.node.runner.registry.digest == digest


async def test_a_node_that_reconnects_gets_the_current_payload_on_welcome(
    refresh_stack, refresh_document, start_node, until
) -> None:
    stack = await refresh_stack()
    await stack.node.stop()
    await until(lambda: "node-1" not in stack.edge.hub.nodes())
    document = refresh_document()
    document["nodes"][0]["providers"][0]["capacity"] = 7
    report = await stack.refresh(document)
    (push,) = report["pushes"]
    assert (push["node_id"], push["status"]) == ("node-1", "not_connected")

    node = await start_node(stack.edge.hub)
    (connection,) = node.connections.values()
    assert node.runner.registry.provisions["pa"].payload.capacity == 7
    assert node.runner.registry.digest == push["config_hash"]
    assert connection.refreshes == 0  # it came with the welcome
    status = stack.edge.hub.nodes()["node-1"]
    assert (status.applied_generation, status.applied_hash) == (2, push["config_hash"])
    assert stack.served(await stack.chat()) == "served-a"


async def test_applies_run_one_at_a_time(refresh_stack, refresh_document) -> None:
    stack = await refresh_stack()
    candidates = []
    for capacity in range(1, 7):
        document = refresh_document()
        document["nodes"][0]["providers"][0]["capacity"] = capacity
        candidates.append(document)
    reports = await asyncio.gather(*(stack.refresh(c) for c in candidates))
    generations = sorted((r["previous_generation"], r["generation"]) for r in reports)
    assert generations == [(n, n + 1) for n in range(1, 7)]
    assert all(r["pushes"][0]["status"] == "acked" for r in reports if r["pushes"])
    last = max(reports, key=lambda r: r["generation"])
    assert (await stack.current())["config_hash"] == last["config_hash"]
    node_capacity = stack.node.runner.registry.provisions["pa"].payload.capacity
    assert stack.edge.dispatcher.snapshot.providers["pa"].capacity == node_capacity


class SilentNode:
    """node-2 over a raw stream: acknowledges its welcome, then answers refreshes with `ack`
    (or not at all when `ack` is None). With `late_welcome_ack`, it acknowledges its welcome
    only once a refresh has arrived (a node still starting up while an apply runs). With
    `runs`, it acknowledges its welcome as pending and keeps that payload (another Edge welcomed
    it with it). It sends no heartbeats: its Edge's config (`patient()`) waits a minute before
    it counts it as gone."""

    def __init__(
        self,
        port: int,
        credentials: grpc.ChannelCredentials,
        ack: pb.ConfigAck | None,
        *,
        late_welcome_ack: bool = False,
        instance_id: str = "",
        runs: str = "",
    ) -> None:
        self.port = port
        self.credentials = credentials
        self.ack = ack
        self.late_welcome_ack = late_welcome_ack
        self.instance_id = instance_id
        self.runs = runs
        self.refreshes = 0
        self.applied_hash = ""

    async def run(self, ready: asyncio.Event) -> None:
        async with grpc.aio.secure_channel(f"127.0.0.1:{self.port}", self.credentials) as channel:
            call = NodeRuntimeStub(channel).Connect()
            hello = pb.Hello(
                protocol_version=PROTOCOL_VERSION,
                node_id="node-2",
                token="node-2-token",
                instance_id=self.instance_id,
            )
            await call.write(pb.NodeMessage(hello=hello))
            first = await call.read()
            assert isinstance(first, pb.EdgeMessage)
            welcome = first.welcome
            ack = pb.ConfigAck(
                generation=welcome.config.generation,
                config_hash=welcome.config.config_hash,
                ok=True,
                pending=bool(self.runs),
                in_use_hash=self.runs,
            )
            self.applied_hash = self.runs or welcome.config.config_hash
            if not self.late_welcome_ack:
                await call.write(pb.NodeMessage(acks=[ack]))
            ready.set()
            while True:
                message = await call.read()
                if not isinstance(message, pb.EdgeMessage):
                    return
                if message.HasField("refresh"):
                    self.refreshes += 1
                    if self.late_welcome_ack:
                        await call.write(pb.NodeMessage(acks=[ack]))
                    if self.ack is not None:
                        reply = pb.ConfigAck()
                        reply.CopyFrom(self.ack)
                        reply.generation = message.refresh.config.generation
                        if reply.ok:
                            reply.config_hash = message.refresh.config.config_hash
                            self.applied_hash = reply.config_hash
                        await call.write(pb.NodeMessage(acks=[reply]))


def patient(document: dict[str, Any]) -> dict[str, Any]:
    """`document` with a heartbeat deadline long enough for a `SilentNode`."""
    document["edge"]["node_link"] = {"heartbeat_timeout_ms": 60_000}
    return document


@pytest.mark.parametrize(
    ("ack", "reason"),
    [
        pytest.param(None, "no acknowledgement within 0.3s", id="silent"),
        pytest.param(pb.ConfigAck(ok=False, error="cannot build pc"), "cannot build pc", id="nack"),
    ],
)
async def test_a_node_that_does_not_ack_is_reported_failed(
    start_edge, refresh_document, until, tls, ack, reason
) -> None:
    edge = await start_edge(patient(refresh_document()), ack_timeout_s=0.3)
    node = SilentNode(edge.hub_port, tls.client().credentials(), ack)
    ready = asyncio.Event()
    task = asyncio.create_task(node.run(ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        await until(lambda: edge.hub.nodes().get("node-2") and edge.hub.nodes()["node-2"].ready)
        document = patient(refresh_document())
        document["nodes"][1]["providers"][0]["capacity"] = 5
        async with admin_client(edge) as admin:
            report = (
                await admin.post("/refresh", json={"mode": "apply", "config": document})
            ).json()
        assert report["applied"] is True
        (push,) = report["pushes"]
        assert (push["node_id"], push["status"], push["reason"]) == ("node-2", "failed", reason)
        assert node.refreshes == 1
    finally:
        task.cancel()
        await asyncio.wait([task])


async def test_a_node_still_starting_up_gets_the_push_too(
    start_edge, refresh_document, tls
) -> None:
    edge = await start_edge(patient(refresh_document()))
    node = SilentNode(
        edge.hub_port, tls.client().credentials(), pb.ConfigAck(ok=True), late_welcome_ack=True
    )
    ready = asyncio.Event()
    task = asyncio.create_task(node.run(ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        assert not edge.hub.nodes()["node-2"].ready  # welcomed, not acknowledged yet
        document = patient(refresh_document())
        document["nodes"][1]["providers"][0]["capacity"] = 5
        async with admin_client(edge) as admin:
            report = (
                await admin.post("/refresh", json={"mode": "apply", "config": document})
            ).json()
        (push,) = report["pushes"]
        assert (push["node_id"], push["status"]) == ("node-2", "acked")
        assert node.refreshes == 1
        assert node.applied_hash == node_payloads(load_data(document))["node-2"].digest
        assert edge.hub.nodes()["node-2"].ready
    finally:
        task.cancel()
        await asyncio.wait([task])


# -- restarts the caller makes itself, and the per-node status ------------------------------------


def adapter_changed(document: dict[str, Any]) -> dict[str, Any]:
    """node-2's provider gets another adapter setting: restart-required, scope node:node-2."""
    document["nodes"][1]["providers"][0]["adapter"]["completion_tokens"] = 9
    document["nodes"][1]["providers"][0]["capacity"] = 3
    return document


async def test_a_node_the_caller_restarts_does_not_refuse_the_apply_and_gets_no_push(
    start_edge, refresh_document, until, tls
) -> None:
    def on_pc(document: dict[str, Any]) -> dict[str, Any]:
        document["models"].append({"id": "n", "providers": {"pc": "served-c"}})
        return patient(document)

    edge = await start_edge(on_pc(refresh_document()))
    node = SilentNode(edge.hub_port, tls.client().credentials(), pb.ConfigAck(ok=True))
    ready = asyncio.Event()
    task = asyncio.create_task(node.run(ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        await until(lambda: edge.hub.nodes().get("node-2") and edge.hub.nodes()["node-2"].ready)
        document = adapter_changed(on_pc(refresh_document()))
        async with admin_client(edge) as admin:
            refused = await admin.post("/refresh", json={"mode": "apply", "config": document})
            body = {"mode": "apply", "config": document, "restarting": ["node:node-2"]}
            applied = await admin.post("/refresh", json=body)
            status = (await admin.get("/status")).json()
            revisions = (await admin.get("/revisions")).json()

        assert refused.status_code == 409
        assert applied.status_code == 200
        report = applied.json()
        assert (report["outcome"], report["applied"], report["restarting"]) == (
            "applied",
            True,
            ["node:node-2"],
        )
        assert report["restart_scopes"] == ["node:node-2"]
        (push,) = report["pushes"]
        assert (push["node_id"], push["status"]) == ("node-2", "held")
        assert node.refreshes == 0
        # The change touches model n (its provider's adapter), and it is the restart's to roll
        # out: the Edge could not put it back by itself, so it judges none of it.
        latest = revisions["revisions"][0]
        assert (latest["touched_models"], latest["outcome"]) == (["n"], "kept")
        assert (
            latest["reason"] == "restart-required: the caller's restart of its nodes rolls it out"
        )
        assert revisions["candidate"] is None
        assert edge.hub.snapshot.config.nodes[1].providers[0].capacity == 3
        assert status["config_hash"] == config_hash(load_data(document))
        states = {n["node_id"]: n for n in status["nodes"]}
        assert states["node-1"]["connected"] is False
        assert states["node-2"]["connected"] is True
        assert states["node-2"]["current"] is False  # still on the payload it had
        assert (
            states["node-2"]["expected_hash"] == node_payloads(load_data(document))["node-2"].digest
        )
    finally:
        task.cancel()
        await asyncio.wait([task])

    # Its restart: connecting again, it is welcomed with the new payload.
    node = SilentNode(edge.hub_port, tls.client().credentials(), pb.ConfigAck(ok=True))
    ready = asyncio.Event()
    task = asyncio.create_task(node.run(ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        expected = node_payloads(load_data(document))["node-2"].digest
        await until(lambda: edge.hub.nodes()["node-2"].applied_hash == expected)
        async with admin_client(edge) as admin:
            status = (await admin.get("/status")).json()
        assert {n["node_id"]: n["current"] for n in status["nodes"]} == {
            "node-1": False,
            "node-2": True,
        }
    finally:
        task.cancel()
        await asyncio.wait([task])


@pytest.mark.parametrize(
    ("replacing", "runs_new", "pushed"),
    [
        pytest.param({"node-2": ["old-process"]}, False, True, id="a-process-it-does-not-replace"),
        pytest.param({"node-2": ["this-process"]}, False, False, id="the-process-it-replaces"),
        pytest.param(None, True, True, id="a-process-that-runs-the-new-payload"),
    ],
)
async def test_a_node_process_past_its_restart_gets_the_push(
    start_edge, refresh_document, until, tls, replacing, runs_new, pushed
) -> None:
    """The new process of a restarting node that connected before this Edge took the change
    (welcomed with the old payload here, perhaps with the new one by another Edge) gets it now:
    holding it would wait for a restart that already happened. Only the processes the restart
    replaces are held (`replacing`, as the caller knows them), and never one that runs the new
    payload already."""
    document = adapter_changed(refresh_document())
    new_digest = node_payloads(load_data(document))["node-2"].digest
    edge = await start_edge(patient(refresh_document()))
    node = SilentNode(
        edge.hub_port,
        tls.client().credentials(),
        pb.ConfigAck(ok=True),
        instance_id="this-process",
        runs=new_digest if runs_new else "",
    )
    ready = asyncio.Event()
    task = asyncio.create_task(node.run(ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        await until(lambda: edge.hub.nodes().get("node-2") and edge.hub.nodes()["node-2"].ready)
        body: dict[str, Any] = {
            "mode": "apply",
            "config": patient(document),
            "restarting": ["node:node-2"],
        }
        if replacing is not None:
            body["replacing"] = replacing
        async with admin_client(edge) as admin:
            applied = await admin.post("/refresh", json=body)
        assert applied.status_code == 200, applied.text
        (push,) = applied.json()["pushes"]
        assert (push["status"], node.refreshes) == (("acked", 1) if pushed else ("held", 0))
        assert (edge.hub.nodes()["node-2"].applied_hash == new_digest) is pushed
    finally:
        task.cancel()
        await asyncio.wait([task])


@pytest.mark.parametrize(
    ("edit", "restarting", "replacing", "status"),
    [
        pytest.param(adapter_changed, ["node:node-1"], {}, 409, id="another-node"),
        pytest.param(
            lambda d: adapter_changed(d) | {"a2a": {"listen": "127.0.0.1:0"}},
            ["node:node-2"],
            {},
            409,
            id="an-edge-path-too",
        ),
        pytest.param(adapter_changed, ["edge"], {}, 400, id="edge-scope"),
        pytest.param(adapter_changed, ["node:Node_2"], {}, 400, id="not-a-node-id"),
        pytest.param(
            adapter_changed, ["node:node-1"], {"node-2": ["a"]}, 400, id="replacing-another-node"
        ),
    ],
)
async def test_only_the_named_node_scopes_are_taken_over(
    start_edge, refresh_document, edit, restarting, replacing, status
) -> None:
    edge = await start_edge(refresh_document())
    body = {
        "mode": "apply",
        "config": edit(refresh_document()),
        "restarting": restarting,
        "replacing": replacing,
    }
    async with admin_client(edge) as admin:
        response = await admin.post("/refresh", json=body)
        assert response.status_code == status
        assert (await admin.get("/status")).json()["generation"] == 1


async def test_the_status_says_what_the_process_served_and_the_operator_reads_it(
    refresh_stack,
) -> None:
    """`served` of GET /status: every request this process answered, in counts an operator
    subtracts (an Edge restart's new pod held to the old ones: iop.operator.gating)."""
    stack = await refresh_stack()
    before = (await stack.admin.get("/status")).json()["served"]
    assert before["figures"]["requests"] == 0
    for _ in range(3):
        stack.served(await stack.chat())
    assert (await stack.chat(model="no-such-model")).status_code == 404  # not the pool's

    served = (await stack.admin.get("/status")).json()["served"]
    assert served["since"] == before["since"]
    figures = served["figures"]
    assert (figures["requests"], figures["failed"], figures["retried"]) == (3, 0, 0)
    assert sum(figures["first_tokens"]) == sum(figures["durations"]) == 3

    admin = EdgeAdmin()
    async with admin:
        replica = EdgeReplica("edge-0", "uid", str(stack.edge.admin_url), True, None)
        status = await admin.status(replica, None)
    assert status.served is not None
    assert status.served.since == served["since"]
    assert status.served.figures.requests == 3
