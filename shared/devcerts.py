"""Development certificates and API keys: a service CA, one certificate per service, a keys file.

    python -m shared.devcerts k8s/local/secrets      # what docker-compose.yml mounts

Production certificates come from your PKI (cert-manager in Kubernetes, see docs/security.md);
these are for compose on one machine and for the tests, which make theirs with the same code.
Needs ``cryptography`` (a dev extra), imported here only.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.tls import TLSFiles

SERVICES = ("scheduler", "kv-cache-manager", "model-runner", "offload-store", "router")
# compose's `mesh` profile runs a second replica as <service>-2, and its `pd` profile a prefill and
# a decode replica as <service>-prefill / -decode, all with the same certificates, so each replica
# service's certificate also names those twins (the hosts the other side dials).
MESH_TWINS = ("scheduler", "kv-cache-manager", "model-runner", "offload-store")
TWIN_SUFFIXES = ("-2", "-prefill", "-decode")


@dataclass(frozen=True)
class CA:
    """A CA's key and certificate, and where its certificate was written."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    path: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _validity(builder: x509.CertificateBuilder, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=days))


def make_ca(folder: Path, cn: str, days: int = 365) -> CA:
    """A self-signed CA written to ``folder/<cn>.crt``."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True))
    cert = _validity(builder, days).sign(key, hashes.SHA256())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{cn}.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return CA(key, cert, path)


def make_cert(folder: Path, cn: str, ca: CA, dns_names: tuple[str, ...] = (), days: int = 365) -> TLSFiles:
    """A server+client certificate for ``cn`` (SANs: cn, dns_names, localhost, 127.0.0.1) signed by ``ca``."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in dict.fromkeys((cn, *dns_names, "localhost"))]
    names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .add_extension(x509.SubjectAlternativeName(names), critical=False)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    cert = _validity(builder, days).sign(ca.key, hashes.SHA256())
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / f"{cn}.crt", folder / f"{cn}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    # NOTE: readable by all on purpose: compose bind-mounts these files into containers running
    # as uid 10001, which could not read a 0600 file of the host user. Dev secrets only.
    key_path.chmod(0o644)
    return TLSFiles(cert=str(cert_path), key=str(key_path), ca=str(ca.path))


def write_dev_secrets(folder: Path) -> str:
    """The CA, a certificate per service and an ``api-keys`` file; returns the new API key."""
    ca = make_ca(folder, "ca")
    for service in SERVICES:
        make_cert(folder, service, ca, tuple(service + t for t in TWIN_SUFFIXES) if service in MESH_TWINS else ())
    api_key = "sk-" + secrets.token_urlsafe(24)
    keys = folder / "api-keys"
    keys.write_text(f"# key tenant [min_priority]\n{api_key} default\n")
    keys.chmod(0o644)
    return api_key


def main(argv: list[str]) -> int:
    """``python -m shared.devcerts FOLDER``: writes the dev secrets there and prints the API key."""
    if len(argv) != 1:
        print("usage: python -m shared.devcerts FOLDER", file=sys.stderr)
        return 2
    key = write_dev_secrets(Path(argv[0]))
    print(f"wrote a CA, {len(SERVICES)} service certificates and api-keys to {argv[0]}")
    print(f"export KVMESH_API_KEY={key}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
