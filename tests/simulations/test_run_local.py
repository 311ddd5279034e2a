"""run_local's arguments: every key checked before anything starts; folders in --run-config.

No Flower run here: the configs run_local hands to ``flwr run`` are read back with Flower's own
parser (``flwr.common.config.parse_config_args``), and bad configs go through ``main``, which
must stop before it builds the substrate or starts a SuperLink.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from flwr.common.config import parse_config_args

from simulations import run_local
from strategies.settings import RunConfigError


def test_folders_in_run_config_act_like_the_options(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "my cache"
    plan = run_local.plan_run(f"output-dir='out' gamma=2.0 model.cache-dir='{cache}' seed=3")
    assert (plan.output_dir, plan.cache_dir) == (tmp_path / "out", cache)
    assert (plan.settings.output_dir, plan.settings.model.cache_dir) == (
        str(tmp_path / "out"),
        str(cache),
    )
    # what `flwr run` receives: each key once (twice was Flower's "invalid format")
    assert parse_config_args([plan.flower_run_config]) == {
        "output-dir": str(tmp_path / "out"),
        "model.cache-dir": str(cache),
        "gamma": 2.0,
        "seed": 3,
    }
    by_options = run_local.plan_run("gamma=2.0 seed=3", output_dir=Path("out"), cache_dir=cache)
    assert by_options.flower_run_config == plan.flower_run_config
    assert by_options.settings == plan.settings


def test_dotted_group_keys_parse_as_flowers_parser_reads_them(tmp_path):
    text = "firm.alpha=0.2 mpu.copies=3 merge='ties' wrapper='mpu' scenario.name='wmdp'"
    expected = {
        "firm.alpha": 0.2,
        "mpu.copies": 3,
        "merge": "ties",
        "wrapper": "mpu",
        "scenario.name": "wmdp",
    }
    assert run_local.parse_config_pairs(text) == parse_config_args([text]) == expected
    plan = run_local.plan_run(text, output_dir=tmp_path / "out", cache_dir=tmp_path / "cache")
    settings = plan.settings
    assert (settings.firm.alpha, settings.mpu.copies) == (0.2, 3)
    assert (settings.merge, settings.wrapper, settings.strategy_label) == ("ties", "mpu", "mpu")
    assert settings.scenario.name == "wmdp" and settings.objective.name == "rmu"
    assert parse_config_args([plan.flower_run_config]) == {
        "output-dir": str(tmp_path / "out"),
        "model.cache-dir": str(tmp_path / "cache"),
        **expected,
    }
    assert run_local.plan_run("wrapper='mpu'").output_dir.name.startswith("tofu-mpu-")


def test_a_folder_named_twice_differently_is_refused(tmp_path):
    with pytest.raises(RunConfigError, match="output-dir is given twice"):
        run_local.plan_run(f"output-dir='{tmp_path / 'a'}'", output_dir=tmp_path / "b")
    same = run_local.plan_run(f"model.cache-dir='{tmp_path / 'c'}'", cache_dir=tmp_path / "c")
    assert same.cache_dir == tmp_path / "c"


def test_federation_config_overrides_the_runner_defaults(monkeypatch):
    monkeypatch.delenv(run_local.FEDERATION_ENV, raising=False)
    plan = run_local.plan_run(
        "scenario.num-retain-clients=2", "client-resources-num-cpus=2 verbose=true"
    )
    assert parse_config_args([plan.flower_federation_config]) == {
        "num-supernodes": 7,  # 5 forget clients (tofu) + 2 retain clients
        "client-resources-num-cpus": 2,
        "verbose": True,
    }
    with pytest.raises(ValueError, match="Unknown simulation config field.*num_supernode"):
        run_local.plan_run("", "num-supernode=3")


def test_federation_defaults_from_the_environment_come_before_the_option(monkeypatch):
    monkeypatch.setenv(run_local.FEDERATION_ENV, "init-args-num-cpus=1 client-resources-num-cpus=3")
    plan = run_local.plan_run("scenario.num-retain-clients=2", "client-resources-num-cpus=2")
    assert parse_config_args([plan.flower_federation_config]) == {
        "num-supernodes": 7,
        "client-resources-num-cpus": 2,  # the option wins over the environment
        "init-args-num-cpus": 1,
    }
    monkeypatch.setenv(run_local.FEDERATION_ENV, "init-arg-num-cpus=1")
    with pytest.raises(ValueError, match="FEDUNLEARN_FEDERATION_CONFIG.*init_arg_num_cpus"):
        run_local.plan_run("", "")


@pytest.mark.parametrize(
    "text,message",
    [
        ("gamma=1.0 gamma=2.0", "'gamma' is given twice"),
        ("gamma", "'gamma' is not key=value"),
        ("gamma=1.0 oops", "'oops' is not key=value"),
        ("scenario.name=tofu", "scenario.name=tofu: not a TOML"),
    ],
)
def test_config_syntax_errors_name_the_pair(text, message):
    with pytest.raises(ValueError, match=message):
        run_local.parse_config_pairs(text)


@pytest.mark.parametrize(
    "run_config,message",
    [
        ("gama=2.0", r"unknown run-config key 'gama'; did you mean 'gamma'"),
        ("merge='nope'", r"'merge' = 'nope'.*unknown merge"),
        ("firm.solver='fast'", r"'firm.solver' = 'fast'"),
        ("gamma=nan", r"'gamma' = nan"),
        ("wrapper='mpu' mpu.kappa=inf", r"'mpu.kappa' = inf"),
        ("strategy='mpu'", r"'strategy' was split: use merge"),
        ("alpha=0.2", r"'alpha' was renamed: use 'firm.alpha'"),
        ("frim.alpha=0.2", r"unknown run-config group 'frim'.*did you mean 'firm'"),
    ],
)
def test_main_refuses_bad_keys_before_anything_starts(tmp_path, capsys, run_config, message):
    out, cache = tmp_path / "out", tmp_path / "cache"
    started = time.monotonic()
    code = run_local.main(
        ["--run-config", f"output-dir='{out}' {run_config}", "--cache-dir", str(cache)]
    )
    assert code == 2
    assert time.monotonic() - started < 30  # no substrate build, no SuperLink
    assert not out.exists() and not cache.exists()
    error = capsys.readouterr().err
    assert error.startswith("error: ") and re.search(message, error)
