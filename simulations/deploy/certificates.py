"""TLS certificates for a SuperLink and authentication keys for SuperNodes.

Makes, with the ``cryptography`` package (a Flower dependency, so always installed):

* ``ca.crt`` / ``ca.key``: a self-signed certificate authority. SuperNodes and the ``flwr``
  CLI trust ``ca.crt`` (``--root-certificates`` / ``root-certificates``).
* ``server.pem`` / ``server.key``: the SuperLink's certificate, signed by the CA, valid for
  the given host names and IP addresses (default ``localhost`` and ``127.0.0.1``).
* per SuperNode (``--node NAME``): ``NAME`` (EC P-384 private key, OpenSSH format, for
  ``flower-supernode --auth-supernode-private-key``) and ``NAME.pub`` (its public key, for
  ``flwr supernode register``).

    python -m simulations.deploy.certificates certs/ --host superlink.example.org \
        --ip 10.0.0.5 --node node-0 --node node-1
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost",)
DEFAULT_IPS = ("127.0.0.1",)


@dataclass(frozen=True)
class ServerCertificates:
    """Paths of the files a TLS SuperLink and its clients need."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class NodeKeys:
    """A SuperNode's authentication key pair (OpenSSH-format EC P-384)."""

    private_key: Path
    public_key: Path


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedunlearn"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def make_server_certificates(
    folder: Path,
    hosts: tuple[str, ...] = DEFAULT_HOSTS,
    ips: tuple[str, ...] = DEFAULT_IPS,
    days: int = 365,
) -> ServerCertificates:
    """Write a CA and a SuperLink certificate for ``hosts`` / ``ips`` into ``folder``."""
    folder = Path(folder)
    now = datetime.datetime.now(datetime.UTC)
    not_before = now - datetime.timedelta(minutes=5)  # tolerate small clock skew
    not_after = now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = _name("fedunlearn test CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )

    server_key = ec.generate_private_key(ec.SECP384R1())
    names: list[x509.GeneralName] = [x509.DNSName(h) for h in hosts]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0] if hosts else ips[0]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )

    pem = serialization.Encoding.PEM
    unencrypted = serialization.NoEncryption()
    pkcs8 = serialization.PrivateFormat.PKCS8
    out = ServerCertificates(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    _write(out.ca_cert, ca_cert.public_bytes(pem))
    _write(folder / "ca.key", ca_key.private_bytes(pem, pkcs8, unencrypted), private=True)
    _write(out.server_cert, server_cert.public_bytes(pem))
    _write(out.server_key, server_key.private_bytes(pem, pkcs8, unencrypted), private=True)
    return out


def make_node_keys(folder: Path, name: str) -> NodeKeys:
    """Write a SuperNode key pair ``folder/name`` (private) and ``folder/name.pub``."""
    key = ec.generate_private_key(ec.SECP384R1())
    out = NodeKeys(Path(folder) / name, Path(folder) / f"{name}.pub")
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    _write(out.private_key, private, private=True)
    _write(out.public_key, public + f" {name}\n".encode())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where the files are written")
    parser.add_argument(
        "--host", action="append", default=None, help="DNS name of the SuperLink (repeatable)"
    )
    parser.add_argument(
        "--ip", action="append", default=None, help="IP address of the SuperLink (repeatable)"
    )
    parser.add_argument(
        "--node", action="append", default=[], help="make a SuperNode key pair NAME (repeatable)"
    )
    parser.add_argument("--days", type=int, default=365, help="certificate validity")
    args = parser.parse_args(argv)
    hosts = tuple(args.host) if args.host else DEFAULT_HOSTS
    ips = tuple(args.ip) if args.ip else (DEFAULT_IPS if args.host is None else ())
    certs = make_server_certificates(args.folder, hosts, ips, args.days)
    print(f"CA certificate:     {certs.ca_cert}")
    print(f"server certificate: {certs.server_cert} ({', '.join(hosts + ips)})")
    print(f"server key:         {certs.server_key}")
    for name in args.node:
        keys = make_node_keys(args.folder / "nodes", name)
        print(f"SuperNode {name}: {keys.private_key} (private), {keys.public_key} (register)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
