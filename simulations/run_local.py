"""Run a fedunlearn scenario as a Flower simulation on this machine, end to end.

Starts a private simulation SuperLink (free loopback ports, runtime dependency installation
off, telemetry off), submits the app with ``flwr run --stream``, waits for the results file,
prints the before/after table and stops the SuperLink it started — also on failure.

    python -m simulations.run_local --run-config "gamma=2.0" --federation-config "..."
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path

from strategies.settings import RunSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
BIN_DIR = Path(sys.executable).parent


def parse_config_pairs(text: str) -> dict:
    """Parse Flower's ``"key=value key2='text'"`` override syntax (values are TOML)."""
    out: dict = {}
    for pair in shlex.split(text, posix=False):
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"config override {pair!r} is not key=value")
        out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for the Flower processes: offline, quiet, no runtime installs."""
    env = os.environ.copy()
    env.update(
        {
            "FLWR_HOME": str(flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "RAY_DEDUP_LOGS": "0",
            # the Flower executables of this interpreter's environment, activated or not
            "PATH": f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}",
        }
    )
    return env


def start_superlink(flwr_home: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """Start a simulation SuperLink on free loopback ports; returns (process, http port)."""
    port, control = free_port(), free_port()
    log_file = flwr_home / "superlink.log"
    command = [
        str(BIN_DIR / "flower-superlink"),
        "--insecure",
        "--simulation",
        "--isolation",
        "subprocess",
        "--disable-runtime-dependency-installation",
        "--control-api-address",
        f"127.0.0.1:{control}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--database",
        ":flwr-in-memory:",
    ]
    with open(log_file, "ab") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {process.returncode}; see {log_file}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return process, port
        except OSError:
            time.sleep(0.3)
    stop_process(process)
    raise RuntimeError(f"flower-superlink did not become healthy in 60 s; see {log_file}")


def stop_process(process: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the process group we started, then SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=grace)


def default_cache_dir() -> Path:
    """The runner's substrate cache: ``$FEDUNLEARN_CACHE_DIR`` or ``.cache/`` in the repo."""
    return Path(os.environ.get("FEDUNLEARN_CACHE_DIR", REPO_ROOT / ".cache")).resolve()


def run_settings(overrides: dict) -> RunSettings:
    """The pyproject run config with ``overrides`` applied (errors before Flower starts)."""
    defaults = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return RunSettings.from_run_config({**defaults["tool"]["flwr"]["app"]["config"], **overrides})


def prepare_substrate(settings: RunSettings, cache_dir: Path) -> None:
    """Build the built-in model substrate here, with progress bars, before Flower starts.

    The ServerApp then finds it in the cache. Runs with ``model-path`` skip this.
    """
    from fedunlearn.models.substrate import ensure_substrate
    from fedunlearn.scenarios import get_scenario

    if settings.model_path:
        return
    print(
        "Preparing the built-in model substrate (built once, then cached in "
        f"{cache_dir.resolve()})",
        flush=True,
    )
    folder = ensure_substrate(settings.substrate_config(), cache_dir.resolve())
    info = json.loads((folder / "build_info.json").read_text())
    scenario = get_scenario(settings.scenario)
    knows = ", ".join(
        f"{k} {v:.3f}"
        for k, v in info.items()
        if isinstance(v, float) and (k in scenario.summary_metrics or k.endswith("_exact_match"))
    )
    print(f"substrate ready: {folder.name} ({knows})", flush=True)


def run(
    run_config: str = "",
    federation_config: str = "",
    output_dir: Path | None = None,
    flwr_home: Path | None = None,
    cache_dir: Path | None = None,
) -> Path:
    """Run one scenario and return the path of its ``results.json``."""
    user = parse_config_pairs(run_config) if run_config else {}
    settings = run_settings(user)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output_dir = (output_dir or REPO_ROOT / "outputs" / settings.output_name(stamp)).resolve()
    if flwr_home is None:  # one Flower home per run: concurrent runs never share a config
        (REPO_ROOT / ".flwr_home").mkdir(exist_ok=True)
        flwr_home = Path(tempfile.mkdtemp(prefix=f"{stamp}-", dir=REPO_ROOT / ".flwr_home"))
    flwr_home = flwr_home.resolve()
    if settings.cache_dir:
        cache_dir = Path(settings.cache_dir)
    cache_dir = cache_dir or default_cache_dir()
    flwr_home.mkdir(parents=True, exist_ok=True)
    env = flower_env(flwr_home)
    env["FEDUNLEARN_CACHE_DIR"] = str(cache_dir.resolve())
    prepare_substrate(settings, cache_dir)
    process, port = start_superlink(flwr_home, env)
    try:
        (flwr_home / "config.toml").write_text(
            '[superlink]\ndefault = "fedunlearn-sim"\n\n'
            f'[superlink.fedunlearn-sim]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        overrides = [f"output-dir='{output_dir}'", f"cache-dir='{cache_dir.resolve()}'"]
        if run_config:
            overrides.append(run_config)
        federation = f"num-supernodes={settings.num_clients} client-resources-num-cpus=1"
        if federation_config:
            federation += f" {federation_config}"
        command = [
            str(BIN_DIR / "flwr"),
            "run",
            str(REPO_ROOT),
            "fedunlearn-sim",
            "--stream",
            "--run-config",
            " ".join(overrides),
            "--federation-config",
            federation,
        ]
        completed = subprocess.run(command, env=env, cwd=REPO_ROOT, check=False)
        results = output_dir / "results.json"
        if completed.returncode != 0 or not results.is_file():
            raise RuntimeError(
                f"the Flower run did not produce {results} (flwr exit code "
                f"{completed.returncode}); see the log above and {flwr_home / 'superlink.log'}"
            )
        return results
    finally:
        stop_process(process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-config", default="", help='run-config overrides, e.g. "gamma=2.0"')
    parser.add_argument(
        "--federation-config",
        default="",
        help='simulation overrides, e.g. "client-resources-num-cpus=2"',
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="where results.json goes (default outputs/<scenario>-<strategy>-<time>)",
    )
    args = parser.parse_args(argv)
    try:
        results = run(args.run_config, args.federation_config, args.output_dir)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    data = json.loads(results.read_text())
    from fedunlearn.scenarios import get_scenario
    from strategies.results import format_summary_table

    scenario = get_scenario(data["config"]["scenario"])
    print(format_summary_table(data["metrics"], scenario.summary_metrics))
    print(f"\nresults: {results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
