"""Run-config parsing: defaults from pyproject, types, unknown keys."""

import math
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from strategies.settings_rules import RULES, RunConfigError

from strategies.settings import RunSettings

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_pyproject_run_config_matches_settings_defaults():
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    settings = RunSettings.from_run_config(config)
    assert settings == RunSettings().resolved()
    assert settings.objective.name == "ga" and settings.scenario.num_forget_clients == 5
    assert set(config) == set(RunSettings().as_dict())
    assert settings.firm.epsilon == math.inf


def test_overrides_and_errors():
    s = RunSettings.from_run_config({"gamma": 2, "epsilon": 1e-4, "strategy": "firm"})
    assert s.gamma == 2.0 and isinstance(s.gamma, float) and s.epsilon == 1e-4
    with pytest.raises(RunConfigError, match="unknown run-config key 'gama'"):
        RunSettings.from_run_config({"gama": 1.0})
    with pytest.raises(RunConfigError, match="'num-authors' must be int"):
        RunSettings.from_run_config({"num-authors": "many"})
    with pytest.raises(ValueError, match="forget-percent"):
        RunSettings.from_run_config({"forget-percent": 150.0})
    with pytest.raises(ValueError, match="'epsilon' = 0.0"):
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
        ({"data-path": "/data/tofu"}, "needs a real model"),
        ({"objective": "nll"}, "forget objective"),
        ({"objective": "dpo", "scenario": "wmdp"}, "plain text"),
        ({"objective": "idk", "scenario": "muse"}, "plain text"),
        ({"objective": "graddiff", "local-retain-samples": 0}, "local-retain-samples"),
        ({"objective": "nope"}, "'objective' = 'nope': must be one of dpo, ga"),
        ({"scenario": "nope"}, "'scenario' = 'nope': must be one of muse, tofu, wmdp"),
        ({"dp2u-forget-request": '{"0": {"records": [1]}}'}, "needs strategy='dp2u'"),
        ({"strategy": "dp2u", "evaluate": False}, "evaluate=false does not apply"),
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


# --- every key checked up front (issue 13): names, ranges, finiteness -----------------------

FLOAT_KEYS = [f.name.replace("_", "-") for f in fields(RunSettings) if f.type == "float"]
INF_MEANINGFUL = {"epsilon"}  # FIRM's retention budget: inf = no projection


@pytest.mark.parametrize(
    "config,message",
    [
        ({"strategy": "nope"}, r"'strategy' = 'nope'.*unknown merge.*firm"),
        ({"strategy": "no_such_module_x:merge"}, r"No module named 'no_such_module_x'"),
        ({"strategy": "mpu", "mpu-merge": "nope"}, r"'mpu-merge' = 'nope'.*unknown merge"),
        ({"mpu-merge": "dp2u"}, r"'mpu-merge' = 'dp2u'.*a merge function"),
        ({"solver": "fast"}, r"'solver' = 'fast'.*one of exact, increase-only"),
        ({"ties-k": 0.0}, r"'ties-k' = 0.0.*in \(0, 1\]"),
        ({"ties-k": 1.5}, r"'ties-k' = 1.5.*in \(0, 1\]"),
        ({"fulm-k": math.nan}, r"'fulm-k' = nan.*in \(0, 1\]"),
        ({"fulm-threshold": 2.0}, r"'fulm-threshold' = 2.0.*in \[-1, 1\]"),
        ({"mpu-kappa": -0.5}, r"'mpu-kappa' = -0.5.*>= 0"),
        ({"mpu-kappa": math.inf}, r"'mpu-kappa' = inf.*finite"),
        ({"mpu-server-lr": 0.0}, r"'mpu-server-lr' = 0.0.*> 0"),
        ({"gamma": math.nan}, r"'gamma' = nan.*finite number > 0"),
        ({"gamma": "inf"}, r"'gamma' = inf.*finite number > 0"),
        ({"mpu-mode": "loud"}, r"'mpu-mode' = 'loud'.*one of clean, mpu, noised"),
        ({"mpu-publish": "once"}, r"'mpu-publish' = 'once'.*one of per-client, per-round"),
        ({"dp2u-method": "dp2u-sdg"}, r"'dp2u-method'.*did you mean 'dp2u-sgd'"),
        ({"objective": "npo2"}, r"'objective' = 'npo2'.*did you mean 'npo'"),
        ({"num-rounds": 0}, r"'num-rounds' = 0.*integer >= 1"),
        ({"rmu-layer": -2}, r"'rmu-layer' = -2.*>= 0, or -1"),
        ({"robust-norm-bound": 0.5}, r"'robust-norm-bound' = 0.5.*>= 1, or 0 \(off\)"),
        ({"scenario": "wmdp", "forget-domains": "bio,physics"}, r"forget-domains.*'physics'"),
    ],
)
def test_bad_values_refused_by_from_run_config(config, message):
    with pytest.raises(RunConfigError, match=message):
        RunSettings.from_run_config(config)


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_key_refuses_nan_and_inf_unless_inf_is_meaningful(key):
    with pytest.raises(RunConfigError, match=f"'{key}' = nan"):
        RunSettings.from_run_config({key: math.nan})
    if key in INF_MEANINGFUL:
        assert getattr(RunSettings.from_run_config({key: "inf"}), key.replace("-", "_")) == math.inf
    else:
        with pytest.raises(RunConfigError, match=f"'{key}' = inf"):
            RunSettings.from_run_config({key: math.inf})


