"""The webhook's self-signed certificate: every name in its SANs, whatever their length."""

from __future__ import annotations

import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

from iop.operator.webhook.certificates import (
    SelfSignedCertificate,
    owner_reference,
    shared_certificate,
)

from ..fakeapi import FakeApi, fake_api


def test_a_service_name_longer_than_a_common_name_allows_still_makes_a_certificate(
    tmp_path: Path,
) -> None:
    service = "iop-edge-operator-webhook." + "a-namespace-with-a-long-name-" * 2 + "x.svc"
    assert len(service) > 64
    certificate = SelfSignedCertificate.create([service, "10.88.0.7", "127.0.0.1"], tmp_path)

    parsed = x509.load_pem_x509_certificate(certificate.cert_pem)
    names = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [service]
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["10.88.0.7", "127.0.0.1"]
    (common,) = parsed.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    assert common.value == "iop-operator"
    # A TLS server loads it as it is.
    assert certificate.certfile is not None and certificate.keyfile is not None
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
        certificate.certfile, certificate.keyfile
    )
    assert certificate.keyfile.stat().st_mode & 0o777 == 0o600


def test_the_operators_key_leaves_no_file_behind(monkeypatch, tmp_path: Path) -> None:
    """Made for the webhook (no folder): no file at all, and the TLS context's load leaves none
    (each operator start once left its private key in a /tmp folder of its own)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    certificate = SelfSignedCertificate.create(["webhook.iop.svc", "127.0.0.1"])
    assert (certificate.certfile, certificate.keyfile) == (None, None)
    context = certificate.server_context()
    assert context.cert_store_stats() is not None
    assert list(tmp_path.iterdir()) == []


def test_a_short_name_is_the_common_name(tmp_path: Path) -> None:
    certificate = SelfSignedCertificate.create(["webhook.iop.svc"], tmp_path)
    parsed = x509.load_pem_x509_certificate(certificate.cert_pem)
    (common,) = parsed.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    assert common.value == "webhook.iop.svc"


SECRETS = "/api/v1/namespaces/ns/secrets"
SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "op-webhook", "namespace": "ns", "uid": "svc-uid"},
}


async def test_the_shared_certificate_is_owned_by_the_webhooks_service() -> None:
    """The Secret goes with its release through the garbage collector: made with the Service as
    its owner; one found without (made by an earlier version) gets it, keeping its other owners;
    a second replica reads the same certificate."""
    fake = FakeApi()
    owner = owner_reference(SERVICE)
    names = ["op-webhook.ns.svc"]
    async with fake_api(fake) as api:
        made = await shared_certificate(api, "ns", "op-tls", names, owner)
        secret = fake.objects[f"{SECRETS}/op-tls"]
        assert secret["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Service", "name": "op-webhook", "uid": "svc-uid"}
        ]
        other = {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "other"}
        secret["metadata"]["ownerReferences"] = [other]
        read = await shared_certificate(api, "ns", "op-tls", names, owner)
        assert read.cert_pem == made.cert_pem
        assert fake.objects[f"{SECRETS}/op-tls"]["metadata"]["ownerReferences"] == [other, owner]
