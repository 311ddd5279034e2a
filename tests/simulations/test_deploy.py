"""Flower's deployment engine on 127.0.0.1: TLS, SuperNode authentication, roles from
--node-config, one FIRM run, SuperNodes without valid credentials refused; the SuperLink on
loopback only, each node given only ca.crt and its own keys, the MPU secret on no command
line; and what node authentication does not stop (docs/deployment.md's account of it).

One SuperLink and its SuperNodes serve the whole module (started once, stopped in the
fixture's finalizer, which also asserts that no process they started survives).
"""

import http.client
import ipaddress
import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_public_key
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL
from flwr.proto.control_pb2 import ListRunsRequest, ListRunsResponse  # pylint: disable=E0611
from flwr.proto.fleet_pb2 import ActivateNodeRequest  # pylint: disable=E0611
from flwr.supercore.date import now
from flwr.supercore.primitives.asymmetric import public_key_to_bytes, sign_message

from simulations.deploy.certificates import make_node_keys
from simulations.deploy.launch import COMPLETED, LocalDeployment, NodeSpec
from simulations.run_local import BIN_DIR, flower_env
from strategies.checkpoint import CheckpointError, RunCheckpoint
from strategies.secret_files import write_private_file

pytestmark = pytest.mark.slow

SMALL_RUN = (
    "scenario.num-authors=20 scenario.retain-samples=20 scenario.num-forget-clients=2 "
    "eval.retain-samples=20 eval.max-new-tokens=8 lora.rank=4 lora.alpha=8.0 "
    "training.forget-steps=3 training.retain-steps=3"
)
# flower-supernode exits with status 1 and logs Flower's exit code 305 when refused
REFUSED = "Exit Code: 305"
SECRET_VAR = "FEDUNLEARN_MPU_SECRET"
ENV_SECRET = f"env-secret-{secrets.token_hex(8)}"  # set for the launcher: SuperLink only


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv(SECRET_VAR, ENV_SECRET)
        deployment = LocalDeployment(tmp_path_factory.mktemp("deploy"), echo=False)
    yield deployment
    survivors = deployment.stop()
    assert survivors == [], f"processes still running after stop: {survivors}"


@pytest.fixture(scope="module")
def federation(deployment):
    """3 registered SuperNodes (2 forget + 1 retain) and 2 intruders, on a TLS SuperLink.

    Roles and partition ids are chosen against the sorted node ids, so that the old
    sorted-order assignment would give different roles and shards.
    """
    deployment.start_superlink()
    credentials = [deployment.node_credentials(f"member-{i}") for i in range(3)]
    credentials.sort(key=lambda c: c[1])
    low, mid, high = credentials
    configs = {  # sorted order would make `low` the first forget client and `high` retain
        "retain-0": (low, "role='retain' partition-id=2"),
        "forget-1": (mid, "role='forget' partition-id=1"),
        "forget-0": (high, "role='forget' partition-id=0"),
    }
    members = {
        name: deployment.start_node(NodeSpec(name, config), creds)
        for name, (creds, config) in configs.items()
    }
    intruders = {
        # a key pair the SuperLink never registered
        "unregistered": deployment.start_node(
            NodeSpec("unregistered", "role='forget' partition-id=5", register=False)
        ),
        # no key at all
        "no-key": deployment.start_node(
            NodeSpec("no-key", "role='retain' partition-id=6", with_key=False)
        ),
    }
    deployment.wait_online(list(members.values()))
    deadline = time.monotonic() + 60
    while any(n.process.poll() is None for n in intruders.values()):
        assert time.monotonic() < deadline, "an unauthenticated SuperNode is still running"
        time.sleep(0.5)
    return members, intruders


def test_supernodes_without_valid_credentials_are_refused(deployment, federation):
    members, intruders = federation
    unregistered, no_key = intruders["unregistered"], intruders["no-key"]
    assert unregistered.process.returncode == no_key.process.returncode == 1
    log = unregistered.log_file.read_text()
    assert REFUSED in log and "[code: 2004] Failed to activate SuperNode" in log
    log = no_key.log_file.read_text()
    assert REFUSED in log and "[code: 2001] SuperNode authentication is enabled" in log
    # the SuperLink refused the unregistered key by name
    key = load_ssh_public_key(unregistered.keys.public_key.read_bytes())
    pem = public_key_to_bytes(key).decode().replace("\n", "\\n")
    refusals = [
        line
        for line in (deployment.logs / "superlink.log").read_text().splitlines()
        if "ApiError:2004" in line and "No SuperNode found" in line
    ]
    assert any(pem in line for line in refusals), refusals
    # only the registered nodes are known, and they are online
    nodes = {int(n["node-id"]): n["status"] for n in deployment.flwr.list_nodes()}
    assert nodes == {m.node_id: "online" for m in members.values()}


