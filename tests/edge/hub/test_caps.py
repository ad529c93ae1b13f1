"""The node hub's bounds before authentication: the caps fitted to the open-file limit, the
calls waiting for their hello counted overall and per address, grpc's peer strings read."""

from __future__ import annotations

import pytest

from iop.aiokits import FD_RESERVE
from iop.edge.http.caps import HttpCaps
from iop.edge.hub.caps import NODE_MESSAGE_BYTES, HelloGate, HubCaps, peer_address
from iop.edgeconfig import NodeLinkSection


def test_the_hub_and_the_openai_listener_share_the_open_files() -> None:
    hub = HubCaps.of(NodeLinkSection()).fitted(open_files=300)
    openai = HttpCaps(reserved_files=hub.max_connections).fitted(open_files=300)
    assert hub.max_connections + openai.max_connections <= 300 - FD_RESERVE + 16
    assert HubCaps().fitted(open_files=1 << 20).max_connections == 1024


def test_grpc_enforces_the_message_bound_and_the_handshake_deadline() -> None:
    options = dict(HubCaps(hello_timeout=2.5, max_connections=40).server_options())
    assert options["grpc.max_receive_message_length"] == NODE_MESSAGE_BYTES
    assert options["grpc.server_handshake_timeout_ms"] == 2500
    assert options["grpc.max_connection_idle_ms"] == 2500
    assert options["grpc.max_allowed_incoming_connections"] == 40


def test_calls_waiting_for_their_hello_are_capped_overall_and_per_address() -> None:
    gate = HelloGate(HubCaps(max_unauthenticated=3, max_unauthenticated_per_client=2))
    assert gate.enter("10.0.0.1") is None
    assert gate.enter("10.0.0.1") is None
    assert "10.0.0.1" in (gate.enter("10.0.0.1") or "")
    assert gate.enter("10.0.0.2") is None
    assert gate.enter("10.0.0.3") is not None  # three wait already
    assert gate.refused == 2
    gate.leave("10.0.0.1")
    assert gate.enter("10.0.0.3") is None


@pytest.mark.parametrize(
    ("peer", "address"),
    [
        pytest.param("ipv4:10.1.2.3:5000", "10.1.2.3", id="ipv4"),
        pytest.param("ipv6:[2001:db8::1]:5000", "2001:db8::1", id="ipv6"),
        pytest.param("unix:/tmp/hub.sock", "unix:/tmp/hub.sock", id="unix"),
    ],
)
def test_a_grpc_peer_is_read_as_its_address(peer: str, address: str) -> None:
    assert peer_address(peer) == address
