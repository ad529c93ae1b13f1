"""The public surface of each package is declared and pinned."""

from __future__ import annotations

import iop.edgeconfig


def test_edgeconfig_exports() -> None:
    assert sorted(iop.edgeconfig.__all__) == sorted(
        [
            "A2ASection",
            "AdminSection",
            "BootstrapSection",
            "ChangeReport",
            "ConfigError",
            "ControlPlaneSection",
            "EdgeConfig",
            "EdgeSection",
            "FakeAdapter",
            "GenerationPolicy",
            "ModelSpec",
            "NodePayload",
            "NodeRuntime",
            "NodeSpec",
            "OpenAIAdapter",
            "OpenAISection",
            "PrincipalToken",
            "Problem",
            "ProviderPayload",
            "ProviderSpec",
            "RestartPath",
            "classify",
            "config_hash",
            "is_loopback_listener",
            "load_data",
            "load_file",
            "load_text",
            "node_payload",
            "node_payloads",
            "parse_yaml",
            "split_listener",
        ]
    )
    for name in iop.edgeconfig.__all__:
        assert getattr(iop.edgeconfig, name) is not None
