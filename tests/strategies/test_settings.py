"""Run-config parsing: defaults from pyproject, option groups and dotted keys, types, unknown
and renamed keys."""

import dataclasses
import math
import tomllib
from pathlib import Path

import pytest
import torch
from flwr.common.config import flatten_dict

from fedunlearn.options import OPTION_GROUPS, rule_of
from fedunlearn.scenarios import SCENARIOS
from strategies.run_setup import client_settings
from strategies.settings import (
    BUILTIN_DEFAULTS,
    GROUP_TYPES,
    PRETRAINED_DEFAULTS,
    RunConfigError,
    RunSettings,
)

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _pyproject_run_config() -> dict:
    """``[tool.flwr.app.config]`` as Flower reads it: its tables flattened to dotted keys."""
    tables = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    return flatten_dict(tables)


def _group_fields():
    """``(group, field)`` for every field of every option group of RunSettings."""
    return [(g, f) for g, kind in GROUP_TYPES.items() for f in dataclasses.fields(kind)]


def _key(group: str, f: dataclasses.Field) -> str:
    return f"{group}.{f.name.replace('_', '-')}"


def test_pyproject_run_config_matches_settings_defaults():
    config = _pyproject_run_config()
    settings = RunSettings.from_run_config(config)
    assert settings == RunSettings().resolved()
    assert settings.objective.name == "ga" and settings.scenario.num_forget_clients == 5
    assert settings.firm.epsilon == math.inf
    defaults = RunSettings().as_dict()
    assert list(config) == list(defaults)  # the same keys, in the same order
    for key, value in defaults.items():  # and the same values (inf written as "inf")
        assert config[key] == value and type(config[key]) is type(value), key
    assert config["firm.epsilon"] == "inf"


def test_as_dict_round_trips_through_from_run_config():
    for config in (
        {},
        {"scenario.name": "wmdp", "wrapper": "mpu", "merge": "ties", "mpu.copies": 3},
        {"pipeline": "dp2u", "dp2u.epsilon": 4.0, "firm.epsilon": 0.5},
        {"model.name": "smollm2-135m", "scenario.data-path": "/data/tofu", "lora.rank": 8},
    ):
        settings = RunSettings.from_run_config(config)
        flat = settings.as_dict()
        assert all(isinstance(v, int | float | str | bool) for v in flat.values()), flat
        assert RunSettings.from_run_config(flat) == settings, config


def test_groups_are_the_registered_option_groups():
    assert dict(OPTION_GROUPS) == GROUP_TYPES
    settings = RunSettings()
    for group, kind in GROUP_TYPES.items():
        assert isinstance(getattr(settings, group), kind)
        assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen, group


def test_overrides_and_errors():
    s = RunSettings.from_run_config({"gamma": 2, "firm.epsilon": 1e-4, "merge": "firm"})
    assert s.gamma == 2.0 and isinstance(s.gamma, float) and s.firm.epsilon == 1e-4
    assert (s.merge, s.wrapper, s.pipeline, s.strategy_label) == ("firm", "none", "unlearn", "firm")
    with pytest.raises(RunConfigError, match="unknown run-config key 'gama'"):
        RunSettings.from_run_config({"gama": 1.0})
    with pytest.raises(RunConfigError, match="'scenario.num-authors' must be int"):
        RunSettings.from_run_config({"scenario.num-authors": "many"})
    with pytest.raises(ValueError, match="scenario.forget-percent"):
        RunSettings.from_run_config({"scenario.forget-percent": 150.0})
    with pytest.raises(ValueError, match="'firm.epsilon' = 0.0"):
        RunSettings.from_run_config({"firm.epsilon": 0.0})


def test_merge_wrapper_and_pipeline_name_the_strategy():
    mpu = RunSettings.from_run_config({"wrapper": "mpu", "merge": "ties"})
    assert (mpu.merge, mpu.wrapper, mpu.strategy_label) == ("ties", "mpu", "mpu")
    assert mpu.output_name("t0").startswith("tofu-mpu-")
    dp2u = RunSettings.from_run_config({"pipeline": "dp2u"})
    assert (dp2u.pipeline, dp2u.strategy_label, dp2u.num_clients) == ("dp2u", "dp2u", 2)
    plugin = RunSettings(merge="my.merges:half sum")
    assert plugin.output_name("t0") == "tofu-my.merges_half_sum-t0"