def _activate(deployment, public_key: bytes, signing_key: ec.EllipticCurvePrivateKey) -> int:
    """A hand-made Fleet ActivateNode call, signed like flower-supernode signs; HTTP status."""
    timestamp = now().isoformat()
    headers = {
        "content-type": "application/protobuf",
        "flwr-public-key": b64encode(public_key).decode(),
        "flwr-timestamp": timestamp,
        "flwr-signature": b64encode(sign_message(signing_key, timestamp.encode())).decode(),
    }
    body = ActivateNodeRequest(public_key=public_key, heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL)
    with httpx.Client(verify=ssl.create_default_context(cafile=deployment.certs.ca_cert)) as http:
        response = http.post(
            f"https://127.0.0.1:{deployment.port}/v1/fleet/activate-node",
            content=body.SerializeToString(),
            headers=headers,
        )
    return response.status_code


def test_impersonating_a_registered_node_with_a_wrong_key_is_rejected(deployment, federation):
    members, _ = federation
    victim = load_ssh_public_key(members["forget-0"].keys.public_key.read_bytes())
    attacker = ec.generate_private_key(ec.SECP384R1())
    # the victim's public key, signed with another private key: authentication fails
    assert _activate(deployment, public_key_to_bytes(victim), attacker) == 401
    # control: correctly signed, so it passes authentication, but the key is not registered
    own = public_key_to_bytes(attacker.public_key())
    assert _activate(deployment, own, attacker) == 412


def test_superlink_speaks_tls_only(deployment, federation):
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(f"http://127.0.0.1:{deployment.port}/health", timeout=5)
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(
            f"https://127.0.0.1:{deployment.port}/health",
            timeout=5,
            context=ssl.create_default_context(),  # the system CAs do not know ours
        )


def test_firm_run_takes_roles_from_node_config(deployment, federation, tiny_checkpoint, tmp_path):
    members, _ = federation
    outcome = deployment.run_app(
        f"model.path='{tiny_checkpoint}' {SMALL_RUN}", tmp_path / "out", timeout=240
    )
    assert outcome.status == COMPLETED, "\n".join(outcome.output[-40:])
    assert outcome.results.is_file() and outcome.ok
    results = json.loads(outcome.results.read_text())
    declared = {m.node_id: m.node_config["role"] for m in members.values()}
    clients = {c["node_id"]: c for c in results["clients"]}
    assert {n: c["role"] for n, c in clients.items()} == declared
    assert all("excluded" not in c and c["task_vector_norm"] > 0 for c in clients.values())
    # partition-id orders the forget shards: forget-0 holds the scenario's first one
    forget = [a for a in results["assignments"] if a["role"] == "forget"]
    assert [a["node_id"] for a in forget] == [
        members["forget-0"].node_id,
        members["forget-1"].node_id,
    ]
    assert results["merge"]["norm_final"] > 0
    # the run went through the registered nodes only
    nodes = {int(n["node-id"]) for n in deployment.flwr.list_nodes()}
    assert nodes == set(declared)


def _socket_inodes(pids) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def _address(hex_address: str) -> tuple[str, int]:
    """An address of /proc/net/tcp{,6} (little-endian 32-bit words) as (ip, port)."""
    ip_hex, port_hex = hex_address.split(":")
    raw = b"".join(bytes.fromhex(ip_hex[i : i + 8])[::-1] for i in range(0, len(ip_hex), 8))
    return str(ipaddress.ip_address(raw)), int(port_hex, 16)


