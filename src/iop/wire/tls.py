"""TLS on the Node-Edge link: the Edge's server credentials and the Node's channel credentials.

Node tokens and prompts cross this link, so off a trusted network it runs over TLS: the Edge
presents a certificate (a Kubernetes Secret mounted as files), Nodes verify it against a CA file,
and with a client CA configured the Edge also requires and verifies a client certificate from
every Node (mutual TLS; the node token is still checked). The files are read once, when the
server or channel is built; a rotated certificate takes a restart of the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsError(ValueError):
    """A certificate, key or CA file cannot be read."""


def _read(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"cannot read the {what} {path}: {exc.strerror or exc}") from exc
    if not data.strip():
        raise TlsError(f"the {what} {path} is empty")
    return data


@dataclass(frozen=True, slots=True)
class ServerTls:
    """The Edge's side: its certificate chain and key, and optionally the CA of client certs."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials; with a client CA, a client certificate is required (mTLS)."""
        pair = (_read(self.key_file, "TLS key"), _read(self.cert_file, "TLS certificate"))
        client_ca = _read(self.client_ca_file, "client CA file") if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
        )


@dataclass(frozen=True, slots=True)
class ClientTls:
    """The Node's side: the CA that signed the Edge's certificate, and optionally its own pair.

    `server_name` is the name the Edge's certificate must carry when the Node dials an address
    the certificate does not name (a pod IP behind a headless Service, say).
    """

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise TlsError("a client certificate needs its key, and a key its certificate")

    def credentials(self) -> grpc.ChannelCredentials:
        cert = _read(self.cert_file, "TLS certificate") if self.cert_file else None
        key = _read(self.key_file, "TLS key") if self.key_file else None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "CA file"),
            private_key=key,
            certificate_chain=cert,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]