# --- old flat keys: refused, naming the key to use --------------------------------------------


@pytest.mark.parametrize(
    "old,new",
    [
        ("alpha", "firm.alpha"),
        ("epsilon", "firm.epsilon"),
        ("num-forget-clients", "scenario.num-forget-clients"),
        ("scenario", "scenario.name"),
        ("model", "model.name"),
        ("model-path", "model.path"),
        ("objective", "objective.name"),
        ("lora-rank", "lora.rank"),
        ("mpu-copies", "mpu.copies"),
        ("mpu-merge", "merge"),
        ("dp2u-epsilon", "dp2u.epsilon"),
        ("eval-max-new-tokens", "eval.max-new-tokens"),
        ("forget-steps", "training.forget-steps"),
        ("substrate-hidden-size", "substrate.hidden-size"),
        ("max-upload-mb", "server.max-upload-mb"),
        ("stream-uploads", "upload.stream"),
    ],
)
def test_an_old_flat_key_is_refused_naming_its_new_key(old, new):
    value = RunSettings().as_dict()[new]  # even with a value the new key accepts
    with pytest.raises(RunConfigError) as refused:
        RunSettings.from_run_config({old: value})
    assert str(refused.value) == f"run-config key {old!r} was renamed: use {new!r}"


def test_the_old_strategy_key_is_refused_naming_merge_wrapper_and_pipeline():
    for value in ("firm", "mpu", "dp2u"):
        with pytest.raises(RunConfigError, match="'strategy' was split") as refused:
            RunSettings.from_run_config({"strategy": value})
        message = str(refused.value)
        assert "merge" in message and "wrapper = 'mpu'" in message
        assert "pipeline = 'dp2u'" in message


def test_unknown_groups_and_keys_are_refused_with_a_suggestion():
    with pytest.raises(RunConfigError, match=r"unknown run-config group 'frim' in 'frim\.alpha'"):
        RunSettings.from_run_config({"frim.alpha": 0.1})
    with pytest.raises(RunConfigError, match=r"did you mean 'firm'\?"):
        RunSettings.from_run_config({"frim.alpha": 0.1})
    with pytest.raises(
        RunConfigError, match=r"unknown run-config key 'firm\.alpah'.*'firm\.alpha'"
    ):
        RunSettings.from_run_config({"firm.alpah": 0.1})
    with pytest.raises(RunConfigError, match=r"unknown run-config key 'mpu\.copy'.*'mpu\.copies'"):
        RunSettings.from_run_config({"mpu.copy": 3})
    # nothing close: the group's keys are listed
    with pytest.raises(
        RunConfigError, match=r"'firm\.zzz'; its keys are: firm\.alpha, firm\.eps0, firm\.epsilon"
    ):
        RunSettings.from_run_config({"firm.zzz": 1})
    with pytest.raises(RunConfigError, match=r"unknown run-config group 'zzz'.*firm"):
        RunSettings.from_run_config({"zzz.alpha": 1})


def test_unknown_keys_name_close_matches():
    with pytest.raises(RunConfigError, match=r"unknown run-config key 'gama'.*'gamma'"):
        RunSettings.from_run_config({"gama": 1.0})
    with pytest.raises(
        RunConfigError, match=r"unknown run-config key 'zzz'.*keys are: seed, .*firm\.<key>"
    ):
        RunSettings.from_run_config({"zzz": 1})


def test_a_bad_value_in_a_group_is_refused_naming_its_dotted_key():
    with pytest.raises(RunConfigError) as refused:
        RunSettings.from_run_config({"firm.alpha": 2.0})
    assert "run-config key 'firm.alpha' = 2.0" in str(refused.value)
    assert "in (0, 1]" in str(refused.value)
    with pytest.raises(RunConfigError, match=r"'mpu\.copies' must be int, got 'two'"):
        RunSettings.from_run_config({"mpu.copies": "two"})
    with pytest.raises(RunConfigError, match=r"'lora\.rank' must be int, got True"):
        RunSettings.from_run_config({"lora.rank": True})


