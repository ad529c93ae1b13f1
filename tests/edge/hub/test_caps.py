"""The node hub's bounds before authentication: the caps fitted to the open-file limit, the
calls waiting for their hello counted overall and per address, refusals counted and logged once
per interval, grpc's peer strings read."""

from __future__ import annotations

import logging
import time

import pytest

from iop.aiokits import FD_RESERVE
from iop.edge.http.caps import HttpCaps
from iop.edge.hub.caps import (
    NODE_MESSAGE_BYTES,
    CapRefusal,
    CapRefusals,
    HelloGate,
    HubCaps,
    peer_address,
)
from iop.edgeconfig import NodeLinkSection
from iop.wire import Liveness


def test_the_hub_and_the_openai_listener_share_the_open_files() -> None:
    hub = HubCaps.of(NodeLinkSection()).fitted(open_files=300)
    openai = HttpCaps(reserved_files=hub.connection_bound).fitted(open_files=300)
    assert hub.connection_bound + openai.max_connections <= 300 - FD_RESERVE + 16
    assert HubCaps().fitted(open_files=1 << 20) == HubCaps()


def test_fitting_keeps_room_for_the_hellos_beside_the_admitted_nodes() -> None:
    room = (1024 - FD_RESERVE) // 2  # ulimit -n 1024, a common default
    fitted = HubCaps().fitted(open_files=1024)
    assert fitted.connection_bound == room
    assert fitted.max_unauthenticated == 64 and fitted.max_connections == room - 64
    small = HubCaps().fitted(open_files=FD_RESERVE + 32)  # room for 16
    assert (small.max_connections, small.max_unauthenticated) == (8, 8)
    assert small.max_unauthenticated_per_client == 8


def test_grpc_enforces_the_message_bound_and_the_handshake_deadline() -> None:
    options = dict(HubCaps(hello_timeout=2.5, max_connections=40).server_options())
    assert options["grpc.max_receive_message_length"] == NODE_MESSAGE_BYTES
    assert options["grpc.server_handshake_timeout_ms"] == 2500
    assert options["grpc.max_connection_idle_ms"] == 2500
    # The admitted Nodes and those whose hello is checked: a refusal past the cap is answered.
    assert options["grpc.max_allowed_incoming_connections"] == 40 + 64


def test_calls_waiting_for_their_hello_are_capped_overall_and_per_address() -> None:
    gate = HelloGate(HubCaps(max_unauthenticated=3, max_unauthenticated_per_client=2))
    assert gate.enter("10.0.0.1") is None
    assert gate.enter("10.0.0.1") is None
    mine = gate.enter("10.0.0.1")
    assert mine is not None and (mine.reason, mine.cap) == ("per_client", 2)
    assert "10.0.0.1" in mine.why
    assert gate.enter("10.0.0.2") is None
    crowded = gate.enter("10.0.0.3")  # three wait already
    assert crowded is not None and (crowded.reason, crowded.cap) == ("unauthenticated", 3)
    assert gate.refused == 2
    gate.leave("10.0.0.1")
    assert gate.enter("10.0.0.3") is None


def test_refusals_are_counted_by_cap_and_logged_once_per_interval_with_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("tests.hub.refusals")
    refusals = CapRefusals(logger, interval=0.2)
    full = CapRefusal("connections", "8 nodes are connected", 8)
    crowded = CapRefusal("unauthenticated", "2 connections are waiting", 2)

    def lines(setting: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if setting in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger=logger.name):
        for _ in range(5):
            refusals.refused(full, "ipv4:127.0.0.1:5000")
        refusals.refused(crowded, "ipv4:127.0.0.1:5001")
        assert refusals.counts == {"connections": 5, "unauthenticated": 1, "per_client": 0}
        # One line per cap so far, however many refusals: the first of each.
        (first,) = lines("edge.node_link.max_connections is 8")
        assert first == (
            "node hub refused a connection from ipv4:127.0.0.1:5000: 8 nodes are connected "
            "(edge.node_link.max_connections is 8)"
        )
        assert len(lines("edge.node_link.max_unauthenticated_connections is 2")) == 1
        # Past the interval, the next line says how many went unlogged since the first.
        began = time.monotonic()
        while len(lines("max_connections is 8")) < 2 and time.monotonic() - began < 10:
            refusals.refused(full, "ipv4:127.0.0.1:5000")
            time.sleep(0.01)
    second = lines("max_connections is 8")[1]
    held = refusals.counts["connections"] - 2
    assert second.endswith(f"(and {held} more like it since the last such line)"), second


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


def test_keepalive_follows_a_quiet_links_interval() -> None:
    """A ping waits for a quiet link's heartbeat interval and a tick, never less than 5 s."""

    def keepalive(liveness: Liveness | None) -> int:
        return dict(HubCaps().server_options(liveness))["grpc.keepalive_time_ms"]

    assert keepalive(None) == 5000
    assert keepalive(Liveness(0.5, 2.0)) == 5000  # quiet links off
    assert keepalive(Liveness(0.5, 2.0, 5.0, 20.0)) == 5500
    assert keepalive(Liveness(0.5, 2.0, 10.0, 30.0)) == 10_500
