"""The hub's TLS Secret the operator makes when the chart's user names none: certificates the
Edge serves and the Nodes verify (a real handshake, mutual), kept across restarts of the
operator, made again only when they no longer name the hub."""

from __future__ import annotations

import asyncio
import base64
import ssl
from pathlib import Path

import pytest

from iop.operator.hubcertificates import (
    KEYS,
    HubCertificates,
    ensure_hub_certificates,
    hub_names,
)
from iop.operator.webhook import owner_reference

from .fakeapi import FakeApi, fake_api

HUB = "iop-iop-edge-hub.iop.svc"


def _write(certificates: HubCertificates, folder: Path) -> dict[str, Path]:
    paths = {}
    for key, pem in certificates.files.items():
        paths[key] = folder / key
        paths[key].write_bytes(pem)
    return paths


async def test_the_edge_serves_and_a_node_verifies_the_hub_name_both_ways(tmp_path: Path) -> None:
    files = _write(HubCertificates.create(hub_names("iop-iop-edge-hub", "iop")), tmp_path)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=files["ca.crt"])
    server.load_cert_chain(files["tls.crt"], files["tls.key"])
    server.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: the Node's certificate, from the CA
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=files["ca.crt"])
    client.load_cert_chain(files["client.crt"], files["client.key"])
    peers: list[object] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peercert"))
        writer.write(b"ok")
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server)
    port = listener.sockets[0].getsockname()[1]
    async with listener:
        # The Node dials a pod IP and verifies the hub Service's name (--tls-server-name).
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client, server_hostname=HUB
        )
        assert await reader.read() == b"ok"
        writer.close()
        with pytest.raises(ssl.SSLCertVerificationError):
            await asyncio.open_connection(
                "127.0.0.1", port, ssl=client, server_hostname="other.iop.svc"
            )
    assert peers and peers[0]


def test_the_ca_key_is_not_kept_and_the_edges_key_is_apart() -> None:
    certificates = HubCertificates.create([HUB])
    assert set(certificates.files) == set(KEYS)
    assert certificates.serves([HUB])
    assert not certificates.serves([HUB, "hub.example.org"])
    assert b"PRIVATE KEY" not in certificates.files["ca.crt"]
    assert certificates.files["tls.key"] != certificates.files["client.key"]


SECRETS = "/api/v1/namespaces/iop/secrets"
SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "iop-iop-edge-hub", "namespace": "iop", "uid": "hub-uid"},
}


async def test_made_once_owned_by_the_hub_service_and_made_again_for_a_new_name() -> None:
    fake = FakeApi()
    owner = owner_reference(SERVICE)
    async with fake_api(fake) as api:
        assert await ensure_hub_certificates(api, "iop", "hub-tls", [HUB], owner)
        secret = fake.objects[f"{SECRETS}/hub-tls"]
        assert secret["type"] == "kubernetes.io/tls"
        assert set(secret["data"]) == set(KEYS)
        assert secret["metadata"]["ownerReferences"] == [owner]
        first = dict(secret["data"])
        # Another replica, or the next start: the Secret stays as it is.
        assert not await ensure_hub_certificates(api, "iop", "hub-tls", [HUB], owner)
        assert fake.objects[f"{SECRETS}/hub-tls"]["data"] == first
        # tls.serverName changed: the Edge's certificate must name it too.
        names = [HUB, "hub.example.org"]
        assert await ensure_hub_certificates(api, "iop", "hub-tls", names, owner)
        renewed = fake.objects[f"{SECRETS}/hub-tls"]["data"]
        assert renewed["ca.crt"] != first["ca.crt"]
        decoded = {k: base64.b64decode(v) for k, v in renewed.items()}
        assert HubCertificates(decoded).serves(names)
