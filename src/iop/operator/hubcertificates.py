"""The Node link's TLS, made in the cluster: a CA, the Edge's server certificate and the Nodes'
client certificate, together in the one Secret the chart's Edge and Node pods mount.

The chart serves the hub over TLS by default; when the user names no Secret of theirs, the
operator makes this one at start (`--hub-tls-secret`), as it makes the webhook's, so a render
stays pure and `helm upgrade` never touches it. One Secret, written at once, so the Edge's
certificate and the Nodes' CA never disagree; the CA's key is dropped once both are signed.
docs/operator.md, "The hub's certificates", says why the operator and not a Helm render.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .errors import KubeConflict
from .kubeapi import KubeApi, resource_path

logger = logging.getLogger(__name__)

#: The Secret's keys: the CA (both sides verify with it), the Edge's pair, the Nodes' pair.
KEYS: Final = ("ca.crt", "tls.crt", "tls.key", "client.crt", "client.key")
#: Ten years: the pods read the files at start, so a renewal takes their restart.
_DAYS: Final = 3650
#: A certificate that expires sooner than this is made again at the operator's start.
_RENEW_BEFORE: Final = datetime.timedelta(days=30)


@dataclass(frozen=True, slots=True)
class HubCertificates:
    """The PEM files of the Secret, by its keys (`KEYS`)."""

    files: Mapping[str, bytes]

    @classmethod
    def create(cls, hostnames: Iterable[str]) -> HubCertificates:
        """A new CA, the Edge's certificate for `hostnames` (DNS names) and a Nodes' client
        certificate, both signed by the CA, whose key is not kept."""
        start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = _name("iop-hub-ca")
        ca = (
            _builder(ca_name, ca_name, ca_key.public_key(), start)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_usage(cert_sign=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
            .sign(ca_key, hashes.SHA256())
        )
        files = {"ca.crt": ca.public_bytes(serialization.Encoding.PEM)}
        names = [x509.DNSName(n) for n in dict.fromkeys(h for h in hostnames if h)]
        for prefix, common_name, purpose, extra in (
            ("tls", "iop-hub", ExtendedKeyUsageOID.SERVER_AUTH, names),
            ("client", "iop-node", ExtendedKeyUsageOID.CLIENT_AUTH, []),
        ):
            key = ec.generate_private_key(ec.SECP256R1())
            builder = (
                _builder(_name(common_name), ca_name, key.public_key(), start)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(_usage(cert_sign=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
                .add_extension(
                    x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
                )
            )
            if extra:
                builder = builder.add_extension(x509.SubjectAlternativeName(extra), critical=False)
            files[f"{prefix}.crt"] = builder.sign(ca_key, hashes.SHA256()).public_bytes(
                serialization.Encoding.PEM
            )
            files[f"{prefix}.key"] = key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        return cls(files)

    def serves(self, hostnames: Iterable[str]) -> bool:
        """Whether every file is there, the Edge's certificate names every one of `hostnames`,
        and both certificates stay valid for 30 days more."""
        if not set(KEYS) <= set(self.files):
            return False
        try:
            server = x509.load_pem_x509_certificate(self.files["tls.crt"])
            client = x509.load_pem_x509_certificate(self.files["client.crt"])
            named = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except (ValueError, x509.ExtensionNotFound):
            return False
        now = datetime.datetime.now(datetime.UTC)
        if min(server.not_valid_after_utc, client.not_valid_after_utc) - now < _RENEW_BEFORE:
            return False
        return {h for h in hostnames if h} <= set(named.get_values_for_type(x509.DNSName))


def hub_names(service: str, namespace: str, extra: Iterable[str] = ()) -> list[str]:
    """The names the Edge's certificate carries: the hub Service's (the chart's Nodes verify
    `SERVICE.NAMESPACE.svc`) and `extra` (`tls.serverName`, names of Nodes outside)."""
    return [f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local", *extra]


async def ensure_hub_certificates(
    api: KubeApi,
    namespace: str,
    secret: str,
    hostnames: Iterable[str],
    owner: Mapping[str, Any] | None = None,
) -> bool:
    """Make Secret `secret` unless it holds certificates that serve `hostnames`; whether it
    was made. `owner` (an ownerReference: the hub's Service) makes it go with the release.
    Replicas race at start: the first one's Secret wins, the others keep it."""
    names = list(hostnames)
    path = resource_path("v1", "secrets", namespace, secret)
    found = await api.find(path, what=f"read the hub TLS Secret {secret}")
    if found is not None:
        data = found.get("data") or {}
        current = HubCertificates({k: base64.b64decode(v) for k, v in data.items()})
        if current.serves(names):
            return False
    fresh = await asyncio.to_thread(HubCertificates.create, names)
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret,
            "namespace": namespace,
            "annotations": {"iop.dev/generated": "hub TLS made by the operator"},
            "ownerReferences": [dict(owner)] if owner is not None else [],
        },
        "type": "kubernetes.io/tls",
        "data": {k: base64.b64encode(v).decode() for k, v in fresh.files.items()},
    }
    try:
        await api.create_or_replace(path, body, found, what=f"the Secret {secret}")
    except KubeConflict:  # another replica wrote it first
        return False
    if found is None:
        logger.info("made the hub's TLS certificates in Secret %s", secret)
    else:
        logger.warning(
            "made new hub TLS certificates in Secret %s (names or validity changed): restart "
            "the Edge and the Nodes to use them",
            secret,
        )
    return True


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name, issuer: x509.Name, key: Any, start: datetime.datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=_DAYS))
    )


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )
