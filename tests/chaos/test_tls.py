"""TLS on the Node <-> Edge link: a Node verifies the Edge's certificate, and with a client CA the
Edge admits only Nodes whose certificate it signed (their token is checked as well)."""

from __future__ import annotations

from pathlib import Path

import pytest

from iop.wire import ClientTls

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(60)]


async def test_mutual_tls_admits_only_nodes_with_a_certificate_of_the_ca(
    wire_config, start_hub, start_node, tls, until
) -> None:
    hub = await start_hub(wire_config([{"id": "p1", "adapter": {"type": "fake"}}]))
    no_cert = await start_node(
        hub, tls=ClientTls(str(tls.ca)), backoff_initial=0.05, backoff_max=0.2, wait=False
    )
    (link,) = no_cert.connections.values()
    await until(lambda: link.failures >= 2, timeout=30)
    assert hub.sessions_opened == 0
    await start_node(hub)  # the tests' node certificate: admitted
    assert hub.sessions_opened == 1


async def test_a_node_refuses_an_edge_its_ca_did_not_sign(
    wire_config, start_hub, start_node, tls, until, tmp_path: Path, tls_factory
) -> None:
    hub = await start_hub(wire_config([{"id": "p1", "adapter": {"type": "fake"}}]))
    stranger = tls_factory(tmp_path)  # another CA, another pair of certificates
    node = await start_node(
        hub,
        tls=ClientTls(str(stranger.ca), str(stranger.client_cert), str(stranger.client_key)),
        backoff_initial=0.05,
        backoff_max=0.2,
        wait=False,
    )
    (link,) = node.connections.values()
    await until(lambda: link.failures >= 2, timeout=30)
    assert hub.sessions_opened == 0
    assert link.welcomes == 0


async def test_a_plaintext_node_cannot_talk_to_a_tls_edge(
    wire_config, start_hub, start_node, until
) -> None:
    hub = await start_hub(wire_config([{"id": "p1", "adapter": {"type": "fake"}}]))
    node = await start_node(hub, tls=None, backoff_initial=0.05, backoff_max=0.2, wait=False)
    (link,) = node.connections.values()
    await until(lambda: link.failures >= 2, timeout=30)
    assert hub.sessions_opened == 0
