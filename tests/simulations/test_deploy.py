"""Flower's deployment engine on 127.0.0.1: TLS, SuperNode authentication, roles from
--node-config, one FIRM run, and SuperNodes without valid credentials refused.

One SuperLink and its SuperNodes serve the whole module (started once, stopped in the
fixture's finalizer, which also asserts that no process they started survives).
"""

import http.client
import json
import ssl
import time
import urllib.error
import urllib.request
from base64 import b64encode

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_public_key
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL
from flwr.proto.fleet_pb2 import ActivateNodeRequest  # pylint: disable=E0611
from flwr.supercore.date import now
from flwr.supercore.primitives.asymmetric import public_key_to_bytes, sign_message

from simulations.deploy.launch import COMPLETED, LocalDeployment, NodeSpec

pytestmark = pytest.mark.slow

SMALL_RUN = (
    "num-authors=20 retain-samples=20 eval-retain-samples=20 lora-rank=4 lora-alpha=8.0 "
    "eval-max-new-tokens=8 forget-steps=3 retain-steps=3 num-forget-clients=2"
)
# flower-supernode exits with status 1 and logs Flower's exit code 305 when refused
REFUSED = "Exit Code: 305"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
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
    nodes = {int(n["node-id"]): n["status"] for n in deployment.list_nodes()}
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
        f"model-path='{tiny_checkpoint}' {SMALL_RUN}", tmp_path / "out", timeout=240
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
    nodes = {int(n["node-id"]) for n in deployment.list_nodes()}
    assert nodes == set(declared)


def test_stop_leaves_no_process_behind(deployment, federation):
    started = [p.pid for p in deployment.started]
    assert len(deployment.tracked) > len(started)  # helpers (superexec, apps) were tracked
    assert deployment.stop() == []
    assert all(p.poll() is not None for p in deployment.started)
    context = ssl.create_default_context(cafile=deployment.certs.ca_cert)
    with pytest.raises(urllib.error.URLError) as err:
        url = f"https://127.0.0.1:{deployment.port}/health"
        urllib.request.urlopen(url, timeout=5, context=context)
    assert isinstance(err.value.reason, ConnectionRefusedError)
