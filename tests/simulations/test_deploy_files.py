"""The deployment's files and settings, without starting Flower: private keys 0600 from
creation, the CA key kept out of the SuperLink's and the nodes' folders, the bind address in
the certificate, the MPU secret kept away from the nodes and from the run config."""

import ipaddress
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from simulations.deploy.certificates import (
    make_node_folder,
    make_node_keys,
    make_server_certificates,
)
from simulations.deploy.launch import LocalDeployment, dial_address

REPO = Path(__file__).resolve().parents[2]
ENV = "FEDUNLEARN_MPU_SECRET"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_private_keys_and_their_folders_are_owner_only(tmp_path, umask_zero):
    certs = make_server_certificates(tmp_path)
    assert {p.name: _mode(p) for p in certs.ca_key.parent.iterdir()} == {
        "ca.key": 0o600,
        "ca.crt": 0o666,  # public: the umask decides
    }
    assert {p.name: _mode(p) for p in certs.server_key.parent.iterdir()} == {
        "server.key": 0o600,
        "server.pem": 0o666,
        "ca.crt": 0o666,
    }
    assert _mode(certs.ca_key.parent) == _mode(certs.server_key.parent) == 0o700
    folder = make_node_folder(tmp_path / "nodes" / "forget-0", certs.ca_cert)
    keys = make_node_keys(folder, "forget-0")
    assert _mode(folder) == 0o700 and _mode(keys.private_key) == 0o600
    # the node's folder: the CA certificate and its own key pair, no CA key
    assert sorted(p.name for p in folder.iterdir()) == ["ca.crt", "forget-0", "forget-0.pub"]
    assert (folder / "ca.crt").read_bytes() == certs.ca_cert.read_bytes()
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("ca.key")] == [Path("ca/ca.key")]


def test_existing_keys_are_never_overwritten(tmp_path):
    certs = make_server_certificates(tmp_path)
    ca_key = certs.ca_key.read_bytes()
    with pytest.raises(FileExistsError, match="ca.key already exists"):
        make_server_certificates(tmp_path)
    assert certs.ca_key.read_bytes() == ca_key
    keys = make_node_keys(tmp_path / "node", "n")
    private = keys.private_key.read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        make_node_keys(tmp_path / "node", "n")
    assert keys.private_key.read_bytes() == private


NODE_KEYS_CUT_SHORT = """
import os, resource, sys
from pathlib import Path
from simulations.deploy.certificates import make_node_keys
os.umask(0)
resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))  # writing the key fails once created
try:
    make_node_keys(Path(sys.argv[1]), "node")
except OSError as err:
    print("write failed:", err.strerror)
"""


def test_a_node_key_is_never_readable_by_others_even_while_written(tmp_path):
    """Writing the key is cut short right after the file was created: it must be 0600 (or
    gone) at that moment already; write-then-chmod would leave it 0666 under umask 0."""
    done = subprocess.run(
        [sys.executable, "-c", NODE_KEYS_CUT_SHORT, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        cwd=REPO,
    )
    assert "write failed: File too large" in done.stdout, done.stdout + done.stderr
    key = tmp_path / "node"
    assert not key.exists() or _mode(key) == 0o600


def _certificate_ips(path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}


def test_bind_address_is_an_ip_and_named_in_the_certificate(tmp_path):
    assert dial_address("127.0.0.1") == "127.0.0.1"
    assert dial_address("0.0.0.0") == "127.0.0.1"  # every interface: dialled on loopback
    assert dial_address("10.1.2.3") == "10.1.2.3"
    with pytest.raises(ValueError, match="'superlink.example' is not an IP address"):
        LocalDeployment(tmp_path / "bad", bind="superlink.example", echo=False)
    assert not (tmp_path / "bad").exists()  # refused before anything was written
    default = LocalDeployment(tmp_path / "default", echo=False)
    assert default.bind == "127.0.0.1"
    assert _certificate_ips(default.certs.server_cert) == {"127.0.0.1"}
    other = LocalDeployment(
        tmp_path / "other", bind="10.1.2.3", cert_ips=("192.0.2.7",), echo=False
    )
    assert _certificate_ips(other.certs.server_cert) == {"127.0.0.1", "10.1.2.3", "192.0.2.7"}
    assert all(ipaddress.ip_address(ip) for ip in _certificate_ips(other.certs.server_cert))


def test_the_mpu_secret_variable_reaches_the_superlink_only(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "env-secret-4711")
    deployment = LocalDeployment(tmp_path, echo=False)
    assert deployment.superlink_env[ENV] == "env-secret-4711"
    assert ENV not in deployment.env  # SuperNodes and flwr commands run without it


def test_inline_mpu_secret_is_refused_before_anything_starts(tmp_path):
    deployment = LocalDeployment(tmp_path, echo=False)
    deployment.port = 1  # as if started: the refusal must come before any process
    with pytest.raises(ValueError, match="'mpu.secret' is refused.*mpu.secret-file"):
        deployment.run_app("wrapper='mpu' mpu.secret='do-not-leak-4711'", tmp_path / "out")
    loose = tmp_path / "secret"
    loose.write_text("s3cret")
    loose.chmod(0o644)
    with pytest.raises(ValueError, match="has mode 0644"):
        deployment.run_app(f"wrapper='mpu' mpu.secret-file='{loose}'", tmp_path / "out")
    assert deployment.processes.started == []