def test_output_dir_must_be_absolute(tmp_path):
    assert RunSettings(output_dir=str(tmp_path)).resolved_output_dir() == tmp_path
    with pytest.raises(ValueError, match="absolute"):
        RunSettings(output_dir="relative/out").resolved_output_dir()
    default = RunSettings().resolved_output_dir()
    assert default.is_absolute() and default.parent.name == "outputs"


def test_scenario_defaults_fill_only_unset_keys():
    wmdp = RunSettings.from_run_config({"scenario.name": "wmdp"})
    assert (wmdp.objective.name, wmdp.lora.targets, wmdp.scenario.num_forget_clients) == (
        "rmu",
        "down_proj",
        6,
    )
    assert wmdp.objective.rmu_steering == 100.0 and wmdp.objective.rmu_alpha == 100.0
    assert (wmdp.training.forget_steps, wmdp.gamma) == (30, 4.0)
    # an explicit value equal to nothing special is kept, also 0 (an RMU ablation)
    ablation = RunSettings.from_run_config(
        {"scenario.name": "wmdp", "objective.rmu-alpha": 0.0, "gamma": 2.0}
    )
    assert ablation.objective.rmu_alpha == 0.0 and ablation.gamma == 2.0
    assert RunSettings.from_run_config({"scenario.name": "muse"}).gamma == 3.0


def test_scenario_and_registry_model_defaults_are_dotted_run_config_keys():
    keys = RunSettings().as_dict()
    for name, scenario in SCENARIOS.items():
        assert scenario.defaults and set(scenario.defaults) <= set(keys), name
        settings = RunSettings.from_run_config({"scenario.name": name})
        assert {k: settings.as_dict()[k] for k in scenario.defaults} == scenario.defaults, name
    assert set(PRETRAINED_DEFAULTS) <= set(keys)
    real = RunSettings.from_run_config({"model.name": "smollm2-135m"}).as_dict()
    assert {k: real[k] for k in PRETRAINED_DEFAULTS} == PRETRAINED_DEFAULTS


@pytest.mark.parametrize(
    "key, value, unset",
    [
        ("training.retain-lr", 1e-3, 2e-4),
        ("eval.batch-size", 64, 16),
        ("eval.max-new-tokens", 32, 64),
        ("eval.retain-samples", 200, 20),
        ("scenario.retain-samples", 200, 40),
        ("training.fisher-batches", 20, 4),
        ("training.retain-steps", 40, 10),
    ],
)
def test_an_explicit_value_equal_to_the_builtin_default_wins_over_a_registry_models(
    key, value, unset
):
    """Issue 36, item 7: a key set to the very value the built-in model's default has is the
    user's choice, not "unset": the registry model's default does not replace it."""
    registry = {"model.name": "smollm2-135m"}
    assert RunSettings.from_run_config(registry).as_dict()[key] == unset
    assert RunSettings.from_run_config({**registry, key: value}).as_dict()[key] == value
    assert RunSettings.from_run_config({}).as_dict()[key] == value  # the built-in default
    # the same through Flower's merged run config (pyproject's defaults plus the override)
    merged = {**_pyproject_run_config(), **registry, key: value}
    assert RunSettings.from_run_config(merged).as_dict()[key] == value


def test_an_explicit_value_equal_to_a_default_wins_over_a_scenarios():
    muse = {"scenario.name": "muse", "model.name": "smollm2-135m"}
    assert RunSettings.from_run_config(muse).model.finetune_lr == 5e-4
    assert RunSettings.from_run_config({**muse, "model.finetune-lr": 1e-4}).model.finetune_lr == (
        1e-4
    )
    assert (
        RunSettings.from_run_config({**muse, "model.finetune-epochs": 6}).model.finetune_epochs == 6
    )
    with pytest.raises(RunConfigError, match="training.retain-lr"):
        RunSettings.from_run_config({"training.retain-lr": -1e-3})


