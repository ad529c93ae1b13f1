"""The public surface of `iop.edge` is declared and pinned."""

from __future__ import annotations

import iop.edge


def test_edge_exports() -> None:
    assert sorted(iop.edge.__all__) == [
        "ANONYMOUS",
        "AdminApp",
        "AdminAuth",
        "AdminAuthError",
        "Authenticator",
        "BadRequest",
        "Candidate",
        "ConfigPush",
        "Dispatcher",
        "EdgeApp",
        "EdgeError",
        "EdgeServer",
        "Hub",
        "Lease",
        "MethodNotAllowed",
        "Metrics",
        "ModelNotFound",
        "ModelRoute",
        "NoProvider",
        "NodeHub",
        "NodePush",
        "NodeRuns",
        "PayloadTooLarge",
        "PoolSnapshot",
        "Principal",
        "ProviderLimits",
        "QueueFull",
        "QueueTimeout",
        "RefreshReport",
        "Refresher",
        "RouteNotFound",
        "Unauthorized",
        "UpstreamError",
    ]
    for name in iop.edge.__all__:
        assert getattr(iop.edge, name) is not None
