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


def test_scenario_defaults_fill_only_unset_keys():
    wmdp = RunSettings.from_run_config({"scenario": "wmdp"})
    assert (wmdp.objective, wmdp.lora_targets, wmdp.num_forget_clients) == ("rmu", "down_proj", 6)
    assert wmdp.rmu_steering == 100.0 and wmdp.rmu_alpha == 100.0
    # an explicit value equal to nothing special is kept, also 0 (an RMU ablation)
    ablation = RunSettings.from_run_config({"scenario": "wmdp", "rmu-alpha": 0.0, "gamma": 2.0})
    assert ablation.rmu_alpha == 0.0 and ablation.gamma == 2.0
    assert RunSettings.from_run_config({"scenario": "muse"}).gamma == 3.0


def test_layer_defaults_follow_the_model_depth():
    wmdp = RunSettings.from_run_config({"scenario": "wmdp"})
    assert (wmdp.for_model(4).rmu_layer, wmdp.for_model(4).lora_layers) == (2, "1,2")
    assert (wmdp.for_model(32).rmu_layer, wmdp.for_model(32).lora_layers) == (16, "15,16")
    assert RunSettings.from_run_config({}).for_model(4).lora_layer_indices() is None
    with pytest.raises(ValueError, match="layers 0..3"):
        RunSettings.from_run_config({"scenario": "wmdp", "rmu-layer": 7}).for_model(4)
    with pytest.raises(ValueError, match="LoRA layers"):
        RunSettings.from_run_config({"lora-layers": "one,two"})


@pytest.mark.parametrize(
    "config,message",
    [
        ({"data-path": "/data/tofu"}, "needs model-path"),
        ({"objective": "nll"}, "forget objective"),
        ({"objective": "dpo", "scenario": "wmdp"}, "plain text"),
        ({"objective": "idk", "scenario": "muse"}, "plain text"),
        ({"objective": "graddiff", "local-retain-samples": 0}, "local-retain-samples"),
        ({"objective": "nope"}, "objective 'nope' is unknown"),
        ({"scenario": "nope"}, "scenario 'nope' is not available"),
        ({"dp2u-forget-request": '{"0": {"records": [1]}}'}, "needs strategy='dp2u'"),
    ],
)
def test_combinations_refused_before_anything_runs(config, message):
    with pytest.raises(ValueError, match=message):
        RunSettings.from_run_config(config)


def test_dp2u_forget_request_inline_or_from_a_file(tmp_path):
    inline = RunSettings.from_run_config(
        {"strategy": "dp2u", "dp2u-forget-request": '{"1": {"records": [3, 4]}}'}
    )
    assert [(r.client, r.records) for r in inline.forget_request()] == [(1, (3, 4))]
    path = tmp_path / "request.json"
    path.write_text('{"0": {"authors": ["Ann Lee"]}}')
    from_file = RunSettings.from_run_config({"strategy": "dp2u", "dp2u-forget-request": str(path)})
    assert [(r.client, r.authors) for r in from_file.forget_request()] == [(0, ("Ann Lee",))]
    assert RunSettings().forget_request() == []
    with pytest.raises(ValueError, match="neither JSON nor a file"):
        RunSettings.from_run_config({"strategy": "dp2u", "dp2u-forget-request": "nope.json"})
    with pytest.raises(ValueError, match="not valid JSON"):
        RunSettings.from_run_config({"strategy": "dp2u", "dp2u-forget-request": "{1: 2}"})