@pytest.mark.parametrize(
    "config, expected",
    [
        ({}, False),  # the built-in model: a few short sequences, no memory to save
        ({"model.name": "smollm2-135m"}, True),
        ({"model.path": "/models/mine"}, True),
        ({"model.name": "smollm2-135m", "training.activation-checkpointing": "off"}, False),
        ({"training.activation-checkpointing": "on"}, True),
    ],
)
def test_activation_checkpointing_is_on_for_real_models_unless_set(config, expected):
    settings = RunSettings.from_run_config(config)
    assert settings.activation_checkpointing() is expected
    assert client_settings(settings)["activation-checkpointing"] is expected


def test_layer_defaults_follow_the_model_depth():
    wmdp = RunSettings.from_run_config({"scenario.name": "wmdp"})
    four, deep = wmdp.for_model(4), wmdp.for_model(32)
    assert (four.objective.rmu_layer, four.lora.layers) == (2, "1,2")
    assert (deep.objective.rmu_layer, deep.lora.layers) == (16, "15,16")
    assert wmdp.objective.rmu_layer == -1  # for_model gives a copy
    assert RunSettings.from_run_config({}).for_model(4).lora_layer_indices() is None
    with pytest.raises(ValueError, match="layers 0..3"):
        RunSettings.from_run_config({"scenario.name": "wmdp", "objective.rmu-layer": 7}).for_model(
            4
        )
    with pytest.raises(ValueError, match="LoRA layers"):
        RunSettings.from_run_config({"lora.layers": "one,two"})


@pytest.mark.parametrize(
    "config,message",
    [
        ({"scenario.data-path": "/data/tofu"}, "needs a real model"),
        ({"objective.name": "nll"}, "forget objective"),
        ({"objective.name": "dpo", "scenario.name": "wmdp"}, "plain text"),
        ({"objective.name": "idk", "scenario.name": "muse"}, "plain text"),
        (
            {"objective.name": "graddiff", "scenario.local-retain-samples": 0},
            "scenario.local-retain-samples",
        ),
        ({"objective.name": "nope"}, "'objective.name' = 'nope': must be one of dpo, ga"),
        ({"scenario.name": "nope"}, "'scenario.name' = 'nope': must be one of muse, tofu, wmdp"),
        ({"dp2u.forget-request": '{"0": {"records": [1]}}'}, "needs pipeline='dp2u'"),
        ({"pipeline": "dp2u", "evaluate": False}, "evaluate=false does not apply"),
        ({"pipeline": "dp2u", "wrapper": "mpu"}, "wrapper = 'mpu' does not apply"),
        ({"pipeline": "dp2u", "scenario.name": "muse"}, "runs on the tofu scenario"),
        ({"wrapper": "mpu", "mpu.copies": 1}, r"'mpu\.copies' = 1: mpu\.mode='mpu' needs >= 2"),
        ({"upload.fisher-fraction": 0.05}, r"'upload\.fisher-fraction' = 0\.05 is below"),
        ({"server.min-replies": 99}, r"'server\.min-replies' = 99: must be in \[0, 6\]"),
    ],
)
def test_combinations_refused_before_anything_runs(config, message):
    with pytest.raises(ValueError, match=message):
        RunSettings.from_run_config(config)


def test_dp2u_forget_request_inline_or_from_a_file(tmp_path):
    inline = RunSettings.from_run_config(
        {"pipeline": "dp2u", "dp2u.forget-request": '{"1": {"records": [3, 4]}}'}
    )
    assert [(r.client, r.records) for r in inline.forget_request()] == [(1, (3, 4))]
    path = tmp_path / "request.json"
    path.write_text('{"0": {"authors": ["Ann Lee"]}}')
    from_file = RunSettings.from_run_config({"pipeline": "dp2u", "dp2u.forget-request": str(path)})
    assert [(r.client, r.authors) for r in from_file.forget_request()] == [(0, ("Ann Lee",))]
    assert RunSettings().forget_request() == []
    with pytest.raises(ValueError, match="neither JSON nor a file"):
        RunSettings.from_run_config({"pipeline": "dp2u", "dp2u.forget-request": "nope.json"})
    with pytest.raises(ValueError, match="not valid JSON"):
        RunSettings.from_run_config({"pipeline": "dp2u", "dp2u.forget-request": "{1: 2}"})


