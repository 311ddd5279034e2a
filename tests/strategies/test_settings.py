"""Run-config parsing: defaults from pyproject, types, unknown keys."""

import math
import tomllib
from pathlib import Path

import pytest

from strategies.settings import RunSettings

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_pyproject_run_config_matches_settings_defaults():
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    settings = RunSettings.from_run_config(config)
    assert settings == RunSettings().resolved()
    assert settings.objective == "ga" and settings.num_forget_clients == 5
    assert set(config) == set(RunSettings().as_dict())
    assert settings.epsilon == math.inf


def test_overrides_and_errors():
    s = RunSettings.from_run_config({"gamma": 2, "epsilon": 1e-4, "strategy": "firm"})
    assert s.gamma == 2.0 and isinstance(s.gamma, float) and s.epsilon == 1e-4
    with pytest.raises(KeyError, match="unknown run-config key 'gama'"):
        RunSettings.from_run_config({"gama": 1.0})
    with pytest.raises(TypeError, match="'num-authors' must be int"):
        RunSettings.from_run_config({"num-authors": "many"})
    with pytest.raises(ValueError, match="forget-percent"):
        RunSettings.from_run_config({"forget-percent": 150.0})
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        RunSettings.from_run_config({"epsilon": 0.0})


def test_output_dir_must_be_absolute(tmp_path):
    assert RunSettings(output_dir=str(tmp_path)).resolved_output_dir() == tmp_path
    with pytest.raises(ValueError, match="absolute"):
        RunSettings(output_dir="relative/out").resolved_output_dir()
    default = RunSettings().resolved_output_dir()
    assert default.is_absolute() and default.parent.name == "outputs"
