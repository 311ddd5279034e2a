"""Run a fedunlearn scenario as a Flower simulation on this machine, end to end.

Starts a private simulation SuperLink (free loopback ports, runtime dependency installation
off, telemetry off), submits the app with ``flwr run --stream``, waits for the results file,
prints the before/after table and stops the SuperLink it started — also on failure.

    python -m simulations.run_local --run-config "gamma=2.0 merge='ties'" --federation-config "..."
    python -m simulations.run_local --run-config presets/wmdp.toml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from simulations.app_bundle import stage_app
from strategies.settings import RunConfigError, RunSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
BIN_DIR = Path(sys.executable).parent


# Flower's own pattern for the pairs of --run-config / --federation-config
# (flwr.common.config.parse_config_args); splitting the same way keeps what is checked here
# exactly what Flower reads.
CONFIG_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")
#: run-config keys that act like the runner's options
FOLDER_KEYS = ("output-dir", "model.cache-dir")
#: Federation-config pairs applied to every run before ``--federation-config`` (the test suite
#: sets ``init-args-num-cpus=1``: one client process per run instead of one per core)
FEDERATION_ENV = "FEDUNLEARN_FEDERATION_CONFIG"


def config_pairs(text: str) -> list[tuple[str, str]]:
    """``"key=value key2='text'"`` as ``(key, value text)`` pairs, split as Flower splits it.

    Text that is not a pair and a key given twice (Flower's "invalid format") are errors.
    Leading paths ending in ``.toml`` are read as ``flwr run --run-config <file>.toml`` reads
    one: TOML files of run-config keys (tables are groups: ``[firm] alpha`` is
    ``firm.alpha``), each over the one before; the pairs after them override their keys
    (``presets/mpu.toml mpu.copies=3``; ``flwr run`` itself takes a file or pairs, not both).
    """
    words = text.split()
    files = []
    while words and words[0].endswith(".toml") and "=" not in words[0]:
        files.append(Path(words.pop(0)).expanduser())
    if files:
        given = dict(config_pairs(" ".join(words)))
        from_files: dict[str, str] = {}
        for path in files:
            from_files.update(toml_file_pairs(path))
        return [(k, v) for k, v in from_files.items() if k not in given] + list(given.items())
    pairs: list[tuple[str, str]] = []
    end = 0
    for match in CONFIG_PAIR.finditer(text):
        _refuse_stray_text(text[end : match.start()])
        key, value = match.groups()
        if any(key == seen for seen, _ in pairs):
            raise ValueError(f"config key {key!r} is given twice in {text!r}")
        pairs.append((key, value))
        end = match.end()
    _refuse_stray_text(text[end:])
    return pairs


def toml_file_pairs(path: Path) -> list[tuple[str, str]]:
    """The keys of a run-config TOML file (flattened to dotted keys, as Flower flattens them)
    as ``(key, value text)`` pairs."""
    from flwr.common.config import flatten_dict

    try:
        values = flatten_dict(tomllib.loads(path.read_text()))
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"run-config file {str(path)!r}: {err}") from None
    return [(key, _toml_value(value)) for key, value in values.items()]


def _toml_value(value: object) -> str:
    """A TOML bool, number or string as a value text Flower's pair pattern keeps whole."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return _quoted(str(value))


def with_overrides(run_config: str, overrides: str) -> str:
    """``run_config`` with the keys of ``overrides`` replaced by theirs."""
    replaced = {key for key, _ in config_pairs(overrides)}
    kept = [f"{k}={v}" for k, v in config_pairs(run_config) if k not in replaced]
    return " ".join([*kept, overrides]).strip()


def _refuse_stray_text(text: str) -> None:
    if text.strip():
        raise ValueError(f"config override {text.strip()!r} is not key=value")


def parse_config_pairs(text: str) -> dict:
    """Parse Flower's ``"key=value key2='text'"`` override syntax (values are TOML)."""
    out: dict = {}
    for key, value in config_pairs(text):
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError as err:
            raise ValueError(
                f"config override {key}={value}: not a TOML bool, number or quoted string ({err})"
            ) from None
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


def pyproject_run_config() -> dict:
    """The run config of ``pyproject.toml`` flattened to dotted keys, as Flower reads it
    (``[tool.flwr.app.config.firm] alpha`` → ``firm.alpha``)."""
    from flwr.common.config import flatten_dict

    defaults = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return flatten_dict(defaults["tool"]["flwr"]["app"]["config"])


def run_settings(overrides: dict) -> RunSettings:
    """The pyproject run config with ``overrides`` applied (errors before Flower starts)."""
    return RunSettings.from_run_config({**pyproject_run_config(), **overrides})


def prepare_substrate(settings: RunSettings, cache_dir: Path) -> None:
    """Build the built-in model substrate here, with progress bars, before Flower starts.

    The ServerApp then finds it in the cache. Runs with ``model.path`` skip this; with a
    registry ``model.name`` it converts the model and fine-tunes the knowledgeable model and the
    reference on the scenario's data instead.
    """
    from fedunlearn.models.substrate import ensure_substrate
    from fedunlearn.scenarios import get_scenario

    if settings.model.path:
        return
    if settings.model.name != "builtin":
        prepare_finetuned(settings, cache_dir)
        return
    print(
        "Preparing the built-in model substrate (built once, then cached in "
        f"{cache_dir.resolve()})",
        flush=True,
    )
    folder = ensure_substrate(settings.substrate_config(), cache_dir.resolve())
    info = json.loads((folder / "build_info.json").read_text())
    scenario = get_scenario(settings.scenario.name)
    knows = ", ".join(
        f"{k} {v:.3f}"
        for k, v in info.items()
        if isinstance(v, float) and (k in scenario.summary_metrics or k.endswith("_exact_match"))
    )
    print(f"substrate ready: {folder.name} ({knows})", flush=True)


def prepare_finetuned(settings: RunSettings, cache_dir: Path) -> None:
    """Convert registry model ``model.name`` and fine-tune it on the scenario's data (cached)."""
    from fedunlearn.models.finetuned import FINETUNED_INFO, ensure_finetuned
    from fedunlearn.models.pretrained import pretrained_checkpoint
    from fedunlearn.scenarios import get_scenario
    from strategies.run_setup import finetune_recipe

    print(
        f"Preparing {settings.model.name}: converted once, then fine-tuned on the "
        f"{settings.scenario.name} data (knowledgeable model and retain-only reference), "
        f"cached in {cache_dir.resolve()}",
        flush=True,
    )
    base = pretrained_checkpoint(settings.model.name, cache_dir.resolve())
    scenario = get_scenario(settings.scenario.name)(settings.scenario_params())
    folder = ensure_finetuned(base, scenario, finetune_recipe(settings), cache_dir.resolve())
    info = json.loads((folder / FINETUNED_INFO).read_text())
    knows = ", ".join(
        f"{k} {v:.3f}"
        for k, v in info.items()
        if isinstance(v, float) and k.endswith(("rouge_l", "_forget"))
    )
    print(f"fine-tuned model ready: {folder.name} ({knows})", flush=True)


@dataclass(frozen=True)
class LocalRun:
    """One local run, decided and checked before anything is built or started."""

    settings: RunSettings  # every key checked, output-dir and model.cache-dir filled in
    output_dir: Path
    cache_dir: Path
    flower_run_config: str  # ``flwr run --run-config``
    flower_federation_config: str  # ``flwr run --federation-config``


def plan_run(
    run_config: str = "",
    federation_config: str = "",
    output_dir: Path | None = None,
    cache_dir: Path | None = None,
) -> LocalRun:
    """Parse and check both configs as Flower and the ServerApp will, before any work.

    ``output-dir`` / ``model.cache-dir`` in ``run_config`` act exactly like the ``output_dir`` /
    ``cache_dir`` arguments (a relative path is taken from the working folder); naming a
    folder both ways, differently, is an error. Raises ``ValueError`` (``RunConfigError`` for
    a bad run-config key: unknown, mistyped or out of range).
    """
    pairs = config_pairs(run_config)
    user = parse_config_pairs(run_config)
    output_dir = _one_folder("output-dir", output_dir, user.pop("output-dir", None))
    cache_dir = _one_folder("model.cache-dir", cache_dir, user.pop("model.cache-dir", None))
    settings = run_settings(user)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output_dir = (output_dir or REPO_ROOT / "outputs" / settings.output_name(stamp)).resolve()
    cache_dir = (cache_dir or default_cache_dir()).resolve()
    model = dataclasses.replace(settings.model, cache_dir=str(cache_dir))
    settings = dataclasses.replace(settings, output_dir=str(output_dir), model=model)
    folders = [f"output-dir={_quoted(output_dir)}", f"model.cache-dir={_quoted(cache_dir)}"]
    kept = [f"{key}={value}" for key, value in pairs if key not in FOLDER_KEYS]
    return LocalRun(
        settings=settings,
        output_dir=output_dir,
        cache_dir=cache_dir,
        flower_run_config=" ".join(folders + kept),
        flower_federation_config=federation_overrides(settings.num_clients, federation_config),
    )


def _one_folder(key: str, option: Path | None, value: object) -> Path | None:
    """The folder of ``key``: the runner's option or the run config's value (not both)."""
    if value is None or value == "":
        return option
    if not isinstance(value, str):
        raise RunConfigError(f"run-config key {key!r} must be str, got {value!r}")
    folder = Path(value).expanduser()
    if option is not None and Path(option).resolve() != folder.resolve():
        raise RunConfigError(
            f"{key} is given twice: {str(option)!r} as the option and {value!r} in the run config"
        )
    return folder


def _quoted(path: Path | str) -> str:
    """``path`` (or any text) as a TOML string Flower's pair pattern keeps whole."""
    text = str(path)
    if "'" not in text:
        return f"'{text}'"
    if '"' not in text and "\\" not in text:
        return f'"{text}"'
    raise ValueError(f"Flower cannot pass the value {text!r} (a ' with a \" or a \\ in it)")


def federation_overrides(num_clients: int, federation_config: str) -> str:
    """``--federation-config``: one SuperNode per client and one CPU each, then the pairs of
    ``$FEDUNLEARN_FEDERATION_CONFIG`` (defaults for every run of this environment), then
    ``federation_config``; the keys are checked with Flower's own parser."""
    from flwr.supercore.utils import simulation_config_from_json

    values = {"num-supernodes": str(num_clients), "client-resources-num-cpus": "1"}
    values.update(config_pairs(os.environ.get(FEDERATION_ENV, "")))
    values.update(config_pairs(federation_config))
    parsed = parse_config_pairs(" ".join(f"{k}={v}" for k, v in values.items()))
    try:
        simulation_config_from_json({k.replace("-", "_"): v for k, v in parsed.items()})
    except (ValueError, TypeError) as err:
        given = os.environ.get(FEDERATION_ENV, "")
        raise ValueError(
            f"--federation-config {federation_config!r}"
            + (f" (after ${FEDERATION_ENV}={given!r})" if given else "")
            + f": {err}"
        ) from None
    return " ".join(f"{k}={v}" for k, v in values.items())


def run(
    run_config: str = "",
    federation_config: str = "",
    output_dir: Path | None = None,
    flwr_home: Path | None = None,
    cache_dir: Path | None = None,
) -> Path:
    """Run one scenario and return the path of its ``results.json``.

    Both configs are checked first (:func:`plan_run`): a bad key fails before the substrate
    is built or the SuperLink started.
    """
    plan = plan_run(run_config, federation_config, output_dir, cache_dir)
    if flwr_home is None:  # one Flower home per run: concurrent runs never share a config
        (REPO_ROOT / ".flwr_home").mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        flwr_home = Path(tempfile.mkdtemp(prefix=f"{stamp}-", dir=REPO_ROOT / ".flwr_home"))
    flwr_home = flwr_home.resolve()
    flwr_home.mkdir(parents=True, exist_ok=True)
    env = flower_env(flwr_home)
    env["FEDUNLEARN_CACHE_DIR"] = str(plan.cache_dir)
    prepare_substrate(plan.settings, plan.cache_dir)
    process, port = start_superlink(flwr_home, env)
    try:
        (flwr_home / "config.toml").write_text(
            '[superlink]\ndefault = "fedunlearn-sim"\n\n'
            f'[superlink.fedunlearn-sim]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        command = [
            str(BIN_DIR / "flwr"),
            "run",
            str(stage_app(REPO_ROOT, flwr_home / "app")),
            "fedunlearn-sim",
            "--stream",
            "--run-config",
            plan.flower_run_config,
            "--federation-config",
            plan.flower_federation_config,
        ]
        completed = subprocess.run(command, env=env, cwd=REPO_ROOT, check=False)
        results = plan.output_dir / "results.json"
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
    parser.add_argument(
        "--run-config",
        default="",
        help="run-config overrides, e.g. \"gamma=2.0 scenario.name='wmdp'\", or a TOML file of "
        "them such as presets/wmdp.toml",
    )
    parser.add_argument(
        "--federation-config",
        default="",
        help='simulation overrides, e.g. "client-resources-num-cpus=2"',
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="where results.json goes (default outputs/<scenario>-<merge>-<time>, the merge "
        "or mpu / dp2u); "
        "the same as output-dir in --run-config",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="substrate cache (default $FEDUNLEARN_CACHE_DIR or .cache/); "
        "the same as model.cache-dir in --run-config",
    )
    args = parser.parse_args(argv)
    try:
        results = run(
            args.run_config, args.federation_config, args.output_dir, cache_dir=args.cache_dir
        )
    except ValueError as err:  # a bad key or value: refused before anything started
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    data = json.loads(results.read_text())
    from fedunlearn.scenarios import get_scenario
    from strategies.results import format_summary_table, summary_names

    scenario = get_scenario(data["config"]["scenario.name"])
    if data["metrics"]:
        names = summary_names(data["metrics"], scenario)
        print(format_summary_table(data["metrics"], names, data.get("metrics_ci")))
        print("(95 % bootstrap intervals over the questions in brackets; scores.json beside)")
    else:
        print("no metrics (evaluate=false)")
    print(f"\nresults: {results}")
    report = results.with_name("report.html")
    if report.is_file():
        print(f"report:  {report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