# --- every key checked up front (issue 13): names, ranges, finiteness -----------------------

FLOAT_KEYS = [
    *(
        f.name.replace("_", "-")
        for f in dataclasses.fields(RunSettings)
        if type(f.default) is float
    ),
    *(_key(g, f) for g, f in _group_fields() if type(f.default) is float),
]
INF_MEANINGFUL = {"firm.epsilon"}  # FIRM's retention budget: inf = no projection


def _value(settings: RunSettings, key: str):
    """The value of a (dotted) run-config key on ``settings``."""
    group, dot, name = key.rpartition(".")
    owner = getattr(settings, group) if dot else settings
    return getattr(owner, name.replace("-", "_"))


@pytest.mark.parametrize(
    "config,message",
    [
        ({"merge": "nope"}, r"'merge' = 'nope'.*unknown merge.*firm"),
        ({"merge": "no_such_module_x:merge"}, r"No module named 'no_such_module_x'"),
        ({"wrapper": "mpu", "merge": "nope"}, r"'merge' = 'nope'.*unknown merge"),
        ({"merge": "dp2u"}, r"'merge' = 'dp2u'.*not a merge.*pipeline = 'dp2u'"),
        ({"merge": "mpu"}, r"'merge' = 'mpu'.*not a merge.*wrapper = 'mpu'"),
        ({"wrapper": "nope"}, r"'wrapper' = 'nope'.*one of mpu, none"),
        ({"pipeline": "nope"}, r"'pipeline' = 'nope'.*one of dp2u, unlearn"),
        ({"firm.solver": "fast"}, r"'firm.solver' = 'fast'.*one of exact, increase-only"),
        ({"ties.k": 0.0}, r"'ties.k' = 0.0.*in \(0, 1\]"),
        ({"ties.k": 1.5}, r"'ties.k' = 1.5.*in \(0, 1\]"),
        ({"fulm.k": math.nan}, r"'fulm.k' = nan.*in \(0, 1\]"),
        ({"fulm.threshold": 2.0}, r"'fulm.threshold' = 2.0.*in \[-1, 1\]"),
        ({"mpu.kappa": -0.5}, r"'mpu.kappa' = -0.5.*>= 0"),
        ({"mpu.kappa": math.inf}, r"'mpu.kappa' = inf.*finite"),
        ({"mpu.server-lr": 0.0}, r"'mpu.server-lr' = 0.0.*> 0"),
        ({"gamma": math.nan}, r"'gamma' = nan.*finite number > 0"),
        ({"gamma": "inf"}, r"'gamma' = inf.*finite number > 0"),
        ({"mpu.mode": "loud"}, r"'mpu.mode' = 'loud'.*one of clean, mpu, noised"),
        ({"mpu.publish": "once"}, r"'mpu.publish' = 'once'.*one of per-client, per-round"),
        ({"dp2u.method": "dp2u-sdg"}, r"'dp2u.method'.*did you mean 'dp2u-sgd'"),
        ({"objective.name": "npo2"}, r"'objective.name' = 'npo2'.*did you mean 'npo'"),
        ({"num-rounds": 0}, r"'num-rounds' = 0.*integer >= 1"),
        ({"objective.rmu-layer": -2}, r"'objective.rmu-layer' = -2.*>= 0, or -1"),
        (
            {"server.robust-norm-bound": 0.5},
            r"'server.robust-norm-bound' = 0.5.*>= 1, or 0 \(off\)",
        ),
        (
            {"scenario.name": "wmdp", "scenario.forget-domains": "bio,physics"},
            r"'scenario.forget-domains'.*'physics'",
        ),
        (
            {"scenario.name": "wmdp", "scenario.num-forget-clients": 1},
            r"'scenario.num-forget-clients' = 1: fewer than the 2 forget domains",
        ),
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
        assert _value(RunSettings.from_run_config({key: "inf"}), key) == math.inf
    else:
        with pytest.raises(RunConfigError, match=f"'{key}' = inf"):
            RunSettings.from_run_config({key: math.inf})


def test_float_keys_span_the_run_wide_keys_and_the_groups():
    assert {"gamma", "firm.alpha", "mpu.kappa", "dp2u.epsilon", "server.round-timeout"} <= set(
        FLOAT_KEYS
    )


def test_every_numeric_field_of_every_option_group_has_a_rule():
    numeric = [(g, f) for g, f in _group_fields() if type(f.default) in (int, float)] + [
        (None, f) for f in dataclasses.fields(RunSettings) if type(f.default) in (int, float)
    ]
    # every group has numbers but requests (its one key is the JSON schedule)
    assert {g for g, _ in numeric} == {*GROUP_TYPES, None} - {"requests"}
    missing = [f"{g}.{f.name}" if g else f.name for g, f in numeric if rule_of(f) is None]
    assert not missing, missing
    no_help = [_key(g, f) for g, f in _group_fields() if not f.metadata.get("help")]
    assert not no_help, no_help


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
        RunSettings.from_run_config({"merge": "issue13_broken:merge"})
    with pytest.raises(RunConfigError, match=r"'issue13_plugins:needs_beta'.*'beta'"):
        RunSettings.from_run_config({"merge": "issue13_plugins:needs_beta"})
    with pytest.raises(RunConfigError, match=r"'issue13_plugins:two_positionals'.*'other'"):
        RunSettings.from_run_config({"wrapper": "mpu", "merge": "issue13_plugins:two_positionals"})


def test_a_registry_model_gets_practical_lora_targets_and_a_cpu_sized_tofu_subset():
    settings = RunSettings.from_run_config(
        {"model.name": "smollm2-135m", "scenario.data-path": "/data/tofu", "lora.rank": 8}
    )
    assert settings.lora.targets == "q_proj,v_proj"
    assert settings.eval.max_new_tokens == 64
    assert settings.scenario.tofu_subset_authors == (200 if torch.cuda.is_available() else 4)
    assert settings.scenario_params().subset_authors == settings.scenario.tofu_subset_authors
    explicit = RunSettings.from_run_config(
        {
            "model.name": "smollm2-135m",
            "lora.targets": "q_proj",
            "scenario.tofu-subset-authors": 8,
        }
    )
    assert explicit.lora.targets == "q_proj" and explicit.scenario.tofu_subset_authors == 8


def test_a_registry_model_on_real_muse_files_gets_a_cpu_sized_subset_and_recipe():
    config = {
        "scenario.name": "muse",
        "model.name": "smollm2-135m",
        "scenario.data-path": "/data/muse-news",
    }
    settings = RunSettings.from_run_config(config)
    assert settings.scenario.muse_subset_texts == (100 if torch.cuda.is_available() else 16)
    assert settings.scenario_params().subset_texts == settings.scenario.muse_subset_texts
    assert (settings.model.finetune_epochs, settings.model.finetune_lr) == (8, 5e-4)
    explicit = RunSettings.from_run_config({**config, "scenario.muse-subset-texts": 4})
    assert explicit.scenario.muse_subset_texts == 4
    tofu = RunSettings.from_run_config(
        {"model.name": "smollm2-135m", "scenario.data-path": "/data/tofu"}
    )
    assert tofu.scenario_params().subset_texts == 0 and tofu.model.finetune_lr == 1e-4
    with pytest.raises(RunConfigError, match="scenario.muse-subset-texts"):
        RunSettings.from_run_config({"scenario.muse-subset-texts": 1})


def test_a_scenarios_registry_model_defaults_win_over_both_default_tables_not_over_the_user():
    """Scenario.pretrained_defaults: what a scenario needs on a pretrained model (MUSE's
    forgetting recipe) beats PRETRAINED_DEFAULTS and the scenario's own defaults; a key the
    user sets keeps its value, also one equal to a default."""
    muse = SCENARIOS["muse"]
    assert muse.pretrained_defaults
    real = {"scenario.name": "muse", "model.name": "smollm2-135m"}
    resolved = RunSettings.from_run_config(real).as_dict()
    assert {k: resolved[k] for k in muse.pretrained_defaults} == muse.pretrained_defaults
    builtin = RunSettings.from_run_config({"scenario.name": "muse"}).as_dict()
    for key in muse.pretrained_defaults:
        expected = muse.defaults.get(key, BUILTIN_DEFAULTS.get(key))
        if expected is None:
            continue
        assert builtin[key] == expected, key
        set_by_user = {**real, key: expected}
        assert RunSettings.from_run_config(set_by_user).as_dict()[key] == expected, key


def test_model_keys_are_checked():
    with pytest.raises(RunConfigError, match="model.name='smollm2-135m'"):
        RunSettings.from_run_config({"scenario.data-path": "/data/tofu"})
    with pytest.raises(RunConfigError, match="either model.name"):
        RunSettings.from_run_config({"model.name": "smollm2-135m", "model.path": "/ckpt"})
    with pytest.raises(RunConfigError, match="'model.name'.*smollm2-135m"):
        RunSettings.from_run_config({"model.name": "smollm3"})
    with pytest.raises(RunConfigError, match="scenario.tofu-subset-authors"):
        RunSettings.from_run_config({"scenario.tofu-subset-authors": 1})


def test_a_group_value_changes_by_a_nested_replace():
    settings = RunSettings.from_run_config({})
    cached = dataclasses.replace(
        settings, model=dataclasses.replace(settings.model, cache_dir="/cache")
    )
    assert cached.model.cache_dir == "/cache" and settings.model.cache_dir == ""
    assert cached.as_dict()["model.cache-dir"] == "/cache"
    assert RunSettings.from_run_config(cached.as_dict()) == cached


def test_training_seed_varies_the_clients_training_alone():
    """``training.seed`` reaches the clients as their seed; the data, the model and the
    evaluation keep ``seed`` (the substrate and the scenario's records do not change)."""
    base = RunSettings.from_run_config({"seed": 3})
    other = RunSettings.from_run_config({"seed": 3, "training.seed": 11})
    assert (base.client_seed(), other.client_seed()) == (3, 11)
    assert client_settings(base)["seed"] == 3 and client_settings(other)["seed"] == 11
    assert other.scenario_params() == base.scenario_params()
    assert other.substrate_config() == base.substrate_config()
    with pytest.raises(RunConfigError, match="training.seed"):
        RunSettings.from_run_config({"training.seed": -2})


def test_federated_learning_is_refused_where_clients_do_not_hold_the_knowledge():
    settings = RunSettings.from_run_config({"learn.source": "federated"})
    assert settings.learn.source == "federated" and settings.learn.strategy == "fedavg"
    with pytest.raises(RunConfigError, match="runs on the scenarios \\['tofu'\\], not 'wmdp'"):
        RunSettings.from_run_config({"learn.source": "federated", "scenario.name": "wmdp"})
    with pytest.raises(RunConfigError, match="pipeline='dp2u' trains its own federated stages"):
        RunSettings.from_run_config({"learn.source": "federated", "pipeline": "dp2u"})
    with pytest.raises(RunConfigError, match="'learn.strategy' = 'fedsgd': must be one of"):
        RunSettings.from_run_config({"learn.strategy": "fedsgd"})


def test_mixed_clients_fold_onto_forget_nodes_within_what_the_run_has():
    settings = RunSettings.from_run_config(
        {"scenario.mixed-clients": 1, "scenario.num-forget-clients": 2}
    )
    assert settings.num_clients == 2  # two forget nodes, one of them keeps the retain records
    with pytest.raises(RunConfigError, match="2 forget and 1 retain clients \\(at most 1\\)"):
        RunSettings.from_run_config({"scenario.mixed-clients": 2, "scenario.num-forget-clients": 2})
    with pytest.raises(RunConfigError, match="not supported there"):
        RunSettings.from_run_config({"scenario.mixed-clients": 1, "wrapper": "mpu"})
    with pytest.raises(RunConfigError, match="pipeline='unlearn' only"):
        RunSettings.from_run_config({"scenario.mixed-clients": 1, "pipeline": "dp2u"})
    scheduled = RunSettings.from_run_config(
        {
            "scenario.mixed-clients": 1,
            "requests.schedule": '{"1": {"0": {"records": [1]}}}',
        }
    )
    assert scheduled.num_clients == 6  # every client holds records; mixed when it is asked
