"""The public surface of `iop.edge` is declared and pinned."""

from __future__ import annotations

import iop.edge


def test_edge_exports() -> None:
    assert sorted(iop.edge.__all__) == [
        "ANONYMOUS",
        "Authenticator",
        "BadRequest",
        "Candidate",
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
        "NodeRuns",
        "PayloadTooLarge",
        "PoolSnapshot",
        "Principal",
        "ProviderLimits",
        "QueueFull",
        "QueueTimeout",
        "RouteNotFound",
        "Unauthorized",
        "UpstreamError",
    ]
    for name in iop.edge.__all__:
        assert getattr(iop.edge, name) is not None
