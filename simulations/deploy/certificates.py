"""TLS certificates for a SuperLink and authentication keys for SuperNodes.

Makes, with the ``cryptography`` package (a Flower dependency, so always installed), one
folder per party, so that each machine gets only what it needs:

* ``ca/``: ``ca.key`` (the certificate authority's private key) and ``ca.crt`` (its
  self-signed certificate). Only the operator keeps this folder, off the SuperLink and the
  nodes: whoever holds ``ca.key`` can issue a certificate the nodes accept as the SuperLink.
* ``superlink/``: ``server.pem`` / ``server.key`` (the SuperLink's certificate, signed by the
  CA, valid for the given host names and IP addresses; default ``localhost`` and
  ``127.0.0.1``) and ``ca.crt``.
* ``nodes/NAME/`` per SuperNode (``--node NAME``): ``ca.crt`` (for ``--root-certificates``),
  ``NAME`` (EC P-384 private key, OpenSSH format, for ``flower-supernode
  --auth-supernode-private-key``) and ``NAME.pub`` (its public key, for ``flwr supernode
  register``).

Private keys are created with mode 0600 (the ``open`` that creates them sets it, whatever the
umask) in folders created 0700, and an existing file is never overwritten.

    python -m simulations.deploy.certificates certs/ --host superlink.example.org \
        --ip 10.0.0.5 --node node-0 --node node-1
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from strategies.secret_files import make_private_dir, write_private_file

DEFAULT_HOSTS = ("localhost",)
DEFAULT_IPS = ("127.0.0.1",)


@dataclass(frozen=True)
class ServerCertificates:
    """Paths of the CA's files (``ca/``, the operator's) and the SuperLink's (``superlink/``)."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path

    @property
    def superlink_ca_cert(self) -> Path:
        """The copy of ``ca.crt`` in the SuperLink's folder."""
        return self.server_cert.parent / "ca.crt"


@dataclass(frozen=True)
class NodeKeys:
    """A SuperNode's authentication key pair (OpenSSH-format EC P-384)."""

    private_key: Path
    public_key: Path


def _write_public(path: Path, data: bytes) -> None:
    """Write a certificate or public key; like the private files, never over an existing one."""
    try:
        with open(path, "xb") as out:
            out.write(data)
    except FileExistsError:
        raise FileExistsError(f"{path} already exists; it is not overwritten") from None


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
    """Write a CA into ``folder/ca`` and a SuperLink certificate for ``hosts`` / ``ips`` into
    ``folder/superlink`` (see the module docstring)."""
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
    ca_dir = make_private_dir(folder / "ca")
    server_dir = make_private_dir(folder / "superlink")
    out = ServerCertificates(
        ca_dir / "ca.crt", ca_dir / "ca.key", server_dir / "server.pem", server_dir / "server.key"
    )
    write_private_file(out.ca_key, ca_key.private_bytes(pem, pkcs8, unencrypted))
    _write_public(out.ca_cert, ca_cert.public_bytes(pem))
    write_private_file(out.server_key, server_key.private_bytes(pem, pkcs8, unencrypted))
    _write_public(out.server_cert, server_cert.public_bytes(pem))
    _write_public(out.superlink_ca_cert, ca_cert.public_bytes(pem))
    return out


def make_node_folder(folder: Path, ca_cert: Path) -> Path:
    """A SuperNode's own folder (0700) holding a copy of ``ca_cert`` as ``ca.crt`` (and, once
    :func:`make_node_keys` wrote them, its key pair): all a node machine needs, no CA key."""
    folder = make_private_dir(Path(folder))
    if not (folder / "ca.crt").exists():
        _write_public(folder / "ca.crt", Path(ca_cert).read_bytes())
    return folder


def make_node_keys(folder: Path, name: str) -> NodeKeys:
    """Write a SuperNode key pair ``folder/name`` (private, 0600) and ``folder/name.pub``."""
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
    make_private_dir(Path(folder))
    write_private_file(out.private_key, private)
    _write_public(out.public_key, public + f" {name}\n".encode())
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
    try:
        certs = make_server_certificates(args.folder, hosts, ips, args.days)
        print(f"CA (keep it with the operator, off the SuperLink and nodes): {certs.ca_key.parent}")
        print(f"SuperLink ({', '.join(hosts + ips)}): {certs.server_cert.parent}")
        for name in args.node:
            folder = make_node_folder(args.folder / "nodes" / name, certs.ca_cert)
            keys = make_node_keys(folder, name)
            print(f"SuperNode {name}: {folder} (register {keys.public_key})")
    except FileExistsError as err:
        print(f"error: {err}; choose an empty folder", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
