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

import asyncio
import base64
import datetime
import ipaddress
import logging
import os
import ssl
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..errors import KubeConflict, KubeNotFound
from ..kubeapi import KubeApi, resource_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SelfSignedCertificate:
    """A serving certificate that is its own CA. Its key stays in memory: `server_context()`
    writes it to disk only for the moment Python's ssl reads it, in a private temporary folder
    removed at once (files in a given `folder` stay: the caller's)."""

    cert_pem: bytes
    key_pem: bytes
    certfile: Path | None = None
    keyfile: Path | None = None

    @classmethod
    def create(
        cls, hostnames: Iterable[str], folder: Path | None = None, days: int = 3650
    ) -> SelfSignedCertificate:
        """A new key and certificate for `hostnames` (DNS names or IP addresses), valid for
        `days` (the operator makes a new one at every start). With `folder`, also written there
        (the key readable by this user only)."""
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
        return cls.of(cert_pem, key_pem, folder)

    @classmethod
    def of(
        cls, cert_pem: bytes, key_pem: bytes, folder: Path | None = None
    ) -> SelfSignedCertificate:
        """A certificate and key already made (with `folder`, written there too)."""
        if folder is None:
            return cls(cert_pem, key_pem)
        certfile, keyfile = folder / "tls.crt", folder / "tls.key"
        certfile.write_bytes(cert_pem)
        descriptor = os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(key_pem)
        return cls(cert_pem, key_pem, certfile, keyfile)

    def server_context(self) -> ssl.SSLContext:
        """A TLS server context with this certificate; the key's file lives only while ssl
        reads it (a private temporary folder, removed before this returns)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        with tempfile.TemporaryDirectory(prefix="iop-operator-tls-") as folder:
            written = SelfSignedCertificate.of(self.cert_pem, self.key_pem, Path(folder))
            assert written.certfile is not None and written.keyfile is not None
            context.load_cert_chain(written.certfile, written.keyfile)
        return context

    def serves(self, hostnames: Iterable[str], *, for_days: int = 30) -> bool:
        """Whether it names every one of `hostnames` and stays valid `for_days` more."""
        certificate = x509.load_pem_x509_certificate(self.cert_pem)
        left = certificate.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
        if left < datetime.timedelta(days=for_days):
            return False
        try:
            alternatives = certificate.extensions.get_extension_for_class(
                x509.SubjectAlternativeName
            ).value
        except x509.ExtensionNotFound:
            return False
        named = {str(n) for n in alternatives.get_values_for_type(x509.DNSName)}
        named |= {str(n) for n in alternatives.get_values_for_type(x509.IPAddress)}
        return {h for h in hostnames if h} <= named


async def shared_certificate(
    api: KubeApi,
    namespace: str,
    secret: str,
    hostnames: Iterable[str],
    owner: Mapping[str, Any] | None = None,
) -> SelfSignedCertificate:
    """The webhook certificate every replica of the operator serves with, kept in Secret
    `secret` (`tls.crt`, `tls.key`): made by the first replica that finds none (or one that no
    longer names the Service or expires within 30 days), read by the others, so one caBundle
    trusts them all. Made in the cluster, never by a Helm render. `owner` (an ownerReference:
    the webhook's Service) makes the Secret go with its release (`helm uninstall`, an Argo CD
    prune) through the garbage collector; a Secret found without it gets it."""
    names = list(hostnames)
    owners = [dict(owner)] if owner is not None else []
    path = resource_path("v1", "secrets", namespace, secret)
    found: dict[str, Any] | None
    try:
        found = await api.get(path, what=f"read the webhook certificate Secret {secret}")
    except KubeNotFound:
        found = None
    if found is not None:
        data = found.get("data") or {}
        if "tls.crt" in data and "tls.key" in data:
            current = await asyncio.to_thread(
                SelfSignedCertificate.of,
                base64.b64decode(data["tls.crt"]),
                base64.b64decode(data["tls.key"]),
            )
            if current.serves(names):
                if owner is not None and not _owned_by(found, owner):
                    patch = {"metadata": {"ownerReferences": [*_owners_of(found), *owners]}}
                    await api.merge_patch(path, patch, what=f"give the Secret {secret} its owner")
                return current
    fresh = await asyncio.to_thread(SelfSignedCertificate.create, names)
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": secret, "namespace": namespace, "ownerReferences": owners},
        "type": "kubernetes.io/tls",
        "data": {
            "tls.crt": base64.b64encode(fresh.cert_pem).decode(),
            "tls.key": base64.b64encode(fresh.key_pem).decode(),
        },
    }
    try:
        await api.create_or_replace(path, body, found, what=f"the Secret {secret}")
    except KubeConflict:  # another replica wrote it first: serve with theirs
        return await shared_certificate(api, namespace, secret, names, owner)
    logger.info("made the webhook certificate in Secret %s", secret)
    return fresh


def owner_reference(obj: Mapping[str, Any]) -> dict[str, Any]:
    """An ownerReference to `obj` (as read from the API)."""
    metadata = obj["metadata"]
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": metadata["name"],
        "uid": metadata["uid"],
    }


def _owners_of(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(obj.get("metadata", {}).get("ownerReferences") or [])


def _owned_by(obj: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    return any(ref.get("uid") == owner["uid"] for ref in _owners_of(obj))


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
    path = resource_path(
        "admissionregistration.k8s.io/v1", "validatingwebhookconfigurations", name=configuration
    )
    current = await api.get(path, what=f"read ValidatingWebhookConfiguration {configuration}")
    if ca_bundle_current(current, ca_pem, url):
        return
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


def ca_bundle_current(configuration: dict[str, Any], ca_pem: bytes, url: str | None = None) -> bool:
    """Whether every webhook of the configuration already trusts `ca_pem` (and calls `url`)."""
    bundle = base64.b64encode(ca_pem).decode()
    webhooks = configuration.get("webhooks") or ()
    return bool(webhooks) and all(
        (w.get("clientConfig") or {}).get("caBundle") == bundle
        and (url is None or (w.get("clientConfig") or {}).get("url") == url)
        for w in webhooks
    )
