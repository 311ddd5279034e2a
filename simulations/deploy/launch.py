"""Run fedunlearn on Flower's deployment engine on this machine: TLS and authenticated nodes.

Makes a CA (kept in ``certs/ca/``, never handed to a node) and a SuperLink certificate for
127.0.0.1 / localhost (and the ``--bind`` address), starts a SuperLink listening on
``--bind`` only (default 127.0.0.1: its single port serves the Fleet API *and* Flower's
Control API, which has no authentication in OSS Flower — see docs/deployment.md) with TLS and
SuperNode authentication (``--enable-supernode-auth``), registers one key pair per
SuperNode (``flwr supernode register``), starts each SuperNode with its own
``--node-config`` (``role``, ``partition-id``, optionally its local ``data-path``), waits
until they are online, submits the app with ``flwr run . <connection> --stream`` through a
TLS connection written to a private ``FLWR_HOME``, and checks that the run finished
completed and wrote ``results.json``. Every process it starts runs in its own session and is
stopped by PID (SIGTERM, then SIGKILL) when it ends, also on failure.

Each SuperNode gets its own folder ``certs/nodes/NAME/`` (0700): ``ca.crt`` and its own key
pair, nothing else. Private keys are 0600 from creation. ``$FEDUNLEARN_MPU_SECRET``, when
set, reaches the SuperLink (and so the ServerApp) only, through its environment, never a
command line; SuperNodes and ``flwr`` commands run without it. The MPU secret is never put in
a run config: use ``mpu.secret-file`` (a 0600 file) or that variable.

    python -m simulations.deploy.launch --run-config "model.path='/abs/ckpt'" \
        --node "role='forget' partition-id=0" --node "role='forget' partition-id=1" \
        --node "role='retain' partition-id=2 data-path='/data/retain'"

Without ``--node``, the scenario's clients are started: forget nodes (partition-id 0, 1,
...) then retain nodes.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from fedunlearn.mpu.keys import DEFAULT_SECRET_ENV_VAR
from simulations.app_bundle import stage_app
from simulations.deploy.certificates import (
    DEFAULT_HOSTS,
    DEFAULT_IPS,
    NodeKeys,
    ServerCertificates,
    make_node_folder,
    make_node_keys,
    make_server_certificates,
)
from simulations.deploy.cli import CONNECTION, DeploymentError, FlwrCli, write_connection
from simulations.deploy.processes import ProcessGroup
from simulations.run_local import (
    BIN_DIR,
    REPO_ROOT,
    default_cache_dir,
    flower_env,
    free_port,
    parse_config_pairs,
    plan_run,
    prepare_substrate,
    run_settings,
    stop_process,
)
from strategies.secret_files import check_secret_keys

COMPLETED = "finished:completed"
LOOPBACK = "127.0.0.1"
# a SuperLink bound to every interface is dialled here through the loopback interface
WILDCARD_DIAL = {"0.0.0.0": "127.0.0.1", "::": "::1"}


@dataclass
class NodeSpec:
    """One SuperNode to start.

    ``register=False`` starts it with a key pair the SuperLink never saw (it must be refused);
    ``with_key=False`` starts it without any key (``--auth-supernode-private-key`` absent).
    """

    name: str
    node_config: str
    register: bool = True
    with_key: bool = True


@dataclass
class StartedNode:
    """A SuperNode process this deployment started."""

    spec: NodeSpec
    process: subprocess.Popen
    log_file: Path
    keys: NodeKeys | None
    node_id: int | None  # from the registration; None when not registered
    folder: Path  # all this node was given: ca.crt and its own key pair

    @property
    def node_config(self) -> dict:
        return parse_config_pairs(self.spec.node_config)


@dataclass
class RunOutcome:
    """What ``flwr run`` left behind."""

    run_id: int | None
    status: str
    results: Path
    returncode: int
    output: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == COMPLETED and self.results.is_file()


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def dial_address(bind: str) -> str:
    """The address local clients dial for a SuperLink bound to ``bind`` (an IP address)."""
    try:
        ipaddress.ip_address(bind)
    except ValueError:
        raise ValueError(f"bind address {bind!r} is not an IP address") from None
    return WILDCARD_DIAL.get(bind, bind)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def superlink_command(
    certs: ServerCertificates, node_auth: bool, bind: str, port: int
) -> list[str]:
    """``flower-superlink`` with TLS (and SuperNode authentication), in-memory state."""
    return [
        str(BIN_DIR / "flower-superlink"),
        "--ssl-ca-certfile", str(certs.superlink_ca_cert),
        "--ssl-certfile", str(certs.server_cert),
        "--ssl-keyfile", str(certs.server_key),
        *(["--enable-supernode-auth"] if node_auth else []),
        "--isolation", "subprocess",
        "--disable-runtime-dependency-installation",
        "--host", bind,
        "--port", str(port),
        "--database", ":flwr-in-memory:",
    ]  # fmt: skip


def supernode_command(
    superlink: str, ca_cert: Path, keys: NodeKeys | None, node_config: str
) -> list[str]:
    """``flower-supernode`` dialling ``superlink`` over TLS, authenticated by ``keys``."""
    return [
        str(BIN_DIR / "flower-supernode"),
        "--superlink", superlink,
        "--root-certificates", str(ca_cert),
        *(["--auth-supernode-private-key", str(keys.private_key)] if keys else []),
        "--node-config", node_config,
        "--isolation", "subprocess",
        "--host", "127.0.0.1",
        "--port", str(free_port()),
    ]  # fmt: skip


def wait_healthy(
    superlink: subprocess.Popen, address: str, ca_cert: Path, log_file: Path, timeout: float
) -> None:
    """Wait until the SuperLink at ``address`` answers its health check over TLS."""
    context = ssl.create_default_context(cafile=str(ca_cert))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if superlink.poll() is not None:
            raise DeploymentError(
                f"flower-superlink exited with {superlink.returncode}:\n" + _tail(log_file)
            )
        try:
            url = f"https://{address}/health"
            with urllib.request.urlopen(url, timeout=2, context=context) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise DeploymentError(f"the SuperLink was not healthy within {timeout:.0f} s; see {log_file}")


class LocalDeployment:
    """A SuperLink (TLS, optional SuperNode authentication) and SuperNodes on this machine.

    The SuperLink listens on ``bind`` only (default 127.0.0.1; "0.0.0.0" = every interface);
    its certificate names localhost, 127.0.0.1, the bind address and ``cert_hosts`` /
    ``cert_ips`` (the names remote nodes dial). Use as a context manager (or call
    :meth:`stop`): every process it started, with the processes those started, is stopped by
    PID on exit.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        node_auth: bool = True,
        cache_dir: Path | None = None,
        echo: bool = True,
        bind: str = LOOPBACK,
        cert_hosts: Sequence[str] = (),
        cert_ips: Sequence[str] = (),
    ) -> None:
        self.bind = bind
        self.address = dial_address(bind)  # raises before anything is written
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs = self.workdir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.node_auth = node_auth
        self.echo = echo
        ips = dict.fromkeys([*DEFAULT_IPS, self.address, *cert_ips])  # unique, in order
        hosts = dict.fromkeys([*DEFAULT_HOSTS, *cert_hosts])
        self.certs = make_server_certificates(self.workdir / "certs", tuple(hosts), tuple(ips))
        self.flwr_home = self.workdir / "flwr_home"  # the flwr CLI's private config
        self.flwr_home.mkdir(exist_ok=True)
        self.cache_dir = (cache_dir or default_cache_dir()).resolve()
        self.env = flower_env(self.flwr_home)
        self.env["FEDUNLEARN_CACHE_DIR"] = str(self.cache_dir)
        self.env["COLUMNS"] = "400"  # the CLI's JSON output must not wrap
        # the MPU secret goes to the SuperLink (the ServerApp) only, never to nodes or the CLI
        secret = self.env.pop(DEFAULT_SECRET_ENV_VAR, None)
        self.superlink_env = dict(self.env, FLWR_HOME=str(self.workdir / "superlink_home"))
        if secret:
            self.superlink_env[DEFAULT_SECRET_ENV_VAR] = secret
        self.port: int | None = None
        self.superlink: subprocess.Popen | None = None
        self.nodes: list[StartedNode] = []
        self.processes = ProcessGroup()
        self.flwr = FlwrCli(self.env)

    # lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self, grace: float = 15.0) -> list[int]:
        """Stop every process this deployment started (:class:`ProcessGroup`); the survivors."""
        return self.processes.stop(grace)

    # SuperLink ----------------------------------------------------------------------------

    def start_superlink(self, timeout: float = 90.0) -> int:
        """Start the SuperLink with TLS (and node auth) on ``bind``; its port once healthy."""
        self.port = free_port()
        command = superlink_command(self.certs, self.node_auth, self.bind, self.port)
        log_file = self.logs / "superlink.log"
        self.superlink = self.processes.popen(
            command, log_file, env=self.superlink_env, cwd=self.workdir
        )
        address = host_port(self.address, self.port)
        write_connection(self.flwr_home, address, self.certs.ca_cert)
        wait_healthy(self.superlink, address, self.certs.ca_cert, log_file, timeout)
        self.processes.track()
        return self.port

    # SuperNodes ---------------------------------------------------------------------------

    def node_folder(self, name: str) -> Path:
        """SuperNode ``name``'s own folder (0700): ``ca.crt`` and, once made, its key pair."""
        return make_node_folder(self.workdir / "certs" / "nodes" / name, self.certs.ca_cert)

    def node_credentials(self, name: str, register: bool = True) -> tuple[NodeKeys, int | None]:
        """A fresh key pair for SuperNode ``name``, registered (node id) unless told not to."""
        if self.port is None:
            raise DeploymentError("start the SuperLink first")
        keys = make_node_keys(self.node_folder(name), name)
        node_id = self.flwr.register(keys, name) if register and self.node_auth else None
        return keys, node_id

    def start_node(
        self,
        spec: NodeSpec,
        credentials: tuple[NodeKeys, int | None] | None = None,
    ) -> StartedNode:
        """Start a SuperNode; makes and registers its key pair unless ``credentials`` given.

        ``credentials``: ``(keys, node id)`` from :meth:`node_credentials` (register first,
        choose the node config knowing the node id).
        """
        if self.port is None:
            raise DeploymentError("start the SuperLink first")
        parse_config_pairs(spec.node_config)  # errors here, not in the node's log
        keys, node_id = None, None
        if credentials is not None:
            keys, node_id = credentials
        elif spec.with_key:
            keys, node_id = self.node_credentials(spec.name, spec.register)
        home = self.workdir / "nodes" / spec.name
        home.mkdir(parents=True, exist_ok=True)
        # the folder its credentials were made in (they may have been made under another name)
        folder = keys.private_key.parent if keys is not None else self.node_folder(spec.name)
        superlink = host_port(self.address, self.port)
        command = supernode_command(superlink, folder / "ca.crt", keys, spec.node_config)
        log_name = f"supernode-{spec.name}.log"
        env = dict(self.env, FLWR_HOME=str(home))
        process = self.processes.popen(command, self.logs / log_name, env=env, cwd=home)
        node = StartedNode(spec, process, self.logs / log_name, keys, node_id, folder)
        self.nodes.append(node)
        return node

    def wait_online(self, nodes: Sequence[StartedNode], timeout: float = 120.0) -> None:
        """Wait until the SuperLink lists every node in ``nodes`` as online."""
        wanted = {n.node_id for n in nodes if n.node_id is not None}
        # without node auth, nodes register themselves: count them instead
        count = len(wanted) if self.node_auth else len(nodes)
        deadline = time.monotonic() + timeout
        while True:
            for node in nodes:
                if node.process.poll() is not None:
                    raise DeploymentError(
                        f"SuperNode {node.spec.name} exited with {node.process.returncode}:\n"
                        + _tail(node.log_file)
                    )
            nodes_now = self.flwr.list_nodes()
            online = {int(n["node-id"]) for n in nodes_now if n.get("status") == "online"}
            self.processes.track()
            if wanted <= online and len(online) >= count:
                return
            if time.monotonic() > deadline:
                raise DeploymentError(
                    f"SuperNodes {sorted(wanted - online)} not online within {timeout:.0f} s; "
                    f"see {self.logs}"
                )
            time.sleep(1.0)

    # runs ---------------------------------------------------------------------------------

    def run_app(self, run_config: str, output_dir: Path, timeout: float = 3600.0) -> RunOutcome:
        """``flwr run . <connection> --stream``; waits for the run to finish.

        An inline ``mpu.secret`` is refused here: it would be on this command line and in the
        SuperLink's run record (``mpu.secret-file`` or ``$FEDUNLEARN_MPU_SECRET`` instead).
        """
        pairs = parse_config_pairs(run_config) if run_config else {}
        check_secret_keys(str(pairs.get("mpu.secret", "")), str(pairs.get("mpu.secret-file", "")))
        output_dir = Path(output_dir).resolve()
        # the folders once, then the user's keys (a key twice is "invalid format" in Flower)
        overrides = plan_run(run_config, "", output_dir, self.cache_dir).flower_run_config
        command = [
            str(BIN_DIR / "flwr"), "run", str(stage_app(REPO_ROOT, self.workdir / "app")),
            CONNECTION, "--stream",
            "--run-config", overrides,
        ]  # fmt: skip
        process = self.processes.adopt(
            subprocess.Popen(
                command,
                env=self.env,
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        )
        stream = RunStream(process, self.logs / "flwr-run.log", self.echo)
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            self.processes.track()
            time.sleep(1.0)
        timed_out = process.poll() is None
        if timed_out:
            if stream.run_id is not None:
                self.flwr.stop_run(stream.run_id)
            stop_process(process)
        stream.join()
        rid = stream.run_id if stream.run_id is not None else next(iter(self.flwr.run_ids()), None)
        status = self._final_status(rid)
        results = output_dir / "results.json"
        outcome = RunOutcome(rid, status, results, process.returncode, stream.lines)
        if timed_out:
            raise DeploymentError(f"run {rid} did not finish within {timeout:.0f} s ({status})")
        return outcome

    def _final_status(self, run_id: int | None) -> str:
        """The run's status once finished (the stream ends with the run; its status may lag
        a moment), or the last status seen within 30 s."""
        status = "unknown"
        if run_id is not None:
            for _ in range(30):
                status = self.flwr.run_status(run_id)
                if status.startswith("finished"):
                    break
                time.sleep(1.0)
        return status


class RunStream:
    """``flwr run --stream``'s output read in a thread: kept, logged, echoed, and the run id
    taken from its "started run N" line."""

    def __init__(self, process: subprocess.Popen, log_file: Path, echo: bool) -> None:
        self.lines: list[str] = []
        self.run_id: int | None = None
        self._thread = threading.Thread(
            target=self._read, args=(process, log_file, echo), daemon=True
        )
        self._thread.start()

    def _read(self, process: subprocess.Popen, log_file: Path, echo: bool) -> None:
        assert process.stdout is not None
        with open(log_file, "a") as log:
            for line in process.stdout:
                self.lines.append(line.rstrip("\n"))
                log.write(line)
                log.flush()
                if echo:
                    print(line, end="", flush=True)
                match = re.search(r"started run (\d+)", line)
                if match and self.run_id is None:
                    self.run_id = int(match.group(1))

    def join(self, timeout: float = 10.0) -> None:
        self._thread.join(timeout=timeout)


def default_node_specs(run_config: str) -> list[NodeSpec]:
    """One SuperNode per client of the scenario: forget nodes, then retain nodes."""
    settings = run_settings(parse_config_pairs(run_config) if run_config else {})
    if settings.pipeline == "dp2u":  # roles do not apply: data clients by partition
        return [NodeSpec(f"node-{i}", f"partition-id={i}") for i in range(settings.num_clients)]
    specs = []
    for i in range(settings.scenario.num_forget_clients):
        specs.append(NodeSpec(f"forget-{i}", f"role='forget' partition-id={i}"))
    for j in range(settings.scenario.num_retain_clients):
        pid = settings.scenario.num_forget_clients + j
        specs.append(NodeSpec(f"retain-{j}", f"role='retain' partition-id={pid}"))
    return specs


def deploy(
    run_config: str = "",
    nodes: Sequence[NodeSpec] | None = None,
    output_dir: Path | None = None,
    workdir: Path | None = None,
    cache_dir: Path | None = None,
    timeout: float = 3600.0,
    node_auth: bool = True,
    bind: str = LOOPBACK,
    cert_hosts: Sequence[str] = (),
    cert_ips: Sequence[str] = (),
) -> RunOutcome:
    """Start SuperLink and SuperNodes, run the app once, stop everything; the run's outcome.

    ``bind``: the address the SuperLink listens on (see :class:`LocalDeployment`). Raises
    ``DeploymentError`` when a step fails or the run does not finish completed with a
    results file (``flwr run --stream`` exits 0 even when the ServerApp raised).
    """
    dial_address(bind)  # a bad address fails before any work
    plan = plan_run(run_config, "", output_dir, cache_dir)  # every key checked up front
    settings, output_dir, cache_dir = plan.settings, plan.output_dir, plan.cache_dir
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workdir = (workdir or REPO_ROOT / ".flwr_home" / f"deploy-{stamp}").resolve()
    prepare_substrate(settings, cache_dir)
    nodes = list(nodes) if nodes else default_node_specs(run_config)
    deployment = LocalDeployment(
        workdir,
        node_auth=node_auth,
        cache_dir=cache_dir,
        bind=bind,
        cert_hosts=cert_hosts,
        cert_ips=cert_ips,
    )
    with deployment:
        port = deployment.start_superlink()
        auth = ", node auth" if node_auth else ""
        print(f"SuperLink (TLS{auth}) listening on {host_port(bind, port)}")
        if not ipaddress.ip_address(bind).is_loopback:
            print(
                f"warning: port {port} serves Flower's Control API without authentication: "
                "whoever reaches it can register nodes, list runs and run code here. Let only "
                "the node machines reach it (firewall)",
                file=sys.stderr,
            )
        started = [deployment.start_node(spec) for spec in nodes]
        deployment.wait_online(started)
        for node in started:
            print(f"SuperNode {node.spec.name} online: node {node.node_id} {node.spec.node_config}")
        outcome = deployment.run_app(run_config, output_dir, timeout=timeout)
    if not outcome.ok:
        raise DeploymentError(
            f"run {outcome.run_id} ended {outcome.status!r}"
            + ("" if outcome.results.is_file() else f" without {outcome.results}")
            + f"; logs in {workdir / 'logs'}"
        )
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-config", default="", help='run-config overrides, e.g. "gamma=2.0"')
    parser.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="NODE_CONFIG",
        help="a SuperNode's --node-config, e.g. \"role='forget' partition-id=0 "
        "data-path='/data/shard0'\" (repeat per node; default: the scenario's clients)",
    )
    parser.add_argument("--output-dir", type=Path, default=None, help="where results.json goes")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="certificates, keys, Flower homes and logs (default .flwr_home/deploy-<time>)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the run")
    parser.add_argument(
        "--no-node-auth",
        action="store_true",
        help="accept any SuperNode (TLS stays on)",
    )
    parser.add_argument(
        "--bind",
        default=LOOPBACK,
        metavar="IP",
        help="address the SuperLink listens on (default 127.0.0.1, this machine only; "
        "0.0.0.0 = every interface). Its port also serves Flower's unauthenticated Control "
        "API: whoever reaches it can register nodes, list runs and run code. Open it only "
        "to the node machines (firewall)",
    )
    parser.add_argument(
        "--cert-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another DNS name remote nodes dial, for the SuperLink certificate (repeat)",
    )
    parser.add_argument(
        "--cert-ip",
        action="append",
        default=[],
        metavar="IP",
        help="another IP address remote nodes dial, for the SuperLink certificate (repeat)",
    )
    args = parser.parse_args(argv)
    nodes = [NodeSpec(f"node-{i}", text) for i, text in enumerate(args.node)] or None
    try:
        outcome = deploy(
            args.run_config,
            nodes,
            args.output_dir,
            args.workdir,
            timeout=args.timeout,
            node_auth=not args.no_node_auth,
            bind=args.bind,
            cert_hosts=args.cert_host,
            cert_ips=args.cert_ip,
        )
    except (DeploymentError, ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    data = json.loads(outcome.results.read_text())
    from fedunlearn.scenarios import get_scenario
    from strategies.results import format_summary_table

    scenario = get_scenario(data["config"]["scenario.name"])
    print(format_summary_table(data["metrics"], scenario.summary_metrics, data.get("metrics_ci")))
    print(f"\nrun {outcome.run_id}: {outcome.status}\nresults: {outcome.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
