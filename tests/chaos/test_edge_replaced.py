"""An Edge replaced by a pod at a new address (a restart of the Edge, a `helm upgrade`): a Node
that follows the hub's headless Service (`--edge-service`) is welcomed by the new Edge within
about a second of the Service listing it, not at its next periodic lookup (30 s).

The Edges are real `iop edge run` processes on loopback addresses of their own (127.0.0.1,
127.0.0.2; the replica that stays, in process, on 127.0.0.3), all on one port, as pods behind
one Service. The Service's DNS answer is the test's: the Node's resolver seam
(`NodeAgent(resolve=...)`) asks `Service`, which lists what the test says is ready, and answers
as a name without a ready Edge does (no such name) while it lists nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from iop.node import NodeAgent
from iop.node.resolving import FAST_RESOLVE_S
from iop.processes import free_port, terminate
from iop.wire import ClientTls

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]

#: Scheduling on a loaded machine (a dial, a TLS handshake, a welcome), beyond the lookup pace.
SLACK_S = 5.0
SERVICE = "iop-hub"


class Service:
    """The hub's headless Service as DNS answers for it: the addresses of its ready Edges."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.ready: list[str] = []
        self.lookups = 0

    def publish(self, *hosts: str) -> float:
        """List exactly the Edges on `hosts` from now on; returns when (monotonic)."""
        self.ready = [f"{host}:{self.port}" for host in hosts]
        return time.monotonic()

    async def resolve(self, host: str, port: int) -> list[str]:
        assert (host, port) == (SERVICE, self.port)
        self.lookups += 1
        if not self.ready:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.ready)


def shared_port(*hosts: str) -> int:
    """A port free on every one of `hosts` (loopback addresses), as pods share a Service port."""
    for _ in range(50):
        port = free_port(hosts[0])
        try:
            for host in hosts[1:]:
                with contextlib.closing(socket.socket()) as sock:
                    sock.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {hosts}")


@pytest.mark.parametrize("stays", [False, True], ids=["one-replica", "beside-another-replica"])
async def test_a_node_is_welcomed_by_an_edge_that_replaced_its_edge_at_a_new_address(
    document_of, start_edge, iop_processes, tls, node_token, until, tmp_path: Path, stays: bool
) -> None:
    port = shared_port("127.0.0.1", "127.0.0.2", "127.0.0.3")
    service = Service(port)

    def config(edge_id: str, host: str) -> dict[str, Any]:
        provider = {"id": "p1", "adapter": {"type": "fake"}, "served_models": ["served"]}
        edge = {"id": edge_id, "listen": f"{host}:{port}", "admin": {"listen": "127.0.0.1:0"}}
        document: dict[str, Any] = document_of([provider], edge=edge)
        return document

    def write(edge_id: str, host: str) -> Path:
        path = tmp_path / f"{edge_id}.yaml"
        path.write_text(yaml.safe_dump(config(edge_id, host)))
        return path

    async with contextlib.AsyncExitStack() as stack:
        old, _ = await iop_processes.edge(stack, write("edge-old", "127.0.0.1"))
        ready = ["127.0.0.1"]
        if stays:
            await start_edge(config("edge-stays", "127.0.0.3"))
            ready.append("127.0.0.3")
        service.publish(*ready)
        # The Nodes dial pod IPs and verify the name in the Edge's certificate instead.
        client = ClientTls(
            str(tls.ca), str(tls.client_cert), str(tls.client_key), server_name="localhost"
        )
        agent = await stack.enter_async_context(
            NodeAgent(
                node_id="node-1",
                token=node_token,
                services=[f"{SERVICE}:{port}"],
                resolve=service.resolve,
                tls=client,
            )
        )
        await until(
            lambda: agent.readiness()[1] == f"welcomed by {len(ready)} of {len(ready)} Edge(s)"
        )

        # A Node that has been connected for a while: its lookups are at the periodic pace.
        await asyncio.sleep(2 * FAST_RESOLVE_S)

        # The old Edge goes: its pod leaves the Service's endpoints as it stops.
        service.publish(*ready[1:])
        stopped = time.monotonic()
        await terminate(old)
        new, _ = await iop_processes.edge(stack, write("edge-new", "127.0.0.2"))
        listed = service.publish("127.0.0.2", *ready[1:])

        address = f"127.0.0.2:{port}"
        link = await until(lambda: agent.connections.get(address), timeout=60)
        await until(link.connected.is_set, timeout=60)
        welcomed = time.monotonic()
        assert link.edge_id == "edge-new"
        took = welcomed - listed
        print(
            f"\nnode welcomed by the new Edge {took:.2f}s after the Service listed it "
            f"({welcomed - stopped:.2f}s after the old one stopped; {service.lookups} lookups)"
        )
        assert took < FAST_RESOLVE_S + SLACK_S, f"welcomed {took:.1f}s after it was listed"
        await until(lambda: f"127.0.0.1:{port}" not in agent.connections, timeout=10)
        await terminate(new)
