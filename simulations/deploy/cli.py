"""The ``flwr`` CLI against a deployment's SuperLink: nodes, runs and their status."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from simulations.deploy.certificates import NodeKeys
from simulations.run_local import BIN_DIR, REPO_ROOT

#: The SuperLink connection name in the CLI's private config.
CONNECTION = "fedunlearn-deploy"


class DeploymentError(RuntimeError):
    """A deployment step failed; the message says which and where its log is."""


def json_from(text: str) -> dict:
    """The JSON object in a ``flwr ... --format json`` output (ignores text around it)."""
    start = text.find("{")
    if start < 0:
        raise ValueError(f"no JSON in {text!r}")
    return json.JSONDecoder().raw_decode(text[start:])[0]


class FlwrCli:
    """``flwr`` commands with the deployment's environment (its private ``FLWR_HOME``)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def __call__(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Run ``flwr <args>`` from the repository folder, output captured."""
        return subprocess.run(
            [str(BIN_DIR / "flwr"), *args],
            env=self.env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            start_new_session=True,
        )

    def register(self, keys: NodeKeys, name: str) -> int:
        """``flwr supernode register``: the SuperLink accepts this public key; its node id."""
        done = self(
            "supernode", "register", str(keys.public_key), CONNECTION, "--name", name,
            "--format", "json",
        )  # fmt: skip
        try:
            return int(json_from(done.stdout)["node-id"])
        except (ValueError, KeyError) as err:
            raise DeploymentError(
                f"registering {name} failed (exit {done.returncode}): {done.stdout}{done.stderr}"
            ) from err

    def list_nodes(self) -> list[dict]:
        """``flwr supernode ls --format json``: the SuperLink's nodes and their status."""
        done = self("supernode", "ls", CONNECTION, "--format", "json")
        try:
            return list(json_from(done.stdout).get("nodes", []))
        except ValueError as err:
            raise DeploymentError(f"flwr supernode ls failed: {done.stdout}{done.stderr}") from err

    def run_status(self, run_id: int) -> str:
        """``flwr ls --run-id``: e.g. ``running`` or ``finished:completed``."""
        done = self("ls", CONNECTION, "--run-id", str(run_id), "--format", "json")
        try:
            runs = json_from(done.stdout).get("runs", [])
        except ValueError:
            return "unknown"
        return str(runs[0]["status"]) if runs else "unknown"

    def run_ids(self) -> list[int]:
        """Ids of all runs this SuperLink has seen."""
        done = self("ls", CONNECTION, "--format", "json")
        try:
            return [int(r["run-id"]) for r in json_from(done.stdout).get("runs", [])]
        except ValueError:
            return []

    def stop_run(self, run_id: int) -> None:
        """``flwr stop``: end a run on the SuperLink (stopping ``flwr run`` does not)."""
        self("stop", str(run_id), CONNECTION)


def write_connection(flwr_home: Path, address: str, ca_cert: Path) -> None:
    """The CLI's private config: one TLS connection named :data:`CONNECTION`."""
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f"[superlink.{CONNECTION}]\n"
        f'address = "{address}"\n'
        f'root-certificates = "{ca_cert}"\n'
    )
