"""Certificate files -> gRPC credentials, for servers and for the channels that dial them.

One certificate per service serves both roles: it is the server's certificate on its own port and
the client certificate it presents when it dials another service. ``ca`` verifies the peer: a
server given a CA requires and verifies client certificates (mutual TLS) unless told otherwise
(the scheduler's public port: clients authenticate with API keys instead). See docs/security.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSFiles:
    """PEM files (read from ``KVMESH_TLS_CERT`` / ``_KEY`` / ``_CA``; empty = plaintext).

    Attributes:
        cert / key: this process's certificate chain and private key.
        ca: the service CA: verifies servers when dialing, and client certificates when serving.
        server_name: the name to verify in the server's certificate instead of the dialed host
            (for certificates issued to a service name while dialing an IP).
    """

    cert: str = ""
    key: str = ""
    ca: str = ""
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("KVMESH_TLS_CERT and KVMESH_TLS_KEY must be set together")

    @property
    def enabled(self) -> bool:
        """Whether channels and servers use TLS at all."""
        return bool(self.cert or self.ca)


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(files: TLSFiles, require_client_auth: bool = True) -> grpc.ServerCredentials:
    """TLS for a server; with a CA and ``require_client_auth``, a client certificate it signed is required."""
    if not files.cert:
        raise ValueError("a TLS server needs KVMESH_TLS_CERT and KVMESH_TLS_KEY")
    ca = _read(files.ca)
    key, cert = Path(files.key).read_bytes(), Path(files.cert).read_bytes()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca,
        require_client_auth=bool(ca) and require_client_auth,
    )


def channel_credentials(files: TLSFiles) -> grpc.ChannelCredentials:
    """TLS for a channel: verify the server with the CA (system roots without one), present our cert."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(files.ca), private_key=_read(files.key), certificate_chain=_read(files.cert))
