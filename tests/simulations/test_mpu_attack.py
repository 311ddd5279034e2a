"""The MPU threat-model study end to end on the small built-in substrate.

The published copies come from MPU's own publishing functions and the attacker only from
:mod:`fedunlearn.mpu.alignment`, so what is asserted is what the docs state: without a defense
the aligned copies land far closer to θ than one copy; with noise shared by the copies the
aligned estimate stays about as far as one copy; the single noisy copy cannot be denoised by
the server (its one-step update error is the largest).
"""

from __future__ import annotations

import json

import pytest

from simulations import mpu_attack
from tests.simulations.presets import SMALL_TOFU

pytestmark = pytest.mark.slow


def test_study_measures_the_leak_and_the_defenses(tmp_path, substrate_cache) -> None:
    out = tmp_path / "attack"
    mpu_attack.main(
        [
            "--run-config",
            SMALL_TOFU,
            "--cache-dir",
            str(substrate_cache),
            "--kappas",
            "0.01",
            "--copies",
            "2",
            "--defense-copies",
            "2",
            "--defenses",
            "none,shared-noise,single-copy",
            "--texts",
            "8",
            "--output-dir",
            str(out),
        ]
    )
    summary = json.loads((out / "mpu_attack.json").read_text())
    cells = {(c["defense"], c["permute_groups"]): c for c in summary["cells"]}
    assert set(cells) == {
        ("none", True),
        ("none", False),
        ("shared-noise", True),
        ("single-copy", True),
    }
    for permute in (True, False):
        none = cells[("none", permute)]
        one = none["estimates"]["one_copy"]
        aligned = none["estimates"]["aligned_harmonic"]
        assert none["leak_ratio"] > 5
        assert aligned["kl"] < one["kl"] / 10
        assert aligned["weight_error"] < one["weight_error"] / 5
        naive = none["estimates"]["naive_mean"]
        assert naive["max_dlogit"] > one["max_dlogit"]  # unaligned copies do not average
        # the attacker cannot pick by the distance to θ: the harmonic estimate is reported as
        # the leak, the better of the two only as the upper bound
        assert none["attacker_estimate"] == "aligned_harmonic"
        assert none["leak_ratio"] == none["leak_ratios"]["aligned_harmonic"]
        assert none["leak_upper_bound"] == max(none["leak_ratios"].values())
    shared = cells[("shared-noise", True)]
    assert shared["leak_ratio"] < 2 and shared["leak_upper_bound"] < 2
    single = cells[("single-copy", True)]
    assert single["leak_ratio"] == pytest.approx(1.0)
    assert single["denoise_error"] > cells[("none", True)]["denoise_error"]
    # the scenario's metrics of the recovered model next to the server's and one copy's
    scored = cells[("none", True)]["scenario"]
    assert set(scored) == {"one_copy", "recovered"}
    assert summary["server_metrics"]["model_utility"] is not None
    table = (out / "mpu_attack.md").read_text()
    assert "| none | 0.01 | 0 | 2 | on |" in table
    assert "| shared-noise | 0.01 | 0.01 | 2 | on |" in table
    assert (out / "mpu_attack.png").stat().st_size > 10_000


def test_a_default_runs_copies_aligned_are_no_closer_than_one_copy(tmp_path, substrate_cache):
    """The run's defaults (κ = 0.01, m = 2, shared-kappa left at -1: κ_η = 1.5 κ): a client that
    aligns its copies ends within 1.5× of one copy's distance to θ, by the estimate it would
    use and even by the better of the two (which needs θ to pick)."""
    out = tmp_path / "defaults"
    argv = ["--run-config", SMALL_TOFU, "--cache-dir", str(substrate_cache), "--texts", "8"]
    mpu_attack.main([*argv, "--run-defaults", "--no-evaluate", "--output-dir", str(out)])
    (cell,) = json.loads((out / "mpu_attack.json").read_text())["cells"]
    assert (cell["defense"], cell["kappa"], cell["m"]) == ("shared-noise", 0.01, 2)
    assert cell["shared_kappa"] == pytest.approx(0.015)
    assert cell["leak_ratio"] <= 1.5 and cell["leak_upper_bound"] <= 1.5
