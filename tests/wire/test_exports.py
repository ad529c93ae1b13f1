"""The public surfaces of the wire, the Node and the fake upstream are declared and pinned."""

from __future__ import annotations

import pytest

import iop.edge.nodehub
import iop.node
import iop.upstream
import iop.wire


@pytest.mark.parametrize(
    ("module", "names"),
    [
        pytest.param(
            iop.wire,
            [
                "PROTOCOL_VERSION",
                "TERMINAL_EVENTS",
                "AsyncService",
                "CoalescingWriter",
                "ProviderHealth",
                "RunChunk",
                "RunDone",
                "RunEvent",
                "RunFailed",
                "RunKind",
                "RunRequest",
                "RunUsage",
                "grpc_options",
                "guarded_task",
                "statuses",
                "stop_tasks",
            ],
            id="wire",
        ),
        pytest.param(
            iop.node,
            [
                "Adapter",
                "AdapterError",
                "Backoff",
                "DrainReport",
                "EdgeConnection",
                "FakeGenerator",
                "NodeAgent",
                "NodeIdentity",
                "OpenAIHttpAdapter",
                "Provision",
                "Registry",
                "Router",
                "build_adapter",
            ],
            id="node",
        ),
        pytest.param(
            iop.edge.nodehub,
            ["HubSnapshot", "NodeHub", "NodeStatus", "ProviderLink", "RunStream"],
            id="nodehub",
        ),
        pytest.param(
            iop.upstream,
            [
                "WORDS",
                "FailMode",
                "FakeUpstream",
                "FakeUpstreamSettings",
                "UpstreamProcess",
                "UpstreamStats",
                "iop_command",
                "spawn_edge",
                "spawn_fake_upstream",
                "spawn_iop",
                "spawn_node",
                "terminate",
                "tokens",
            ],
            id="upstream",
        ),
    ],
)
def test_exports(module: object, names: list[str]) -> None:
    exported = getattr(module, "__all__")  # noqa: B009
    assert sorted(exported) == sorted(names)
    for name in exported:
        assert getattr(module, name) is not None