def test_every_numeric_key_has_a_rule():
    numeric = {f.name for f in fields(RunSettings) if f.type in ("int", "float")}
    assert numeric <= set(RULES), sorted(numeric - set(RULES))
    assert set(RULES) <= {f.name for f in fields(RunSettings)}


def test_unknown_keys_name_close_matches():
    with pytest.raises(RunConfigError, match=r"unknown run-config key 'gama'.*'gamma'"):
        RunSettings.from_run_config({"gama": 1.0})
    with pytest.raises(RunConfigError, match=r"unknown run-config key 'zzz'.*keys are: alpha"):
        RunSettings.from_run_config({"zzz": 1})


PLUGINS = """
def needs_beta(updates, *, beta):
    return None

def two_positionals(updates, other):
    return None
"""


def test_plugin_merges_resolved_and_their_signature_checked_up_front(tmp_path, monkeypatch):
    (tmp_path / "issue13_plugins.py").write_text(PLUGINS)
    (tmp_path / "issue13_broken.py").write_text("raise RuntimeError('broken plug-in')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RunConfigError, match=r"RuntimeError: broken plug-in"):
        RunSettings.from_run_config({"strategy": "issue13_broken:merge"})
    with pytest.raises(RunConfigError, match=r"'issue13_plugins:needs_beta'.*'beta'"):
        RunSettings.from_run_config({"strategy": "issue13_plugins:needs_beta"})
    with pytest.raises(RunConfigError, match=r"'issue13_plugins:two_positionals'.*'other'"):
        RunSettings.from_run_config(
            {"strategy": "mpu", "mpu-merge": "issue13_plugins:two_positionals"}
        )


def test_a_registry_model_gets_practical_lora_targets_and_a_cpu_sized_tofu_subset():
    settings = RunSettings.from_run_config(
        {"model": "smollm2-135m", "data-path": "/data/tofu", "lora-rank": 8}
    )
    assert settings.lora.targets == "q_proj,v_proj"
    assert settings.eval.max_new_tokens == 64
    assert settings.scenario.tofu_subset_authors == (200 if torch.cuda.is_available() else 4)
    assert settings.scenario_params().subset_authors == settings.scenario.tofu_subset_authors
    explicit = RunSettings.from_run_config(
        {"model": "smollm2-135m", "lora-targets": "q_proj", "tofu-subset-authors": 8}
    )
    assert explicit.lora_targets == "q_proj" and explicit.tofu_subset_authors == 8


def test_a_registry_model_on_real_muse_files_gets_a_cpu_sized_subset_and_recipe():
    config = {"scenario": "muse", "model": "smollm2-135m", "data-path": "/data/muse-news"}
    settings = RunSettings.from_run_config(config)
    assert settings.scenario.muse_subset_texts == (100 if torch.cuda.is_available() else 16)
    assert settings.scenario_params().subset_texts == settings.scenario.muse_subset_texts
    assert (settings.model.finetune_epochs, settings.model.finetune_lr) == (8, 5e-4)
    assert RunSettings.from_run_config({**config, "muse-subset-texts": 4}).muse_subset_texts == 4
    tofu = RunSettings.from_run_config({"model": "smollm2-135m", "data-path": "/data/tofu"})
    assert tofu.scenario_params().subset_texts == 0 and tofu.model_finetune_lr == 1e-4
    with pytest.raises(RunConfigError, match="muse-subset-texts"):
        RunSettings.from_run_config({"muse-subset-texts": 1})


def test_model_keys_are_checked():
    with pytest.raises(RunConfigError, match="model='smollm2-135m'"):
        RunSettings.from_run_config({"data-path": "/data/tofu"})
    with pytest.raises(RunConfigError, match="either model"):
        RunSettings.from_run_config({"model": "smollm2-135m", "model-path": "/ckpt"})
    with pytest.raises(RunConfigError, match="'model'.*smollm2-135m"):
        RunSettings.from_run_config({"model": "smollm3"})
    with pytest.raises(RunConfigError, match="tofu-subset-authors"):
        RunSettings.from_run_config({"tofu-subset-authors": 1})