def listening(pids) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket the processes ``pids`` listen on (from /proc/net)."""
    inodes = _socket_inodes(pids)
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                found.add(_address(cols[1]))
    return found


def test_superlink_listens_on_loopback_only(deployment, federation):
    superlink = deployment.superlink.pid
    assert listening([superlink]) == {("127.0.0.1", deployment.port)}
    # nothing this deployment started listens beyond loopback (SuperNodes' ClientApp APIs)
    everything = listening(deployment.processes.tracked)
    assert len(everything) > 1 and {ip for ip, _ in everything} == {"127.0.0.1"}


def test_superlink_listens_on_the_address_asked_for(tmp_path):
    with LocalDeployment(tmp_path, bind="127.0.0.2", echo=False) as other:
        port = other.start_superlink()  # healthy over TLS on 127.0.0.2: the cert names it
        assert listening([other.superlink.pid]) == {("127.0.0.2", port)}
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
    assert other.processes.survivors() == []


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def test_nodes_hold_only_the_ca_certificate_and_their_own_keys(deployment, federation):
    members, intruders = federation
    certs = deployment.certs
    for node in [*members.values(), *intruders.values()]:
        keys = {node.keys.private_key.name, node.keys.public_key.name} if node.keys else set()
        wanted = {"ca.crt"} | keys
        assert {p.name for p in node.folder.iterdir()} == wanted
        assert node.folder.stat().st_mode & 0o777 == 0o700
        if node.keys:
            assert node.keys.private_key.stat().st_mode & 0o777 == 0o600
    for node in members.values():  # what the running SuperNode was pointed at
        args = _cmdline(node.process.pid)
        used = [args[args.index(flag) + 1] for flag in ("--root-certificates",
                "--auth-supernode-private-key")]  # fmt: skip
        assert {Path(a).parent for a in used} == {node.folder}
    # the CA key exists once, in the operator's ca/ folder (0600 in a 0700 folder)
    assert list(deployment.workdir.rglob("ca.key")) == [certs.ca_key]
    assert certs.ca_key.stat().st_mode & 0o777 == 0o600
    assert certs.ca_key.parent.stat().st_mode & 0o777 == 0o700
    assert certs.server_key.stat().st_mode & 0o777 == 0o600
    assert "ca.key" not in {p.name for p in certs.server_key.parent.iterdir()}


class CommandLineWatch:
    """Every distinct command line on this machine, read from /proc while a run goes on."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            for name in os.listdir("/proc"):
                if name.isdigit():
                    try:
                        self.seen.add(" ".join(_cmdline(int(name))))
                    except OSError:
                        pass
            time.sleep(0.1)

    def __enter__(self) -> "CommandLineWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _run_records(deployment) -> bytes:
    """The SuperLink's run records as any client reaching the port gets them (no CA even)."""
    with httpx.Client(verify=False) as http:
        response = http.post(
            f"https://127.0.0.1:{deployment.port}/v1/control/list-runs",
            content=ListRunsRequest().SerializeToString(),
            headers={"content-type": "application/protobuf"},
        )
    assert response.status_code == 200
    return response.content


def test_mpu_secret_is_on_no_command_line_and_in_no_run_record(
    deployment, federation, tiny_checkpoint, tmp_path
):
    members, _ = federation
    file_secret = f"file-secret-{secrets.token_hex(8)}"
    secret_file = write_private_file(tmp_path / "mpu-secret", file_secret.encode())
    out = tmp_path / "out"
    run_config = (
        f"model.path='{tiny_checkpoint}' wrapper='mpu' mpu.secret-file='{secret_file}' {SMALL_RUN}"
    )
    with CommandLineWatch() as watch:
        outcome = deployment.run_app(run_config, out, timeout=300)
    assert outcome.status == COMPLETED, "\n".join(outcome.output[-40:])
    # the watch saw the run's processes ...
    assert any("flwr-serverapp" in c for c in watch.seen), sorted(watch.seen)
    assert any("flwr-clientapp" in c for c in watch.seen)
    assert any(str(secret_file) in c for c in watch.seen)  # the path, not the secret
    # ... and no command line held either secret
    leaks = [c for c in watch.seen if file_secret in c or ENV_SECRET in c]
    assert leaks == []
    records = _run_records(deployment)
    assert b"mpu.secret-file" in records
    assert file_secret.encode() not in records and ENV_SECRET.encode() not in records
    assert file_secret not in outcome.results.read_text()
    # the run used the file's secret (the file wins over the variable) ...
    stored = RunCheckpoint(out / "checkpoint", "")
    assert stored.secret_path.is_file()
    assert stored.mpu_secret(file_secret) == file_secret.encode()
    with pytest.raises(CheckpointError, match="another MPU secret"):
        stored.mpu_secret(ENV_SECRET)
    # ... and the variable reached the SuperLink, not the SuperNodes
    environ = Path(f"/proc/{deployment.superlink.pid}/environ").read_bytes()
    assert f"{SECRET_VAR}={ENV_SECRET}".encode() in environ.split(b"\0")
    for node in members.values():
        assert SECRET_VAR.encode() not in Path(f"/proc/{node.process.pid}/environ").read_bytes()


