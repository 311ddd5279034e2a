"""The generated configuration reference and the presets in presets/."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from flwr.common.config import flatten_dict, parse_config_args

from simulations import config_reference
from simulations.run_local import parse_config_pairs
from strategies.settings import RunConfigError, RunSettings

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted((REPO / "presets").glob("*.toml"))


def _defaults() -> dict:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return flatten_dict(pyproject["tool"]["flwr"]["app"]["config"])


def test_reference_is_current_and_lists_every_key() -> None:
    assert config_reference.main(["--check"]) == 0
    text = config_reference.REFERENCE.read_text()
    for key in RunSettings().as_dict():
        assert f"| `{key}` |" in text, key
    # a rule and a help line per key: the FIRM budget says it takes inf, the fraction its range
    assert '| `firm.epsilon` | `"inf"` | a number > 0 (inf allowed) |' in text
    assert "| `firm.alpha` | `0.1` | a finite number in (0, 1] |" in text


def test_reference_check_fails_when_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "config-reference.md"
    stale.write_text(config_reference.reference().replace("firm.alpha", "firm.alpa"))
    monkeypatch.setattr(config_reference, "REFERENCE", stale)
    assert config_reference.main(["--check"]) == 1


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_every_preset_is_a_valid_run_config(preset: Path) -> None:
    overrides = parse_config_args([str(preset)])  # what `flwr run --run-config <file>` reads
    assert overrides and all(k in _defaults() for k in overrides)
    settings = RunSettings.from_run_config({**_defaults(), **overrides})
    for key, value in overrides.items():
        assert settings.as_dict()[key] == value


def test_presets_cover_the_scenarios_and_the_server_variants() -> None:
    labels = {}
    for preset in PRESETS:
        s = RunSettings.from_run_config({**_defaults(), **parse_config_args([str(preset)])})
        labels[preset.stem] = (s.scenario.name, s.strategy_label, s.model.name)
    assert labels["wmdp"][0] == "wmdp" and labels["muse"][0] == "muse"
    assert labels["mpu"][1] == "mpu" and labels["dp2u"][1] == "dp2u"
    assert labels["smollm2"][2] == "smollm2-135m"


def test_run_local_reads_a_preset_then_pairs(tmp_path: Path) -> None:
    pairs = parse_config_pairs(f"{REPO / 'presets' / 'mpu.toml'} mpu.copies=3 gamma=2.0")
    assert pairs["wrapper"] == "mpu" and pairs["mpu.copies"] == 3 and pairs["gamma"] == 2.0
    bad = tmp_path / "bad.toml"
    bad.write_text("[firm]\nalpa = 0.2\n")
    with pytest.raises(RunConfigError, match=r"firm\.alpa.*did you mean 'firm\.alpha'"):
        RunSettings.from_run_config({**_defaults(), **parse_config_pairs(str(bad))})
