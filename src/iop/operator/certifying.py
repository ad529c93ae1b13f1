"""The webhook's TLS: a certificate the operator makes for itself, and the CA bundle it hands to
the API server through the ValidatingWebhookConfiguration.

The API server calls webhooks over HTTPS only, and must trust the certificate. The operator
makes a fresh self-signed certificate at every start (names: the webhook Service's DNS names,
the pod IP, loopback), serves the webhook with it, and writes it as the `caBundle` of the
ValidatingWebhookConfiguration the chart installs (RBAC: `get` and `patch` on that one object).
No cert-manager, no certificate generated at `helm install` that an upgrade would regenerate,
no Secret to rotate: a restart is a rotation. docs/operator.md, "The webhook", says why this
over the alternatives.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .kubeapi import KubeApi, resource_path

__all__ = ["SelfSignedCertificate", "patch_ca_bundle"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SelfSignedCertificate:
    """A serving certificate that is its own CA, written to private files for the TLS server."""

    cert_pem: bytes
    key_pem: bytes
    certfile: Path
    keyfile: Path

    @classmethod
    def create(
        cls, hostnames: Iterable[str], folder: Path | None = None, days: int = 3650
    ) -> SelfSignedCertificate:
        """A new key and certificate for `hostnames` (DNS names or IP addresses), valid for
        `days` (the operator makes a new one at every start). Files go to `folder` (a new
        private temporary folder by default), readable by this user only."""
        names = list(dict.fromkeys(h for h in hostnames if h))
        key = ec.generate_private_key(ec.SECP256R1())
        # The names are in the SubjectAlternativeName, which is what clients check; the common
        # name is only a label, and X.509 bounds it at 64 characters (a long Service name in a
        # long namespace is longer).
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _common_name(names))])
        alternatives: list[x509.GeneralName] = []
        for name in names:
            try:
                alternatives.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                alternatives.append(x509.DNSName(name))
        start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(key, hashes.SHA256())
        )
        cert_pem = certificate.public_bytes(serialization.Encoding.PEM)
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        where = folder or Path(tempfile.mkdtemp(prefix="iop-operator-tls-"))
        certfile, keyfile = where / "tls.crt", where / "tls.key"
        certfile.write_bytes(cert_pem)
        descriptor = os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(key_pem)
        return cls(cert_pem, key_pem, certfile, keyfile)


def _common_name(names: list[str]) -> str:
    """The first name if it fits the 64 characters X.509 allows, else the operator's label."""
    first = names[0] if names else ""
    return first if 0 < len(first) <= _COMMON_NAME_LIMIT else "iop-operator"


_COMMON_NAME_LIMIT = 64


async def patch_ca_bundle(
    api: KubeApi, configuration: str, ca_pem: bytes, url: str | None = None
) -> None:
    """Set `caBundle` (and, given `url`, `url`) on every webhook of the named
    ValidatingWebhookConfiguration; the chart owns the rest of it (rules, failure policy)."""
    import base64

    path = resource_path(
        "admissionregistration.k8s.io/v1", "validatingwebhookconfigurations", name=configuration
    )
    current = await api.get(path, what=f"read ValidatingWebhookConfiguration {configuration}")
    bundle = base64.b64encode(ca_pem).decode()
    webhooks: list[dict[str, Any]] = []
    for webhook in current.get("webhooks") or ():
        client: dict[str, Any] = dict(webhook.get("clientConfig") or {})
        client["caBundle"] = bundle
        if url is not None:
            client.pop("service", None)
            client["url"] = url
        webhooks.append({**webhook, "clientConfig": client})
    if not webhooks:
        logger.warning(
            "ValidatingWebhookConfiguration %s has no webhooks to configure", configuration
        )
        return
    # A merge patch replaces the list whole: send every webhook back with only the client changed.
    await api.merge_patch(path, {"webhooks": webhooks}, what=f"set the caBundle of {configuration}")
    logger.info(
        "ValidatingWebhookConfiguration %s trusts this operator's certificate", configuration
    )