OUTSIDER_APP = {
    "pyproject.toml": """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "outsider"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "outsider"

[tool.flwr.app.components]
serverapp = "outsider_app:server"
clientapp = "outsider_app:client"

[tool.flwr.app.config]
marker = "MARKER"
""",
    "outsider_app.py": """
import os
from pathlib import Path

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

server = ServerApp()
client = ClientApp()


@server.main()
def main(grid, context):
    nodes = sorted(grid.get_node_ids())
    query = [
        Message(RecordDict({"q": ConfigRecord({})}), dst_node_id=n, message_type="query")
        for n in nodes
    ]
    replies = list(grid.send_and_receive(query, timeout=120))
    seen = sorted(r.content["a"]["role"] for r in replies if r.has_content())
    Path(context.run_config["marker"]).write_text(f"{os.getpid()} {nodes} {seen}")


@client.query()
def answer(msg, context):
    role = str(context.node_config.get("role", ""))
    return Message(RecordDict({"a": ConfigRecord({"role": role})}), reply_to=msg)
""",
}


def test_node_auth_does_not_guard_the_control_api(deployment, federation, tmp_path):
    """What docs/deployment.md says node authentication does not stop: a client holding only ca.crt
    runs its own app on the SuperLink's host and on every SuperNode, registers its own node
    key and lists the runs (Flower's Control API has no authentication here)."""
    members, _ = federation
    home = tmp_path / "outsider"
    home.mkdir()
    shutil.copy(deployment.certs.ca_cert, home / "ca.crt")  # nothing else of the operator's
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "them"\n\n[superlink.them]\n'
        f'address = "127.0.0.1:{deployment.port}"\nroot-certificates = "{home / "ca.crt"}"\n'
    )
    env = dict(flower_env(home), COLUMNS="400")

    def flwr(*args: str, cwd: Path = tmp_path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN_DIR / "flwr"), *args], env=env, cwd=cwd, capture_output=True, text=True,
            timeout=240, check=False, start_new_session=True,
        )  # fmt: skip

    app = tmp_path / "app"
    app.mkdir()
    for name, text in OUTSIDER_APP.items():
        (app / name).write_text(text)
    marker = tmp_path / "outsider-ran"
    done = flwr("run", str(app), "them", "--stream", "--run-config", f"marker='{marker}'")
    assert marker.is_file(), done.stdout + done.stderr
    # its ServerApp saw the federation's nodes, and its ClientApp ran on each of them
    members_ids = sorted(m.node_id for m in members.values())
    assert marker.read_text().split(" ", 1)[1] == f"{members_ids} {['forget', 'forget', 'retain']}"
    keys = make_node_keys(home / "keys", "outsider")
    done = flwr("supernode", "register", str(keys.public_key), "them", "--format", "json")
    node_id = int(json.loads(done.stdout[done.stdout.index("{") :])["node-id"])
    listed = {int(n["node-id"]): n["status"] for n in deployment.flwr.list_nodes()}
    assert listed[node_id] == "registered"
    done = flwr("ls", "them", "--format", "json")
    runs = {int(r["run-id"]) for r in json.loads(done.stdout[done.stdout.index("{") :])["runs"]}
    assert runs == set(deployment.flwr.run_ids()) and runs
    assert ListRunsResponse.FromString(_run_records(deployment)).run_dict  # without ca.crt
    done = flwr("supernode", "unregister", str(node_id), "them")
    assert done.returncode == 0, done.stdout + done.stderr
    listed = {int(n["node-id"]): n["status"] for n in deployment.flwr.list_nodes()}
    assert listed.get(node_id, "unregistered") == "unregistered"


def test_stop_leaves_no_process_behind(deployment, federation):
    started = [p.pid for p in deployment.processes.started]
    assert len(deployment.processes.tracked) > len(
        started
    )  # helpers (superexec, apps) were tracked
    assert deployment.stop() == []
    assert all(p.poll() is not None for p in deployment.processes.started)
    context = ssl.create_default_context(cafile=deployment.certs.ca_cert)
    with pytest.raises(urllib.error.URLError) as err:
        url = f"https://127.0.0.1:{deployment.port}/health"
        urllib.request.urlopen(url, timeout=5, context=context)
    assert isinstance(err.value.reason, ConnectionRefusedError)
